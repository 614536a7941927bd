"""The Python extension links its own copy of the library: the copies of shared inline functions
and template instantiations its link kept must be code every caller's CPU runs, as for the C++
test binary (tests/check_isa_copies.py; docs/RELIABILITY.md, "One binary, several instruction
sets")."""
import glob
import os
import platform
import shutil
import subprocess
import sys

import pytest

import mha

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_extension_keeps_code_every_caller_runs():
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no x86 kernel files on this machine")
    if not (shutil.which("nm") and shutil.which("objdump")):
        pytest.skip("nm or objdump not found")
    # The extension as installed, and the build directory whose library objects went into it.
    installed = mha._mha.__file__
    builds = [d for d in glob.glob(os.path.join(ROOT, "build", "python", "*"))
              if os.path.isdir(os.path.join(d, "CMakeFiles", "mha.dir"))
              and os.path.basename(installed) in os.listdir(d)]
    if not builds:
        pytest.skip(f"no build directory of {os.path.basename(installed)} under build/python")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "check_isa_copies.py"), installed,
                             os.path.join(builds[0], "CMakeFiles", "mha.dir")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
