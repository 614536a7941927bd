#!/usr/bin/env python3
"""Each instruction set's kernel files (*_avx2.cpp, *_avx512.cpp, *_avx512bf16.cpp, *_amx.cpp) are
compiled with their own -m flags. A function with vague linkage (an inline function, a template
instantiation such as std::vector<T>'s growth) defined both by one of them and by a file of the
baseline flags is one symbol to the linker, which keeps one copy for every caller: if it keeps the
kernel file's copy, baseline code runs AVX2 or AVX-512 instructions and dies of SIGILL on a CPU
without them (docs/RELIABILITY.md, "One binary, several instruction sets").

This check reads the objects of the library (their weak symbols, by file) and the linked binary
(the copies it kept): every symbol defined both in a kernel file and in a baseline file must be,
in the binary, free of instructions past x86-64's baseline (VEX/EVEX mnemonics, mask registers,
tiles, BMI2). Exit status 1 lists the offenders; 77 (CTest's skip) where the tools or objects
are missing.

usage: check_isa_copies.py BINARY OBJECT_DIR
"""
import os
import re
import shutil
import subprocess
import sys

KERNEL_FILE = re.compile(r"_(avx2|avx512|avx512bf16|amx)\.cpp\.o$")
# Mnemonics past the baseline: VEX/EVEX forms all start with "v" (baseline has only verr/verw),
# mask-register and tile instructions, and the BMI2 ones the AVX-512 flags enable.
BEYOND_BASELINE = re.compile(
    r"^(v(?!err|erw)\w+|k(and|or|xor|not|mov|shift|test|unpck|add)\w*|tile\w+|ldtilecfg|sttilecfg|tdp\w+|"
    r"shlx|shrx|sarx|rorx|bzhi|pdep|pext|mulx)$")


def weak_symbols(obj):
    out = subprocess.run(["nm", "--defined-only", obj], capture_output=True, text=True, check=True).stdout
    names = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] == "W":  # weak functions: inline functions, template instantiations
            names.add(fields[2])
    return names


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    binary, object_dir = sys.argv[1], sys.argv[2]
    if not (shutil.which("nm") and shutil.which("objdump")):
        print("nm or objdump not found: skipped")
        return 77
    kernel, baseline = set(), set()
    for root, _, files in os.walk(object_dir):
        for f in files:
            if f.endswith(".o"):
                (kernel if KERNEL_FILE.search(f) else baseline).update(weak_symbols(os.path.join(root, f)))
    if not kernel:
        print(f"no kernel objects under {object_dir} (a build without x86 kernel files): skipped")
        return 77
    shared = kernel & baseline
    # One disassembly of the binary, split by function.
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", binary], capture_output=True, text=True,
                             check=True).stdout
    header = re.compile(r"^[0-9a-f]+ <(.+)>:$")
    offenders, current, seen = {}, None, set()
    for line in listing.splitlines():
        m = header.match(line)
        if m:
            current = m.group(1) if m.group(1) in shared else None
            if current:
                seen.add(current)
            continue
        parts = line.split("\t")
        if current is None or len(parts) < 2 or not parts[1].split():
            continue
        mnemonic = parts[1].split()[0]
        if BEYOND_BASELINE.match(mnemonic):
            offenders.setdefault(current, mnemonic)
    print(f"{len(shared)} symbols defined by both kernel and baseline files; {len(seen)} of them in {binary}")
    if offenders:
        demangled = subprocess.run(["c++filt"], input="\n".join(offenders), capture_output=True, text=True).stdout.split("\n")
        for (name, mnemonic), pretty in zip(offenders.items(), demangled):
            print(f"kernel file's copy kept for baseline callers: {pretty or name} (runs {mnemonic})")
        return 1
    print("every shared copy in the binary is baseline code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
