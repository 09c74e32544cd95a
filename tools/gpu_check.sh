#!/usr/bin/env bash
# The first command to run on a machine with a GPU: environment, build for sm_90, one quick case
# of every CUDA kernel family (forward and backward of fa1 and fa2 in both dtypes, the register and
# shared-memory softmax, the small-tile fallbacks, decode/KV cache, varlen, block-sparse, dropout),
# compute-sanitizer (memcheck, racecheck, synccheck) per family, the CUDA benchmark against torch
# SDPA, the CUDA pytest files, the full CUDA C++ suites, and the forward's HBM bytes under Nsight
# Compute (bench_io, where ncu is on PATH), in that order.
#
#   bash tools/gpu_check.sh OUTDIR [STEP ...]     (from any directory)
#   bash tools/gpu_check.sh --list                (the step names, in order)
#   bash tools/gpu_check.sh --detect              ("gpu: ..." or "no gpu: why"; nothing else runs)
#
# Each step writes its own log into OUTDIR and one line into OUTDIR/summary.txt: the step, PASS,
# FAIL (exit code) or SKIPPED (why), its wall seconds, its log and the log's last line. A failing
# step is reported and the next one still runs. Every step runs under `timeout`, capped both by its
# own limit and by what is left of the run's budget (GPU_CHECK_BUDGET_S, default 480 s, so that a
# run ends well inside ten minutes). A step the budget no longer covers is SKIPPED (time budget)
# and the closing `rerun:` line names it: a first run on a fresh machine also builds, so a second
# run may be needed to finish the list.
# Naming steps runs only those (build is added when the C++ tests or the installed flashdl are
# missing).
#
# Two settings make the most of a short lease (both off by default):
#   GPU_CHECK_JOBS=N      run up to N steps at once (the correctness steps share the GPU); the
#                         benchmarks (bench, bench_io) always run alone, nothing beside them
#   GPU_CHECK_CPP_DIR=D   the CUDA C++ test executables were built elsewhere for this GPU: D is
#                         the archive tools/gpu_prebuild.sh makes on a machine with nvcc and no
#                         GPU, or a build tree holding tests/cpp/cuda: the C++ steps run those
#                         tests, and the build step builds only the Python module, beside the
#                         C++ steps when GPU_CHECK_JOBS > 1
# After every step OUTDIR/gpu_check.tar.gz is rewritten with all of OUTDIR, so two files
# (summary.txt and that archive) carry the whole run off the machine.
#
# With no GPU (nvidia-smi missing or failing and the driver library seeing no device, or an
# installed CUDA build of flashdl reporting 0 devices) every step is SKIPPED (no GPU) at once,
# nothing is built, and the exit status is 0. The exit status is 1 iff some step FAILED.
set -uo pipefail

STEPS=(env build
       quick_forward quick_backward quick_block_sparse quick_kvcache quick_varlen quick_extras
       cpp_forward_smem_softmax cpp_forward_fallback cpp_backward_fallback
       memcheck_forward memcheck_backward memcheck_block_sparse memcheck_kvcache memcheck_varlen
       memcheck_extras
       racecheck_forward racecheck_backward racecheck_block_sparse racecheck_kvcache
       synccheck_forward synccheck_backward synccheck_block_sparse synccheck_kvcache
       bench pytest_cuda
       cpp_forward cpp_backward cpp_block_sparse cpp_kvcache cpp_varlen cpp_extras
       wide_offsets profile profile_source pytest_all bench_io)

usage() {
  echo "usage: bash tools/gpu_check.sh OUTDIR [STEP ...] | --list | --detect" >&2
  echo "steps: ${STEPS[*]}" >&2
  exit 2
}

if [ "${1:-}" = "--list" ]; then
  printf '%s\n' "${STEPS[@]}"
  exit 0
fi
DETECT_ONLY=""
OUTDIR=""
if [ "${1:-}" = "--detect" ]; then
  DETECT_ONLY=1
  set --
else
  [ $# -ge 1 ] && [ -n "$1" ] && [ "${1#-}" = "$1" ] || usage
  OUTDIR_ARG=$1
  shift
  for s in "$@"; do
    [[ " ${STEPS[*]} " == *" $s "* ]] || { echo "unknown step '$s'" >&2; usage; }
  done
  mkdir -p "$OUTDIR_ARG" || usage
  OUTDIR=$(cd "$OUTDIR_ARG" && pwd)
fi
SELECTED=("$@")

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
MIN_STEP_S=15  # a step with less time than this left is not started: it could only time out
JOBS=${GPU_CHECK_JOBS:-1}
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "GPU_CHECK_JOBS must be a positive integer" >&2; exit 2; }
BUILD_DIR=build/gpu
PREBUILT=""
CUDA_TESTS=$BUILD_DIR/tests/cpp/cuda
if [ -n "${GPU_CHECK_CPP_DIR:-}" ]; then
  PREBUILT_DIR=$GPU_CHECK_CPP_DIR
  if [ -f "$GPU_CHECK_CPP_DIR" ]; then  # an archive made by tools/gpu_prebuild.sh
    PREBUILT_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_tests.XXXXXX") &&
      tar -C "$PREBUILT_DIR" -xJf "$GPU_CHECK_CPP_DIR" ||
      { echo "GPU_CHECK_CPP_DIR=$GPU_CHECK_CPP_DIR: not an archive tar -xJ can unpack" >&2; exit 2; }
    trap 'rm -rf "$PREBUILT_DIR"' EXIT  # every step has ended by then (the script waits)
  fi
  [ -d "$PREBUILT_DIR/tests/cpp/cuda" ] ||
    { echo "GPU_CHECK_CPP_DIR=$GPU_CHECK_CPP_DIR has no tests/cpp/cuda" >&2; exit 2; }
  PREBUILT=1
  CUDA_TESTS=$(cd "$PREBUILT_DIR/tests/cpp/cuda" && pwd)
fi
# The smallest opt-in shared memory of an sm_80+ GPU (sm_86/89/120, 99 KiB): under this cap the
# launchers pick the smaller-tile variants that an H100 (227 KiB) never does.
SMEM_LIMIT=101376
START=$(date +%s)
SUMMARY=$OUTDIR/summary.txt

# ---- is there a GPU? (decided before anything is built, so a machine without one is done fast) ----
# Devices the driver library itself counts: a GPU is usable even where nvidia-smi is not installed.
DRIVER_DEVICES='
import ctypes
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    print(0)
else:
    n = ctypes.c_int(0)
    ok = cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0
    print(n.value if ok else 0)'
# An installed CUDA build of flashdl: its device count and status ("-" when there is none to ask).
FLASHDL_DEVICES='
import flashdl
i = flashdl.info()
print(i["cuda_device_count"] if "cuda" in i["backends"] else "-", i["cuda_status"])'

GPU=""
NO_GPU_WHY=""
if command -v nvidia-smi >/dev/null 2>&1; then
  GPU=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -m1 '^GPU ')
fi
if [ -z "$GPU" ]; then
  n=$(timeout 30 "$PYTHON" -c "$DRIVER_DEVICES" 2>/dev/null)
  if [ "${n:-0}" -gt 0 ] 2>/dev/null; then
    GPU="$n device(s) counted by libcuda (nvidia-smi unavailable)"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    NO_GPU_WHY="nvidia-smi fails or lists no GPU, and libcuda counts none"
  else
    NO_GPU_WHY="nvidia-smi not found, and libcuda counts none"
  fi
fi
if [ -n "$GPU" ]; then
  read -r fd_count fd_status <<<"$(cd /tmp && timeout 60 "$PYTHON" -c "$FLASHDL_DEVICES" 2>/dev/null || echo -)"
  if [ "${fd_count:--}" = "0" ]; then
    NO_GPU_WHY="the installed flashdl (a CUDA build) sees 0 devices: ${fd_status:-}"
    GPU=""
  fi
fi

if [ -n "$DETECT_ONLY" ]; then
  if [ -n "$GPU" ]; then echo "gpu: $GPU"; else echo "no gpu: $NO_GPU_WHY"; fi
  exit 0
fi

# ---- which steps run -----------------------------------------------------------------------------
selected() {
  [ ${#SELECTED[@]} -eq 0 ] && return 0
  [[ " ${SELECTED[*]} " == *" $1 "* ]]
}

if [ -n "$GPU" ] && [ ${#SELECTED[@]} -gt 0 ] && ! selected build; then
  # A fresh device machine starts bare: later steps need the build, so run it when it is missing.
  if [ ! -x "$CUDA_TESTS/test_cuda_forward" ] ||
     ! (cd /tmp && "$PYTHON" -c "import flashdl, sys; sys.exit('cuda' not in flashdl.info()['backends'])") 2>/dev/null; then
    SELECTED+=(build)
    BUILD_ADDED=1
  fi
fi

COMPUTE_SANITIZER=""
for c in "$(command -v compute-sanitizer 2>/dev/null)" \
         "$(dirname "$(readlink -f "$(command -v nvcc 2>/dev/null || echo /nonexistent)")")/compute-sanitizer" \
         /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  if [ -n "$c" ] && [ -x "$c" ]; then COMPUTE_SANITIZER=$c; break; fi
done

# ---- the summary -----------------------------------------------------------------------------------
{
  echo "# tools/gpu_check.sh $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$( [ -n "$(git status --porcelain 2>/dev/null)" ] && echo ' with local changes')"
  echo "# gpu: ${GPU:-none (${NO_GPU_WHY})}"
  echo "# budget ${BUDGET} s; steps: ${SELECTED[*]:-all}${BUILD_ADDED:+ (build added: no build or install found)}"
  echo "# ${JOBS} step(s) at once; C++ tests: ${CUDA_TESTS}${PREBUILT:+ (prebuilt: the build step builds the Python module only)}"
  printf '%-22s %-22s %6s  %-26s %s\n' "step" "status" "secs" "log" "last line of the log"
} >"$SUMMARY"
cat "$SUMMARY"

record() {  # record NAME STATUS SECONDS LOG
  local note="" line
  if [ "$4" != "-" ] && [ -s "$OUTDIR/$4" ]; then
    note=$(grep -v '^[[:space:]]*$' "$OUTDIR/$4" | tail -n 1 | cut -c1-100)
  fi
  line=$(printf '%-22s %-22s %6s  %-26s %s' "$1" "$2" "$3" "$4" "$note" | sed 's/ *$//')
  echo "$line" >>"$SUMMARY"
  echo "$line"
}

# run_step NAME CAP_SECONDS LOG FUNCTION: FUNCTION runs in its own bash under `timeout`, its output
# in OUTDIR/LOG. Functions and the variables they read are exported for that bash.
run_step() {
  local name=$1 cap=$2 log=$3 fn=$4
  if [ -z "$GPU" ]; then record "$name" "SKIPPED (no GPU)" 0 "-"; return; fi
  if ! selected "$name"; then record "$name" "SKIPPED (not named)" 0 "-"; return; fi
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    record "$name" "SKIPPED (time budget)" 0 "-"
    return
  fi
  local limit=$((cap < left ? cap : left))
  echo "[gpu_check] $name (limit ${limit} s) ..."
  local t0 rc
  t0=$(date +%s)
  timeout -k 10 "$limit" bash -c "$fn" </dev/null >"$OUTDIR/$log" 2>&1
  rc=$?
  local secs=$(($(date +%s) - t0))
  case $rc in
    0) record "$name" "PASS" "$secs" "$log" ;;
    124|137) echo "[gpu_check] timed out after ${limit} s" >>"$OUTDIR/$log"
             record "$name" "FAIL ($rc: timed out)" "$secs" "$log" ;;
    *) record "$name" "FAIL ($rc)" "$secs" "$log" ;;
  esac
  archive
}

archive() {  # written beside, then moved in; one at a time when steps run at once
  local part
  part=$(mktemp "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || return
  (
    command -v flock >/dev/null 2>&1 && flock 9
    # A log still being written by a running step may change under tar (exit 1): keep the archive.
    tar -czf "$part" -C "$OUTDIR" --exclude=gpu_check.tar.gz . 2>/dev/null
    [ $? -le 1 ] && mv -f "$part" "$OUTDIR/gpu_check.tar.gz"
  ) 9>"${TMPDIR:-/tmp}/gpu_check.$$.lock"
  rm -f "$part"
}

# ---- the steps (each runs in a fresh bash: see run_step) --------------------------------------------
step_env() {
  echo "== date"; date -u
  echo "== git"; git rev-parse HEAD; git status --short
  echo "== nvidia-smi"; nvidia-smi; local rc=$?
  echo "== gpu"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm,clocks.max.mem \
    --format=csv
  echo "== nvcc"; nvcc --version
  echo "== compute-sanitizer: ${COMPUTE_SANITIZER:-not found}"
  [ -n "$COMPUTE_SANITIZER" ] && "$COMPUTE_SANITIZER" --version
  echo "== cmake, ninja"; cmake --version | head -n 1; ninja --version
  echo "== cpu"; nproc; free -g | head -n 2
  echo "== python: $(command -v "$PYTHON")"
  # jax would otherwise reserve most of the GPU's memory when it lists the devices.
  XLA_PYTHON_CLIENT_PREALLOCATE=false "$PYTHON" - <<'EOF'
import importlib, sys
print(sys.version.replace("\n", " "))
for name in ("numpy", "ml_dtypes", "pytest", "hypothesis", "xdist", "pytest_timeout", "nanobind",
             "scikit_build_core", "torch", "cupy", "jax"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as e:  # report and go on: every package here is optional for some step
        print(f"{name}: not importable ({type(e).__name__}: {e})")
try:
    import torch
    print("torch CUDA", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
          "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print("torch device 0:", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs",
              round(p.total_memory / 2**30, 1), "GiB")
except Exception as e:
    print("torch CUDA query failed:", e)
try:
    import cupy
    rt = cupy.cuda.runtime
    print("cupy runtime", rt.runtimeGetVersion(), "driver", rt.driverGetVersion(),
          "devices", rt.getDeviceCount())
except Exception as e:
    print("cupy CUDA query failed:", e)
try:
    import jax
    print("jax devices", jax.devices())
except Exception as e:
    print("jax device query failed:", e)
EOF
  return $rc
}

step_build() {
  # CUDAARCHS is what the project's CMake reads; the explicit define also wins over an architecture
  # list cached in build/gpu by an earlier configure. scikit-build-core runs `cmake --build`, which
  # takes its job count from CMAKE_BUILD_PARALLEL_LEVEL. With prebuilt C++ tests only the Python
  # module is built.
  local tests=ON prebuilt_core=()
  [ -n "$PREBUILT" ] && tests=OFF
  # The archive's core libraries (same tree): only the bindings are compiled here.
  if [ -n "$PREBUILT" ] && [ -f "$CUDA_TESTS/../../../lib/libflashdl_core.a" ]; then
    prebuilt_core=(-Ccmake.define.FLASHDL_PREBUILT_CORE="$(cd "$CUDA_TESTS/../../../lib" && pwd)")
    echo "linking the prebuilt core: ${prebuilt_core[*]}"
  fi
  CUDAARCHS=90 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PYTHON" -m pip install -v \
    --no-build-isolation --no-deps \
    -Cbuild-dir="$BUILD_DIR" \
    -Ccmake.define.FLASHDL_BUILD_TESTS=$tests \
    -Ccmake.define.FLASHDL_CUDA=ON \
    -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90 \
    "${prebuilt_core[@]}" \
    . || return
  ls -l "$CUDA_TESTS"
  # The installed module must see the GPU; a CPU-only or driver-less module would make every
  # Python test skip and pass vacuously.
  (cd /tmp && "$PYTHON" -c "
import flashdl, json
i = flashdl.info()
print(json.dumps(i))
assert 'cuda' in i['backends'] and i['cuda_device_count'] > 0, 'flashdl sees no GPU: ' + i['cuda_status']
print('flashdl sees', i['cuda_device_count'], 'CUDA device(s)')")
}

cpp_test() {  # cpp_test NAME [ARGS...]
  local exe=$CUDA_TESTS/$1
  shift
  if [ ! -x "$exe" ]; then
    echo "missing: $exe (did the build step fail?)"
    return 127
  fi
  echo "$ $exe $*  (FLASHDL_CUDA_SMEM_LIMIT=${FLASHDL_CUDA_SMEM_LIMIT:-unset})"
  "$exe" "$@"
  local rc=$?
  [ $rc -eq 77 ] && echo "exit 77: the test saw no CUDA device although this machine has one"
  return $rc
}

# One quick case per kernel variant of each family first: a failure anywhere shows within minutes.
step_quick_forward() { cpp_test test_cuda_forward --quick; }
step_quick_backward() { cpp_test test_cuda_backward --quick; }
step_quick_block_sparse() { cpp_test test_cuda_block_sparse --quick; }
step_quick_kvcache() { cpp_test test_cuda_kvcache --quick; }
step_quick_varlen() { cpp_test test_cuda_varlen --quick; }
# bias (dBias), boolean mask, sinks (dSinks) in fa1/fa2 forward and backward, varlen.
step_quick_extras() { cpp_test test_cuda_extras --quick; }
step_cpp_forward() { cpp_test test_cuda_forward; }
step_cpp_backward() { cpp_test test_cuda_backward; }
step_cpp_block_sparse() { cpp_test test_cuda_block_sparse; }
step_cpp_kvcache() { cpp_test test_cuda_kvcache; }
step_cpp_varlen() { cpp_test test_cuda_varlen; }
step_cpp_extras() { cpp_test test_cuda_extras; }
# Every caller array more than 2^31 elements from its base pointer (64-bit offsets). Each dense
# case allocates about 48 GiB of device memory (spans the test never touches): it runs alone.
step_wide_offsets() { cpp_test test_cuda_wide_offsets; }
step_cpp_forward_fallback() { FLASHDL_CUDA_SMEM_LIMIT=$SMEM_LIMIT cpp_test test_cuda_forward --quick; }
step_cpp_backward_fallback() { FLASHDL_CUDA_SMEM_LIMIT=$SMEM_LIMIT cpp_test test_cuda_backward --quick; }
# The fa2 forward's shared-memory softmax (its fallback from the register softmax) on every call.
step_cpp_forward_smem_softmax() { FLASHDL_CUDA_FA2_SMEM_SOFTMAX=1 cpp_test test_cuda_forward --quick; }

step_pytest_cuda() {
  local args=(-q -rfEs -p no:cacheprovider --junitxml="$OUTDIR/pytest_cuda.xml")
  # Worker processes: a test that crashes the process (a device fault) loses only its worker, and
  # the host oracles run in parallel. Per-test timeouts keep a hung kernel from eating the step.
  local workers=4
  if "$PYTHON" -c "import xdist" 2>/dev/null; then
    args+=(-n "$workers")
    export OMP_NUM_THREADS=$(( $(nproc) / workers > 0 ? $(nproc) / workers : 1 ))
  fi
  "$PYTHON" -c "import pytest_timeout" 2>/dev/null && args+=(--timeout 180)
  # Each worker's JAX would otherwise take 75% of the GPU's memory when it first sees the GPU.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  export FLASHDL_FAILURE_LOG=$OUTDIR/pytest_cuda_failures.txt  # each failure as it happens
  echo "$ $PYTHON -m pytest tests/python/test_cuda*.py tests/python/test_varlen.py ${args[*]}"
  "$PYTHON" -m pytest tests/python/test_cuda*.py tests/python/test_varlen.py "${args[@]}"
}

sanitize() {  # sanitize TOOL TEST
  if [ -z "$COMPUTE_SANITIZER" ]; then
    echo "compute-sanitizer not found (PATH, next to nvcc, /usr/local/cuda)"
    return 127
  fi
  local exe=$CUDA_TESTS/$2
  if [ ! -x "$exe" ]; then
    echo "missing: $exe (did the build step fail?)"
    return 127
  fi
  echo "$ $COMPUTE_SANITIZER --tool $1 --error-exitcode 1 $exe --quick ${*:3}"
  "$COMPUTE_SANITIZER" --tool "$1" --error-exitcode 1 "$exe" --quick "${@:3}"
}

# sanitize_parts TOOL TEST FILTER...: one run per --filter, all at once, each logging to
# OUTDIR/TOOL_TEST.partN.log as it goes (so a part the step's cap cuts off still says how far it
# got; racecheck over the block-sparse quick cases ran 29 of 50 cases in 150 s as one run on an
# H100), then those logs one after another; fails if any part does.
sanitize_parts() {
  local tool=$1 test=$2 i=0 rc=0 pids=() logs=()
  shift 2
  for f in "$@"; do
    logs+=("$OUTDIR/${tool}_${test#test_cuda_}.part$i.log")
    sanitize "$tool" "$test" --filter "$f" >"${logs[$i]}" 2>&1 &
    pids+=($!)
    i=$((i + 1))
  done
  trap 'kill "${pids[@]}" 2>/dev/null; exit 124' TERM  # the step's cap: no part outlives it
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || rc=1; done
  for i in "${!pids[@]}"; do cat "${logs[$i]}"; done
  return $rc
}

step_memcheck_forward() { sanitize memcheck test_cuda_forward; }
step_memcheck_backward() { sanitize memcheck test_cuda_backward; }
step_racecheck_forward() { sanitize racecheck test_cuda_forward; }
step_racecheck_backward() { sanitize racecheck test_cuda_backward; }
step_synccheck_forward() { sanitize synccheck test_cuda_forward; }
step_synccheck_backward() { sanitize synccheck test_cuda_backward; }
step_memcheck_block_sparse() { sanitize memcheck test_cuda_block_sparse; }
step_racecheck_block_sparse() {
  sanitize_parts racecheck test_cuda_block_sparse "fwd " "bwd fa1" "bwd fa2"
}
step_synccheck_block_sparse() { sanitize synccheck test_cuda_block_sparse; }
step_memcheck_kvcache() { sanitize memcheck test_cuda_kvcache; }
step_racecheck_kvcache() { sanitize racecheck test_cuda_kvcache; }
step_synccheck_kvcache() { sanitize synccheck test_cuda_kvcache; }
step_memcheck_varlen() { sanitize memcheck test_cuda_varlen; }
step_memcheck_extras() { sanitize memcheck test_cuda_extras; }

# The issue's targets first: fa2 against SDPA at head dim 128 and 64, 1k and 4k, both dtypes, fa1
# at 1k, and the GPT-2 medium layer.
step_bench() {
  PYTHONUNBUFFERED=1 "$PYTHON" benchmarks/bench_cuda.py --dtypes fp16,bf16 --headdims 128,64 \
    --seqlens 4096,1024 --schedules fa2,fa1 --fa1-max-seqlen 1024 --warmup 3 --reps 10 \
    --out "$OUTDIR/bench_cuda.md"
}
# Every fa2 kernel of one forward and one backward (float16, head dim 128 and 64, seqlen 4096, the
# benchmark's shapes) under Nsight Compute: speed of light, occupancy, warp stalls, memory and
# compute workload, per kernel; needs ncu on PATH.
step_profile() {
  if ! command -v "${NCU:-ncu}" >/dev/null 2>&1; then
    echo "ncu (Nsight Compute) not on PATH: profile not run"
    return 0
  fi
  "${NCU:-ncu}" --kernel-name-base function \
    --kernel-name 'regex:forward_kernel|backward_kernel|preprocess_kernel|convert_dq_kernel' \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    "$PYTHON" benchmarks/profile_cuda.py --headdims 128,64 --seqlens 4096
}
# Where the fa2 main kernels spend their cycles, per SASS instruction: Nsight Compute's warp
# stall sampling of one forward and one backward (float16, d 128, seqlen 4096, as `profile`),
# printed as its source page (CSV: each instruction with its samples, by stall reason) into
# OUTDIR/source_forward.csv and source_backward.csv; needs ncu on PATH.
step_profile_source() {
  local ncu=${NCU:-ncu}
  if ! command -v "$ncu" >/dev/null 2>&1; then
    echo "ncu (Nsight Compute) not on PATH: profile_source not run"
    return 0
  fi
  "$ncu" --kernel-name-base function --kernel-name 'regex:forward_kernel|backward_kernel' \
    --section WarpStateStats --section SourceCounters -f -o "$OUTDIR/source" \
    "$PYTHON" benchmarks/profile_cuda.py --headdims 128 --seqlens 4096 || return
  local k rc=0
  for k in forward backward; do
    "$ncu" -i "$OUTDIR/source.ncu-rep" --kernel-name-base function \
      --kernel-name "regex:${k}_kernel" --page source --csv --print-source sass \
      >"$OUTDIR/source_$k.csv" || rc=$?
    echo "source_$k.csv: $(wc -l <"$OUTDIR/source_$k.csv") lines"
  done
  rm -f "$OUTDIR/source.ncu-rep"  # the CSVs hold what is read; the report is large
  return $rc
}
# The whole Python suite on this machine: the CPU tests too, with a GPU and its drivers present.
# -v: every test's outcome is in the log as it finishes, so a run cut off by the budget still
# names its failures (the junit file is written only at the end).
step_pytest_all() {
  local args=(-v -rfEs -p no:cacheprovider --junitxml="$OUTDIR/pytest_all.xml")
  if "$PYTHON" -c "import xdist" 2>/dev/null; then
    args+=(-n 8)
    export OMP_NUM_THREADS=2 FLASHDL_NUM_THREADS=2
  fi
  "$PYTHON" -c "import pytest_timeout" 2>/dev/null && args+=(--timeout 240)
  export XLA_PYTHON_CLIENT_PREALLOCATE=false  # as in pytest_cuda: 8 workers share the GPU
  # Tracebacks come at the end of a pytest run; a run the budget cuts off keeps them here.
  export FLASHDL_FAILURE_LOG=$OUTDIR/pytest_all_failures.txt
  echo "$ $PYTHON -m pytest tests/python ${args[*]}"
  "$PYTHON" -m pytest tests/python "${args[@]}"
}
# HBM bytes of the forward under Nsight Compute (the paper's IO claim); needs ncu on PATH.
step_bench_io() {
  if ! command -v "${NCU:-ncu}" >/dev/null 2>&1; then
    echo "ncu (Nsight Compute) not on PATH: bench_io not run"
    return 0
  fi
  PYTHONUNBUFFERED=1 "$PYTHON" benchmarks/bench_cuda_io.py --ncu "${NCU:-ncu}" --out "$OUTDIR/bench_cuda_io.md"
}

export PYTHON OUTDIR BUILD_DIR CUDA_TESTS PREBUILT SMEM_LIMIT COMPUTE_SANITIZER
export -f cpp_test sanitize sanitize_parts
for s in "${STEPS[@]}"; do export -f "step_$s"; done

# ---- run them ----------------------------------------------------------------------------------------
# name cap (s) log flags: p = needs the Python module, x = runs alone (a benchmark), c = needs the
# C++ tests
TABLE=(
  "env                       60 env.txt                      -"
  "build                    420 build.log                    -"
  "quick_forward            150 quick_forward.log            c"
  "quick_backward           150 quick_backward.log           c"
  "quick_block_sparse       120 quick_block_sparse.log       c"
  "quick_kvcache            120 quick_kvcache.log            c"
  "quick_varlen             120 quick_varlen.log             c"
  "quick_extras             120 quick_extras.log             c"
  "cpp_forward_smem_softmax  90 cpp_forward_smem_softmax.log c"
  "cpp_forward_fallback      90 cpp_forward_fallback.log     c"
  "cpp_backward_fallback     90 cpp_backward_fallback.log    c"
)
for tool in memcheck racecheck synccheck; do
  for t in forward backward block_sparse kvcache varlen extras; do
    [ "$tool/$t" = racecheck/varlen ] || [ "$tool/$t" = synccheck/varlen ] && continue
    [ "$tool/$t" = racecheck/extras ] || [ "$tool/$t" = synccheck/extras ] && continue
    cap=150
    [ "$tool/$t" = racecheck/block_sparse ] && cap=280  # in parts, at once (sanitize_parts)
    TABLE+=("${tool}_$t $cap ${tool}_$t.log c")
  done
done
TABLE+=(
  "bench                    240 bench.log                    px"
  "pytest_cuda              300 pytest_cuda.log              p"
  "cpp_forward              300 cpp_forward.log              c"
  "cpp_backward             300 cpp_backward.log             c"
  "cpp_block_sparse         150 cpp_block_sparse.log         c"
  "cpp_kvcache              150 cpp_kvcache.log              c"
  "cpp_varlen               120 cpp_varlen.log               c"
  "cpp_extras               150 cpp_extras.log               c"
  "wide_offsets             120 wide_offsets.log             cx"
  "profile                  180 profile.log                  px"
  "profile_source           150 profile_source.log           px"
  "pytest_all               300 pytest_all.log               p"
  "bench_io                 300 bench_io.log                 px"
)

# Steps run in background jobs, at most JOBS of them at once (the build beside them when the C++
# tests are prebuilt); with JOBS=1 one after the other, as listed.
BUILD_PID=""
RUNNING=()
reap() {  # drop finished jobs from RUNNING
  local still=() p
  for p in "${RUNNING[@]}"; do kill -0 "$p" 2>/dev/null && still+=("$p"); done
  RUNNING=("${still[@]}")
}
wait_build() {
  if [ -n "$BUILD_PID" ]; then wait "$BUILD_PID"; BUILD_PID=""; fi
}
for row in "${TABLE[@]}"; do
  read -r name cap log flags <<<"$row"
  [[ $flags == *p* || $flags == *c* ]] && [ -z "$PREBUILT" ] && wait_build
  [[ $flags == *p* ]] && wait_build
  if [[ $flags == *x* ]]; then wait_build; wait "${RUNNING[@]}" 2>/dev/null; RUNNING=(); fi
  reap
  while [ ${#RUNNING[@]} -ge "$JOBS" ]; do wait -n "${RUNNING[@]}" 2>/dev/null; reap; done
  run_step "$name" "$cap" "$log" "step_$name" &
  pid=$!
  if [ "$name" = build ]; then
    BUILD_PID=$pid
  elif [ "$JOBS" -eq 1 ] || [[ $flags == *x* ]] || [ "$name" = env ]; then
    wait "$pid"
  else
    RUNNING+=("$pid")
  fi
  [ "$name" = build ] && { [ -z "$PREBUILT" ] || [ "$JOBS" -eq 1 ]; } && wait_build
done
wait

total=$(($(date +%s) - START))
n_pass=$(grep -c '^[a-z_0-9]* *PASS ' "$SUMMARY")
n_fail=$(grep -c '^[a-z_0-9]* *FAIL ' "$SUMMARY")
n_skip=$(grep -c '^[a-z_0-9]* *SKIPPED ' "$SUMMARY")
budget_skipped=$(grep '^[a-z_0-9]* *SKIPPED (time budget)' "$SUMMARY" | awk '{print $1}' | xargs)
failed=$(grep '^[a-z_0-9]* *FAIL ' "$SUMMARY" | awk '{print $1}' | xargs)
{
  if [ -n "$budget_skipped" ]; then
    echo "rerun: bash tools/gpu_check.sh ${OUTDIR}_2 $budget_skipped"
  fi
  if [ -n "$failed" ]; then
    echo "failed: $failed"
  fi
  echo "overall: $([ "$n_fail" -eq 0 ] && echo PASS || echo FAIL), $n_pass passed, $n_fail failed, $n_skip skipped, ${total} s"
} | tee -a "$SUMMARY"
[ -n "$GPU" ] && archive
[ "$n_fail" -eq 0 ]
