#!/usr/bin/env bash
# The whole H200 run in one command, for one device lease (~15 min of device time, start-up included):
#   1. correctness at real shapes (bench/gpu_checks.py: bit-identity at B=32 N=2520 D=1152, > 2**31 elements,
#      patch_embed's error vs float64, the pooler (rows past 2**31 too), the table gradient)  ~1 min
#   2. the benchmark (python -m fused_vision bench, --time-budget bounds it)    ~3.5 min
#   3. the planner's memory model against measured tower peaks                  ~1 min
#   4. the kernel tests on the GPU, in the time left (they build ~200 kernels)  <= 2.5 min
# Bench files land in $OUT directly (6 files); everything else in $OUT/checks.tgz and $OUT/h200.log, so the
# 8-file limit on what comes back holds. Exits non-zero if any step failed; later steps still run.
#   device tool: run(command="bash bench/h200.sh", timeout_s=570); about 9 min expected, plus start-up
# Each step has a time box, cut to what is left before H200_DEADLINE_S (default 540 s after the start, under
# the device call's 570 s), so a slow or hung step costs its own results, not the later steps' or the
# archive. A box sends SIGINT: the bench then writes the reports of what it measured, gpu_checks.json and
# the logs keep every check and planner row that finished.
# H200_DRY_RUN=1 runs the same steps at toy sizes on any machine (tests/test_scripts.py does, on a CPU
# under TRITON_INTERPRET=1), so a lease is never spent debugging this script. PYTHON: default python3.
set -uo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${OUT:-bench/out/h200}")"  # absolute: the steps may run from a staged copy (below)
python="${PYTHON:-python3}"
# Fastest to compile first, so the box cuts the slowest: a lookup kernel builds in under a second, each
# autotuned pooler and embedder config in 2 to 3 s (Triton 3.6), and their tests build many.
gpu_tests=(tests/test_validation.py tests/test_position_embeddings.py tests/test_pooler.py tests/test_patch_embed.py)
if [ -n "${H200_DRY_RUN:-}" ]; then
  gpu_checks_args=(--smoke)
  bench_args=(--tiny --quick --ops lookup --providers onehot,fused)
  planner_args=(--device cpu --tiny)
  gpu_tests=(tests/test_validation.py)
else
  gpu_checks_args=()
  bench_args=(--time-budget 200)
  planner_args=()
fi
deadline=$((SECONDS + ${H200_DEADLINE_S:-540}))
checks="$(mktemp -d)"
mkdir -p "$out"
exec > >(tee "$out/h200.log") 2>&1
tee_pid=$!
# bash does not wait for a process substitution: close its pipe and wait, so the log is whole on exit.
trap 'exec >&- 2>&-; wait "$tee_pid"' EXIT
export PYTHONUNBUFFERED=1
export TRITON_PRINT_AUTOTUNING=1  # the log keeps each key's winning tile, to prune the candidates later

archive() {  # after every step, run or skipped: a run cut short still brings back the finished steps' files
  tar -czf "$checks.tgz" -C "$checks" . && mv "$checks.tgz" "$out/checks.tgz"  # built outside $OUT: no 9th file
}

status=0
step() {  # step NAME BOX_S COMMAND...: run, time-box, time and record one step without stopping the others
  local name=$1 box=$2; shift 2
  local left=$((deadline - SECONDS - 15))  # 15 s kept for the archive
  if [ "$left" -lt 20 ]; then
    echo "=== $name skipped: ${left} s left before the deadline"
    status=1
    archive
    return
  fi
  [ "$box" -gt "$left" ] && box=$left
  echo "=== $name (box ${box} s): $*"
  local start=$SECONDS code=0
  # SIGINT at the box, so Python writes what it has and pytest prints its summary; SIGKILL 15 s later.
  # --foreground: the signal goes to the step once (not again to its process group, mid-report).
  timeout --foreground -s INT -k 15 "$box" "$@" || code=$?
  if [ "$code" -eq 124 ]; then
    echo "=== $name reached its time box (what ran is in the log and its report)"
    # Only the kernel tests may stop short by design; a checking step cut short did not check everything.
    [ "$name" = gpu_tests ] || status=1
  elif [ "$code" -eq 137 ]; then
    echo "=== $name KILLED: still running 15 s after its time box's SIGINT"
    status=1
  elif [ "$code" -ne 0 ]; then
    echo "=== $name FAILED (exit $code)"
    status=1
  fi
  echo "=== $name took $((SECONDS - start)) s"
  archive
}

# The device reaches no registry: --no-index keeps pip from trying one (its version check included), and
# the install builds with the setuptools it has. Where it cannot (an old setuptools), the steps run in a
# copy of the tree laid out as installed (fused_vision.kernels from kernels/), rather than lose the lease
# to a packaging error; only the version then reads 0+unknown. The copy is also the working directory,
# which `python -m` puts first.
if ! "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
  staged="$(mktemp -d)"
  cp -r pyproject.toml fused_vision bench tests "$staged/" && cp -r kernels "$staged/fused_vision/kernels" || exit 1
  cd "$staged" || exit 1
  export PYTHONPATH="$staged${PYTHONPATH:+:$PYTHONPATH}"
  echo "pip could not install fused_vision: running from a staged copy of the source in $staged"
fi
"$python" -c "import torch, triton, transformers, fused_vision; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fused_vision', fused_vision.__version__, 'from', fused_vision.__path__[0], torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true

step gpu_checks 150 "$python" bench/gpu_checks.py --out "$checks" "${gpu_checks_args[@]}"
step bench 330 "$python" -m fused_vision bench --out "$out" "${bench_args[@]}"
step planner_check 120 "$python" bench/planner_check.py --out "$checks" "${planner_args[@]}"
# No -x: one failure must not hide the rest of a run that happens once; --maxfail still stops a cascade.
step gpu_tests 150 "$python" -m pytest -q --maxfail=10 -p no:cacheprovider "${gpu_tests[@]}" --junitxml "$checks/gpu_tests.xml"

cat "$out/results.md" 2>/dev/null
exit "$status"
