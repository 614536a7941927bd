#!/usr/bin/env bash
# Creates (once) the virtual environment build/venv with what the Python package and its parity
# suite need, from PyPI, and installs the package into it. Later runs reuse it and only rebuild
# the extension when sources changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-build/venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "Creating the virtual environment $VENV"
  python3 -m venv "$VENV"
fi
# torch comes from PyPI (large: the first install downloads it, later ones reuse pip's cache).
if ! "$VENV/bin/python" -c "import numpy, pytest, torch, safetensors, nanobind, scikit_build_core" 2>/dev/null; then
  echo "Installing Python packages into $VENV (numpy, pytest, torch, safetensors, nanobind, scikit-build-core)"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q numpy pytest torch safetensors "nanobind>=2.0" "scikit-build-core>=0.10"
fi
echo "Building and installing the mha Python package into $VENV"
"$VENV/bin/pip" install -q --no-build-isolation .
