# Cross-compiling for 64-bit Arm Linux with Debian's toolchain (g++-aarch64-linux-gnu) and its
# arm64 libraries (multiarch: libopenblas-dev:arm64, libgtest-dev:arm64); make test-aarch64 runs
# the suite under qemu-aarch64. On an Arm machine itself no toolchain file is needed.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# Headers of arch-independent packages (nlohmann_json) live in /usr/include and /usr/share;
# libraries come from the arm64 multiarch directories only.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /usr)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# Static executables: qemu-aarch64 7.2 (Debian 12) hangs a dynamically linked guest in its first
# pthread_create, while a static one runs its threads.
# MHA_TEST_EMULATOR tells the tests (test_support.hpp) what they run under.
set(CMAKE_CROSSCOMPILING_EMULATOR env;MHA_TEST_EMULATOR=qemu-aarch64;qemu-aarch64)
set(CMAKE_EXE_LINKER_FLAGS_INIT -static)
set(CMAKE_USER_MAKE_RULES_OVERRIDE ${CMAKE_CURRENT_LIST_DIR}/static-archives.cmake)
set(BLA_STATIC ON)
