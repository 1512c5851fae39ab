#!/usr/bin/env bash
# Everything that needs a GPU, in one go (under five minutes on an H100/H200):
# the bit-exact kernel tests, then the kernel bandwidth benchmark.
#
#   bash benchmarks/gpu_check.sh            # uses .venv if present, else python3
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}src"
"$PY" - <<'PYEOF' || { echo "gpu_check: no CUDA device visible to torch"; exit 1; }
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
PYEOF
echo "== GPU tests"
"$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider
tests=$?
echo "== kernel bandwidth"
"$PY" benchmarks/kv_kernels.py
bench=$?
echo "== summary: gpu tests $([ $tests -eq 0 ] && echo PASSED || echo FAILED), benchmark $([ $bench -eq 0 ] && echo ran || echo FAILED)"
[ $tests -eq 0 ] && [ $bench -eq 0 ]
