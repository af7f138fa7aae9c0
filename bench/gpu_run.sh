#!/usr/bin/env bash
# A GPU run in time-boxed steps, in the order named, most important first:
#   bash bench/gpu_run.sh [--out DIR] [STEP...]
# With no step named, one call of about eight minutes (boxes 170 + 190 + 60 + 30 s, and 30 s for the install
# and the archive), which leaves a machine lent for fifteen minutes room to rerun one step:
#   kernel_tests   every kernel and op test compiled for this GPU, both half dtypes: the casts and arithmetic
#                  the CPU's interpreter is held to first (tests/kernels), then each op's tests, the fused layer
#                  and the packed encoder, the ops' registration last; 13 parallel shards (bench/tools/
#                  pytest_shards.py). Box 170 s: 320 of the 416 tests of seven shards ran in 103 s on an H200.
#   bench          python -m fused_vision bench --headline --profile, one process: the forward stem ops and the
#                  layer kernels at image_32x280 beside compiled stock, both encoders (stock, compiled, packed,
#                  fused, with the attention each took) at image_8x280 and video_32x70; then bench/goals.py, the
#                  project's goals judged from its results.csv. Box 190 s (its --time-budget 150: a run of
#                  budget 200 took 234 s; compiled rows are the first it skips, and it lists what it skipped)
#   attention      bench/tools/attention_paths.py: every attention path this machine has, both towers' heads,
#                  image 8x280, video 32x70, image 8x1120: time, share of matmul, error vs float64. Box 60 s
#   planner_check  the planner's memory model against measured tower peaks. Box 30 s (took 14 s)
# The other steps, for a second call where time is left (a failed step of the first goes first):
#   gpu_tests      pytest -m gpu tests/gpu: the ops at real Gemma 4 shapes (bit-identity at B=32 N=2520
#                  D=1152, > 2**31 elements, patch_embed's error vs float64, the pooler and its gradient,
#                  the table gradient, the packed and fused encoders' outputs and gradients vs float64
#                  at both towers' layer shapes), with syncs forbidden and in CUDA graphs. Box 270 s: 46
#                  tests took 97 s and 154 s; it has 75 now, flex attention compiling five times
#   vllm_encoder   bench/vllm_encoder.py: vLLM's encoder calls stock vs packed vs fused, 26B/31B and E4B,
#                  image 8x280 and video 32x70, bf16; vLLM's ReplicatedLinear where vLLM imports, else
#                  transformers' nn.Linear (the same F.linear). Box 60 s (took 26 s and 38 s)
#   profile        bench/tools/profile_kernels.py: each op's kernel at image_32x280 beside variants that
#                  each take one cost away (pre-cast pixels, cuBLAS alone, id checks off). Box 60 s (took 37 s)
#   ncu            the same kernels, one launch each, under Nsight Compute (speed of light, memory,
#                  occupancy, launch, warp states) into ncu.txt; skipped, with a note, where ncu is missing.
#                  Box 60 s (took 34 s)
#   encoder_compiled  both encoders at image 8x280, video 32x70 and image 8x1120: stock, torch.compile
#                  of it, fused, profiled; then the goals on those rows (six compiles of 25 to 60 s). Box 480 s
#   epilogue       with FUSED_VISION_GATE_UP_EPILOGUE=1: the gate/up GEMM with the GELU gate in its epilogue
#                  against cuBLAS + the gate kernel (gate_up_gelu's fused and separate rows), and both
#                  encoders' fused rows with it, image 8x280 and video 32x70, beside the bench step's
#                  fused rows without it. Box 240 s
# Results go to DIR (--out DIR, else GPU_RUN_OUT, else bench/out/gpu_run): the bench's files, gpu_run.log, and
# checks.tgz with the rest (the shards' logs and JUnit XML, attention_paths.md, the planner's rows, the GPU
# tests' XML, vllm_encoder.md, ncu.txt), so DIR holds few files.
# Exits non-zero if any step failed; later steps still run.
# Each box is cut to what is left before GPU_RUN_DEADLINE_S (default: the chosen steps' boxes plus 30 s of
# install and archive, counted from the start), so a slow or hung step costs its own results, not the later
# steps' or the archive. A box sends SIGINT: the bench then writes the reports of what it measured, the XML
# and the logs keep every test and planner row that finished; the archive is written after every step.
# GPU_RUN_DRY=1 runs the same steps at toy sizes on any machine (tests/test_scripts.py does, on a CPU under
# TRITON_INTERPRET=1), to test this script, in boxes three times as long; its gpu_tests and kernel_tests
# run a few of their files. PYTHON: default python3.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${GPU_RUN_OUT:-$root/bench/out/gpu_run}"
steps=()
while [ "$#" -gt 0 ]; do
  case $1 in
    --out)
      [ "$#" -ge 2 ] || { echo "gpu_run.sh: --out needs a folder" >&2; exit 2; }
      out=$2; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    -h | --help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    -*) echo "gpu_run.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) steps+=("$1"); shift ;;
  esac
done
out="$(realpath -m "$out")"  # absolute, from the caller's folder: the steps run from the root or a staged copy
cd "$root" || exit 1
python="${PYTHON:-python3}"
dry=${GPU_RUN_DRY:-0}
# The casts and arithmetic first, then the fastest to compile, so the box cuts the slowest: a lookup kernel
# builds in under a second, each autotuned pooler and embedder config in 2 to 3 s (Triton 3.6), and their
# tests build many; the ops' registration, which runs kernels the op tests ran already, last.
kernel_tests=(tests/kernels/test_common.py tests/kernels/test_arithmetic.py tests/kernels/test_first_call.py
  tests/test_validation.py tests/ops/test_position_embeddings.py tests/ops/test_pool_by_positions.py
  tests/ops/test_patch_embed.py tests/ops/test_residual_rms_norm.py tests/ops/test_gelu_gate.py
  tests/ops/test_qkv_norm_rope.py tests/ops/test_gate_up_gelu.py tests/encoder/test_fused_layer.py
  tests/encoder/test_packed.py tests/ops/test_registration.py tests/ops/test_transforms.py)
gpu_tests_args=()
if [ "$dry" != 0 ]; then
  export FUSED_VISION_GPU_TESTS_SMOKE=1  # tests/gpu at tiny sizes, on the CPU where no GPU is
  # Its fused encoders take three minutes under the interpreter; tests/test_scripts.py runs them on its own.
  gpu_tests_args=(--ignore tests/gpu/test_fused_encoder.py)
  bench_args=(--tiny --quick --ops position_embeddings --providers onehot,fused)
  planner_args=(--device cpu --tiny)
  kernel_tests=(tests/test_validation.py)
  shards_args=(--shards 2)
  vllm_encoder_args=(--tiny)
  profile_args=(--tiny)
  compiled_args=(--tiny --quick --ops encoder_26b_31b --cases image_8x280)
  epilogue_args=(--tiny --quick --ops gate_up_gelu --providers fused,separate)
  attention_args=(--tiny)
  ncu=()  # the profiled calls run bare
else
  bench_args=(--time-budget 150 --profile)
  planner_args=()
  shards_args=()
  vllm_encoder_args=()
  profile_args=()
  compiled_args=(--time-budget 450 --ops encoder --cases image_8x280,video_32x70,image_8x1120)
  epilogue_args=(--time-budget 210 --ops gate_up_gelu,encoder --cases image_8x280,video_32x70 --providers fused,separate)
  attention_args=()
  # --clock-control none: the clocks as in the timed runs. The sections: what bounds a kernel and why.
  ncu_path="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)"
  ncu=("$ncu_path" --clock-control none
    --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
    --section LaunchStats --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats)
  [ -n "$ncu_path" ] || ncu=(missing)  # the step says so and runs nothing
fi
# Each step's time box in seconds, and the steps of a call with no arguments.
declare -A box=([kernel_tests]=170 [bench]=190 [attention]=60 [planner_check]=30 [gpu_tests]=270
  [vllm_encoder]=60 [profile]=60 [ncu]=60 [encoder_compiled]=480 [epilogue]=240)
if [ "$dry" != 0 ]; then  # the interpreter at toy sizes, on CPUs a test suite's other workers share: 3x the boxes
  for name in "${!box[@]}"; do box[$name]=$((box[$name] * 3)); done
fi
[ "${#steps[@]}" -gt 0 ] || steps=(kernel_tests bench attention planner_check)
default_deadline=30  # install and archive, then the steps' boxes
for name in "${steps[@]}"; do
  if [ -z "${box[$name]:-}" ]; then
    echo "gpu_run.sh: unknown step '$name': expected any of kernel_tests, bench, attention, planner_check, gpu_tests, vllm_encoder, profile, ncu, encoder_compiled, epilogue" >&2
    exit 2
  fi
  default_deadline=$((default_deadline + box[$name]))
done
deadline=$((SECONDS + ${GPU_RUN_DEADLINE_S:-$default_deadline}))
checks="$(mktemp -d)"
mkdir -p "$out"
exec > >(tee "$out/gpu_run.log") 2>&1
tee_pid=$!
# bash does not wait for a process substitution: close its pipe and wait, so the log is whole on exit.
trap 'exec >&- 2>&-; wait "$tee_pid"' EXIT
export PYTHONUNBUFFERED=1
export TRITON_PRINT_AUTOTUNING=1  # the log keeps each key's winning tile, to prune the candidates later

archive() {  # after every step, run or skipped: a run cut short still keeps the finished steps' files
  tar -czf "$checks.tgz" -C "$checks" . && mv "$checks.tgz" "$out/checks.tgz"  # built outside DIR, moved whole
}

status=0
step() {  # step NAME COMMAND...: run, time-box, time and record one step without stopping the others
  local name=$1 limit=${box[$1]}; shift
  local left=$((deadline - SECONDS - 15))  # 15 s kept for the archive
  if [ "$left" -lt 20 ]; then
    echo "=== $name skipped: ${left} s left before the deadline"
    status=1
    archive
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (box ${limit} s): $*"
  local start=$SECONDS code=0
  # SIGINT at the box, so Python writes what it has and pytest prints its summary; SIGKILL 15 s later.
  # --foreground: the signal goes to the step once (not again to its process group, mid-report).
  timeout --foreground -s INT -k 15 "$limit" "$@" || code=$?
  if [ "$code" -eq 124 ]; then
    echo "=== $name reached its time box (what ran is in the log and its report)"
    # Only the kernel tests may stop short by design; a checking step cut short did not check everything.
    [ "$name" = kernel_tests ] || status=1
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

# The steps are for a GPU (without one the GPU tests skip, which pytest counts a pass): stop before installing.
if [ "$dry" = 0 ] && ! "$python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_run.sh: no CUDA GPU here (GPU_RUN_DRY=1 runs the steps at toy sizes on any machine)"
  exit 2
fi
# A GPU machine may reach no package index: --no-index keeps pip from trying one (its version check
# included), and the install builds with the setuptools it has. Where it cannot (an old setuptools), the
# steps run in a copy of the tree laid out as installed (fused_vision.kernels from kernels/), rather than
# lose the run to a packaging error; only the version then reads 0+unknown. The copy is also the working
# directory, which `python -m` puts first.
if ! "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
  staged="$(mktemp -d)"
  cp -r pyproject.toml fused_vision bench tests "$staged/" && cp -r kernels "$staged/fused_vision/kernels" || exit 1
  cd "$staged" || exit 1
  export PYTHONPATH="$staged${PYTHONPATH:+:$PYTHONPATH}"
  echo "pip could not install fused_vision: running from a staged copy of the source in $staged"
fi
"$python" -c "import torch, triton, transformers, fused_vision; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fused_vision', fused_vision.__version__, 'from', fused_vision.__path__[0], torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true

for name in "${steps[@]}"; do
  case $name in
    # xunit1: the XML keeps the figures the tests record (errors against float64, largest differences).
    gpu_tests) step gpu_tests "$python" -m pytest -m gpu -v --durations=0 -p no:cacheprovider \
      -o junit_family=xunit1 --junitxml "$checks/gpu_tests.xml" "${gpu_tests_args[@]}" tests/gpu ;;
    # A missed goal is a verdict, not a failure: only a goals script that cannot read the run fails the step.
    bench) step bench "$python" -m fused_vision bench --headline --out "$out" "${bench_args[@]}"
      [ ! -f "$out/results.csv" ] || "$python" bench/goals.py "$out/results.csv" || status=1 ;;
    planner_check) step planner_check "$python" bench/planner_check.py --out "$checks" "${planner_args[@]}" ;;
    # No -x: one failure must not hide the rest of a run that happens once; --maxfail still stops a cascade.
    kernel_tests) step kernel_tests "$python" bench/tools/pytest_shards.py --out "$checks/kernel_tests" \
      "${shards_args[@]}" -- --maxfail=10 -p no:cacheprovider "${kernel_tests[@]}" ;;
    vllm_encoder) step vllm_encoder "$python" bench/vllm_encoder.py --out "$checks" "${vllm_encoder_args[@]}" ;;
    profile) step profile "$python" bench/tools/profile_kernels.py "${profile_args[@]}" ;;
    # Without Nsight Compute there is nothing to profile with: a note, not a failure of the run.
    ncu) if [ "${ncu[0]:-}" = missing ]; then echo "=== ncu skipped: no Nsight Compute (ncu) on this machine"
      else step ncu "${ncu[@]}" ${ncu[0]:+--log-file "$checks/ncu.txt"} \
        "$python" bench/tools/profile_kernels.py --profile "${profile_args[@]}"; fi ;;
    attention) step attention "$python" bench/tools/attention_paths.py --out "$checks" "${attention_args[@]}" ;;
    encoder_compiled) step encoder_compiled "$python" -m fused_vision bench --out "$checks/encoder_compiled" \
      --providers stock,compiled,fused --profile "${compiled_args[@]}"
      [ ! -f "$checks/encoder_compiled/results.csv" ] || "$python" bench/goals.py "$checks/encoder_compiled/results.csv" || status=1 ;;
    epilogue) step epilogue env FUSED_VISION_GATE_UP_EPILOGUE=1 "$python" -m fused_vision bench \
      --out "$checks/epilogue" "${epilogue_args[@]}"
      [ ! -f "$checks/epilogue/results.csv" ] || "$python" bench/goals.py "$checks/epilogue/results.csv" || status=1 ;;
  esac
done

cat "$out/results.md" 2>/dev/null
exit "$status"
