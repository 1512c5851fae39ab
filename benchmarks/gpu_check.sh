#!/usr/bin/env bash
# Everything batchkit checks on a GPU, in one command, in under 8 minutes, with nothing downloaded:
#
#   1. machine:  nvidia-smi, python, torch (INFO)
#   2. deps:     pure-Python packages the image may lack (anyio, pytest, ...), installed from a
#                carried wheelhouse into a temporary folder, only those whose import fails
#   3. probe:    benchmarks/gpu_probe.py: CuPy header lookup, compile + load of every kernel
#                instantiation, vector and scalar (misaligned) paths, gather / scatter /
#                copy_blocks against the torch reference bit for bit, the gather bounds guard,
#                ordering on a side stream, CUDA-graph capture + replay, the chained copy race,
#                host time per launch (each check in its own process with its own timeout)
#   4. tests:    pytest -m gpu tests/cuda/test_kernels_gpu.py
#   5. models:   pytest -m gpu tests/cuda/test_models_gpu.py: Qwen2 and Mistral (tiny, random, from
#                configs) through the continuous loop on the GPU, token-equal to transformers'
#                generate() there (needs transformers in the image; INFO if it is missing)
#   6. bench:    benchmarks/kv_kernels.py (GB/s of the kernels against torch's indexing)
#
# Each step prints one OK / FAIL / INFO line (its full output goes to the log) and the script
# never stops early. Exit status: 0 when no step failed.
#
#   bash benchmarks/gpu_check.sh
#
# Environment:
#   PY          the Python to use (default: python3, the image's, with torch + CUDA + CuPy)
#   WHEELHOUSE  folder of wheels for step 2 (default: ../shared/gpu-first-contact/wheelhouse)
#   OUT         if set, a folder that receives gpu_check.log, summary.txt, results.json,
#               probe.json, gpu_tests.xml and kv_kernels.json
#   BUDGET_S    total seconds (default 450)
set -u
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
WHEELHOUSE="${WHEELHOUSE:-../shared/gpu-first-contact/wheelhouse}"
BUDGET_S="${BUDGET_S:-450}"
OUT="${OUT:-}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
RES="${OUT:-$WORK}"
mkdir -p "$RES"
LOG="$RES/gpu_check.log"
: >"$LOG"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
START=$SECONDS
STEPS=()

left() { echo $((BUDGET_S - (SECONDS - START))); }

# limit NAME_BUDGET: this step's timeout, never past the total budget (keeps 10 s for the summary)
limit() {
  local want=$1 rest
  rest=$(($(left) - 10))
  [ "$rest" -lt "$want" ] && want=$rest
  [ "$want" -lt 1 ] && want=1
  echo "$want"
}

# record STATUS NAME SECONDS MESSAGE
record() {
  local line
  line=$(printf '%-4s %-7s (%4ss) %s' "$1" "$2" "$3" "$4")
  echo "$line"
  echo "$line" >>"$LOG"
  STEPS+=("$1|$2|$3|$4")
}

# run NAME TIMEOUT CMD...: runs with a timeout, output appended to the log; sets RC and TOOK
run() {
  local name=$1 t=$2
  shift 2
  local t0=$SECONDS
  echo "===== $name: $* (timeout ${t}s)" >>"$LOG"
  timeout --kill-after=5 "$t" "$@" >>"$LOG" 2>&1
  RC=$?
  TOOK=$((SECONDS - t0))
  [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ] && echo "===== $name: timed out after ${t}s" >>"$LOG"
}

echo "gpu_check: $(date -u +%FT%TZ), budget ${BUDGET_S}s, python $PY, results in ${OUT:-(not kept: set OUT)}"

# ---------------------------------------------------------------- 1. machine
t0=$SECONDS
GPU=$(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 4 | tr '\n' ';')
{ echo "===== machine"; timeout 20 nvidia-smi 2>&1; } >>"$LOG"
TORCH=$(timeout 60 "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.is_available())" 2>&1 | tail -n 1)
HAVE_GPU=0
case "$TORCH" in *"device True"*) HAVE_GPU=1 ;; esac
if [ "$HAVE_GPU" -eq 1 ]; then
  record INFO machine $((SECONDS - t0)) "${GPU:-nvidia-smi unavailable} python $TORCH"
else
  record FAIL machine $((SECONDS - t0)) "torch sees no CUDA device (nvidia-smi: ${GPU:-none}; python: $TORCH)"
fi

# ---------------------------------------------------------------- 2. pure-Python dependencies
# module:wheel-name pairs; only those whose import fails are installed, without their
# dependencies (each dependency is in the list itself), so nothing the image has is shadowed.
t0=$SECONDS
NEEDED="numpy:numpy anyio:anyio idna:idna sniffio:sniffio typing_extensions:typing_extensions
  pytest:pytest pluggy:pluggy iniconfig:iniconfig packaging:packaging pytest_timeout:pytest-timeout"
if timeout 30 "$PY" -c "import sys; sys.exit(sys.version_info >= (3, 11))"; then
  NEEDED="$NEEDED exceptiongroup:exceptiongroup tomli:tomli"
fi
MISSING=""
for pair in $NEEDED; do
  timeout 60 "$PY" -c "import ${pair%%:*}" >/dev/null 2>&1 || MISSING="$MISSING ${pair#*:}"
done
if [ -z "$MISSING" ]; then
  record OK deps $((SECONDS - t0)) "all present"
else
  EXTRA="$WORK/site"
  mkdir -p "$EXTRA"
  echo "===== deps: installing$MISSING from $WHEELHOUSE into $EXTRA" >>"$LOG"
  if timeout 60 "$PY" -m pip --version >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELHOUSE" --target "$EXTRA" $MISSING >>"$LOG" 2>&1
  else
    # No pip: a pure-Python wheel is a zip laid out as site-packages.
    for w in $MISSING; do
      f=$(ls "$WHEELHOUSE"/"$(echo "$w" | tr - _)"-*.whl 2>/dev/null | head -n 1)
      [ -n "$f" ] && timeout 60 "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$f" "$EXTRA" >>"$LOG" 2>&1
    done
  fi
  export PYTHONPATH="$PYTHONPATH:$EXTRA"
  STILL=""
  for pair in $NEEDED; do
    timeout 60 "$PY" -c "import ${pair%%:*}" >/dev/null 2>&1 || STILL="$STILL ${pair#*:}"
  done
  if [ -z "$STILL" ]; then
    record OK deps $((SECONDS - t0)) "installed from the wheelhouse:$MISSING"
  else
    record FAIL deps $((SECONDS - t0)) "still missing:$STILL (wheelhouse: $WHEELHOUSE)"
  fi
fi

# ---------------------------------------------------------------- 3. probe
T=$(limit 200)
run probe "$T" "$PY" benchmarks/gpu_probe.py --json "$RES/probe.json" --budget $((T - 5))
PROBE_LINES=$(sed -n '/^===== probe:/,/^===== /p' "$LOG" | grep -E '^(OK|FAIL|INFO) ')
echo "$PROBE_LINES" | sed 's/^/     | /'
PROBE_SUM=$(sed -n '/^===== probe:/,$p' "$LOG" | grep '^probe: ' | tail -n 1)
if [ "$HAVE_GPU" -ne 1 ]; then
  record FAIL probe "$TOOK" "no CUDA device, so only the device-free checks ran"
elif [ "$RC" -eq 0 ]; then
  record OK probe "$TOOK" "${PROBE_SUM:-no summary}"
elif [ "$RC" -eq 124 ] || [ "$RC" -eq 137 ]; then
  record FAIL probe "$TOOK" "timed out after ${T}s; ${PROBE_SUM:-no summary}"
else
  record FAIL probe "$TOOK" "rc $RC; ${PROBE_SUM:-no summary}"
fi

# ---------------------------------------------------------------- 4. GPU tests
T=$(limit 180)
run tests "$T" "$PY" -m pytest -q -m gpu tests/cuda/test_kernels_gpu.py -p no:cacheprovider -ra --junitxml="$RES/gpu_tests.xml"
TESTS_SUM=$(sed -n '/^===== tests:/,$p' "$LOG" | grep -E '(passed|failed|skipped|error|no tests ran)' | tail -n 1)
if [ "$HAVE_GPU" -ne 1 ]; then
  record FAIL tests "$TOOK" "no CUDA device, so nothing ran (${TESTS_SUM:-rc $RC})"
elif [ "$RC" -eq 0 ] && ! echo "$TESTS_SUM" | grep -q skipped; then
  record OK tests "$TOOK" "$TESTS_SUM"
elif [ "$RC" -eq 0 ]; then
  record FAIL tests "$TOOK" "some GPU tests were skipped: $TESTS_SUM"
else
  record FAIL tests "$TOOK" "rc $RC: ${TESTS_SUM:-no summary}"
fi

# ---------------------------------------------------------------- 5. models on the GPU
T=$(limit 120)
if timeout 60 "$PY" -c "import transformers" >/dev/null 2>&1; then
  run models "$T" "$PY" -m pytest -q -m gpu tests/cuda/test_models_gpu.py -p no:cacheprovider -ra
  MODELS_SUM=$(sed -n '/^===== models:/,$p' "$LOG" | grep -E '(passed|failed|skipped|error|no tests ran)' | tail -n 1)
  if [ "$RC" -eq 0 ] && [ "$HAVE_GPU" -eq 1 ] && ! echo "$MODELS_SUM" | grep -q skipped; then
    record OK models "$TOOK" "$MODELS_SUM"
  else
    record FAIL models "$TOOK" "rc $RC: ${MODELS_SUM:-no summary}"
  fi
else
  record INFO models 0 "transformers is not installed in this image: the token-equality run did not happen"
fi

# ---------------------------------------------------------------- 6. bandwidth benchmark
T=$(limit 120)
run bench "$T" "$PY" benchmarks/kv_kernels.py --json "$RES/kv_kernels.json"
BENCH_TABLE=$(sed -n '/^===== bench:/,$p' "$LOG" | grep -vE '^=====')
echo "$BENCH_TABLE" | sed 's/^/     | /'
if [ "$RC" -eq 0 ] && [ "$HAVE_GPU" -eq 1 ]; then
  record OK bench "$TOOK" "GB/s table above (and in kv_kernels.json with OUT)"
else
  record FAIL bench "$TOOK" "rc $RC: $(echo "$BENCH_TABLE" | tail -n 1)"
fi

# ---------------------------------------------------------------- summary
FAILED=0
for s in "${STEPS[@]}"; do [ "${s%%|*}" = FAIL ] && FAILED=$((FAILED + 1)); done
TOTAL=$((SECONDS - START))
echo "gpu_check: ${#STEPS[@]} steps, $FAILED failed, ${TOTAL}s"
if [ -n "$OUT" ]; then
  {
    echo "gpu_check $(date -u +%FT%TZ): ${#STEPS[@]} steps, $FAILED failed, ${TOTAL}s"
    for s in "${STEPS[@]}"; do
      IFS='|' read -r st name sec msg <<<"$s"
      printf '%-4s %-7s (%4ss) %s\n' "$st" "$name" "$sec" "$msg"
    done
    [ -n "$PROBE_LINES" ] && printf '\nprobe:\n%s\n' "$PROBE_LINES"
    [ -n "$BENCH_TABLE" ] && printf '\nkv_kernels.py:\n%s\n' "$BENCH_TABLE"
  } >"$OUT/summary.txt"
  for s in "${STEPS[@]}"; do printf '%s\n' "$s"; done | "$PY" -c '
import json, sys
steps = []
for line in sys.stdin.read().splitlines():
    status, name, seconds, message = line.split("|", 3)
    steps.append({"step": name, "status": status, "seconds": int(seconds), "message": message})
json.dump({"steps": steps, "failed": [s["step"] for s in steps if s["status"] == "FAIL"],
           "seconds": int(sys.argv[1])}, open(sys.argv[2], "w"), indent=2)
' "$TOTAL" "$OUT/results.json" || echo "gpu_check: could not write results.json"
fi
[ "$FAILED" -eq 0 ]
