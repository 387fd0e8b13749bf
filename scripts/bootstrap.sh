#!/usr/bin/env bash
# Creates .venv and installs trueflow into it. Idempotent: a second run installs nothing new.
# torch==2.13.0 goes in first: on a CPU machine an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
stamp=.venv/.trueflow-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/pip install -q -e ".[test]"
    touch "$stamp"
fi
