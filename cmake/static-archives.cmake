# Read after CMake's platform files (CMAKE_USER_MAKE_RULES_OVERRIDE, set by the Arm toolchain
# file), which would otherwise put .so back first: every library is then found as its archive,
# for static executables (libgomp, libpng, zlib; OpenBLAS through FindBLAS's BLA_STATIC).
set(CMAKE_FIND_LIBRARY_SUFFIXES .a)
