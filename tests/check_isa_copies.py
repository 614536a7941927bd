#!/usr/bin/env python3
"""Each instruction set's kernel files (*_avx2.cpp, *_avx512.cpp, *_avx512bf16.cpp, *_amx.cpp) compile
their kernels for it in a region of target attributes (src/cpu/isa_region.hpp). A function with
vague linkage (an inline function, a template instantiation such as std::vector<T>'s growth)
compiled inside such a region and also defined by a file of another instruction set is one symbol
to the linker, which keeps one copy for every caller: if it keeps the copy of the higher
instruction set, callers of the lower one run AVX2 or AVX-512 instructions and die of SIGILL on a
CPU without them (docs/RELIABILITY.md, "One binary, several instruction sets").

Two checks. (1) The rule the regions keep, independent of any link: every weak function a kernel
object defines is code of the lowest instruction set among the library's files that define it,
and baseline code unless it is internal to the library (mha::detail): a program linking libmha.a
may define the function itself (mha::Error's destructor from the public headers,
std::vector<float>'s growth). (2) What one link
kept: every symbol defined by the library's files of more than one instruction set (baseline,
AVX2, AVX-512, AVX512-BF16, AMX) must be, in the binary, code of the lowest of them. Baseline code
has no VEX/EVEX instruction, mask register, tile or BMI2 instruction; AVX2 code no EVEX instruction
(prefix 0x62) or tile; AVX-512 code no bfloat16 instruction or tile; AVX512-BF16 code no tile.
Exit status 1 lists the offenders; 77 (CTest's skip) where the tools or objects are missing.

usage: check_isa_copies.py BINARY OBJECT_DIR
"""
import os
import re
import shutil
import subprocess
import sys

# Instruction sets from lowest to highest, each by its kernel files' suffix.
LEVELS = ["baseline", "avx2", "avx512", "avx512bf16", "amx"]
KERNEL_FILE = re.compile(r"_(avx2|avx512|avx512bf16|amx)\.cpp\.o$")
TILE = re.compile(r"^(tile\w+|ldtilecfg|sttilecfg|tdp\w+)$")
BF16 = re.compile(r"^(vdpbf16ps|vcvtne2ps2bf16|vcvtneps2bf16)$")
# Mnemonics past the baseline: VEX/EVEX forms all start with "v" (baseline has only verr/verw),
# mask-register and tile instructions, and the BMI2 ones the AVX-512 level enables.
BEYOND_BASELINE = re.compile(
    r"^(v(?!err|erw)\w+|k(and|or|xor|not|mov|shift|test|unpck|add)\w*|tile\w+|ldtilecfg|sttilecfg|tdp\w+|"
    r"shlx|shrx|sarx|rorx|bzhi|pdep|pext|mulx)$")
# Prefixes that may stand before an EVEX prefix (segment overrides, address size).
LEGACY_PREFIXES = {"26", "2e", "36", "3e", "64", "65", "67"}


def is_evex(raw):
    """raw: the instruction's bytes as objdump prints them. 0x62 opens an instruction only as the
    EVEX prefix in 64-bit mode (BOUND is gone)."""
    i = 0
    while i < len(raw) and raw[i] in LEGACY_PREFIXES:
        i += 1
    return i < len(raw) and raw[i] == "62"


def beyond(level, mnemonic, raw):
    """Whether an instruction is past what CPUs of this level run."""
    if level == "baseline":
        return bool(BEYOND_BASELINE.match(mnemonic))
    if level == "avx2":
        return is_evex(raw) or bool(TILE.match(mnemonic))
    if level == "avx512":
        return bool(BF16.match(mnemonic) or TILE.match(mnemonic))
    if level == "avx512bf16":
        return bool(TILE.match(mnemonic))
    return False


def level_of(path):
    m = KERNEL_FILE.search(path)
    return m.group(1) if m else "baseline"


def weak_symbols(obj):
    out = subprocess.run(["nm", "--defined-only", obj], capture_output=True, text=True, check=True).stdout
    names = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] == "W":  # weak functions: inline functions, template instantiations
            names.add(fields[2])
    return names


def disassembly(path, wanted):
    """(function, mnemonic, raw bytes) of each instruction of the functions in wanted."""
    listing = subprocess.run(["objdump", "-d", path], capture_output=True, text=True, check=True).stdout
    header = re.compile(r"^[0-9a-f]+ <(.+)>:$")
    current = None
    for line in listing.splitlines():
        m = header.match(line)
        if m:
            current = m.group(1) if m.group(1) in wanted else None
            if current:
                yield current, None, None
            continue
        # "  addr:\tbytes \tmnemonic operands"; a long instruction's last bytes continue on a line
        # without a mnemonic (its prefixes are on the first).
        parts = line.split("\t")
        if current is None or len(parts) < 3 or not parts[2].split():
            continue
        yield current, parts[2].split()[0], parts[1].split()


def report(offenders, what):
    demangled = subprocess.run(["c++filt"], input="\n".join(offenders), capture_output=True, text=True).stdout.split("\n")
    for (name, detail), pretty in zip(offenders.items(), demangled):
        print(what.format(name=pretty or name, detail=detail))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    binary, object_dir = sys.argv[1], sys.argv[2]
    if not (shutil.which("nm") and shutil.which("objdump")):
        print("nm or objdump not found: skipped")
        return 77
    weak_of = {}  # object -> its weak symbols
    for root, _, files in os.walk(object_dir):
        for f in files:
            if f.endswith(".o"):
                weak_of[os.path.join(root, f)] = weak_symbols(os.path.join(root, f))
    kernel_objects = [o for o in weak_of if level_of(o) != "baseline"]
    if not kernel_objects:
        print(f"no kernel objects under {object_dir} (a build without x86 kernel files): skipped")
        return 77
    failed = False

    levels_of = {}  # weak symbol -> the levels of the library's files defining it
    for obj, names in weak_of.items():
        for name in names:
            levels_of.setdefault(name, set()).add(level_of(obj))

    # (1) Each kernel object's weak functions, against the lowest level that may call them.
    exported = {}
    for obj in kernel_objects:
        for name, mnemonic, raw in disassembly(obj, weak_of[obj]):
            internal = name.startswith("_ZN3mha6detail")
            lowest = min(levels_of[name], key=LEVELS.index) if internal else "baseline"
            if mnemonic and beyond(lowest, mnemonic, raw):
                exported.setdefault(name, f"{mnemonic}, {os.path.basename(obj)}, for {lowest} callers")
    print(f"{len(kernel_objects)} kernel objects; {len(exported)} weak functions of theirs past their callers' level")
    if exported:
        report(exported, "kernel file's copy of a shared function runs {detail}: {name}")
        failed = True

    # (2) The copies the binary kept: each of the lowest instruction set among its definers.
    shared = {name: min(levels, key=LEVELS.index) for name, levels in levels_of.items() if len(levels) > 1}
    offenders, seen = {}, set()
    for name, mnemonic, raw in disassembly(binary, shared):
        seen.add(name)
        if mnemonic and beyond(shared[name], mnemonic, raw):
            offenders.setdefault(name, f"{shared[name]} callers, runs {mnemonic}")
    print(f"{len(shared)} symbols defined by files of different instruction sets; {len(seen)} of them in {binary}")
    if offenders:
        report(offenders, "copy kept for {detail}: {name}")
        failed = True
    if failed:
        return 1
    print("every shared copy is code of the lowest instruction set that calls it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
