#!/usr/bin/env bash
# Create (or reuse) a virtual environment with everything the library, its tests,
# examples and benchmarks need.  Usage: scripts/install.sh [VENV_DIR]
set -euo pipefail
VENV="${1:-.venv}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
"$PY" -m pip install -q --upgrade pip
# The CPU build of torch 2.13.0 first: an unpinned torch would pull a multi-GB CUDA build.
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[test,docs,bench]" "torch==2.13.0"
# laplace-torch 0.3 is a test/benchmark peer.  Install it without its dependencies so it
# cannot replace torch, then its dependencies constrained to the installed torch, and
# drop torchvision (laplace-torch works without it; a mismatched one breaks the import).
"$PY" -m pip install -q --no-deps "laplace-torch==0.3" "asdfghjkl==0.1a4"
"$PY" -m pip install -q curvlinops-for-pytorch backpack-for-pytorch opt-einsum torchmetrics "torch==2.13.0"
"$PY" -m pip uninstall -q -y torchvision || true
"$PY" -c "import torch, sklearn, skorch, laplace, sklearn_lla; print('installed: torch', torch.__version__, 'sklearn', sklearn.__version__, 'skorch', skorch.__version__)"
