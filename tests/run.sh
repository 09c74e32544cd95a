#!/usr/bin/env bash
# The project's test command (README: "Run the tests"). Steps, each printed with the time elapsed
# since the start, and a table of their durations at the end:
#   1. torch 2.13 (CPU), jax, transformers and flax into the active Python (their tests skip
#      without them), and the linters at their pinned versions (tools/lint-requirements.txt)
#   2. the habits check, tools/lint.sh: ruff (lint and format) and mypy over python/flashdl,
#      clang-format over the C++ and CUDA sources (tools/lint_cpp.sh); seconds
#   3. flashdl with its C++ tests, one CMake tree (build/tests), installed into the active Python
#   4. the C++ suite (ctest, label cpu)
#   5. the documentation site: built warning-free, its doctests, every public name in the reference
#   6. the Python suite (pytest, two worker processes)
#   7. the CUDA C++ tests' quick cases on flashdl's CUDA host emulator (build/emulated)
#   8. the sdist, a manylinux CPU wheel built from it, smoke-tested in a fresh venv
# Each tree is built once and kept: a second run rebuilds only what changed. The long checks (the
# emulated quick cases under AddressSanitizer, the complete emulated CUDA suites, many more
# hypothesis examples) are tests/run_long.sh.
# FLASHDL_CUDA=ON|OFF chooses the CUDA backend of step 2; by default it is ON wherever nvcc is on
# PATH, so a machine with the CUDA toolkit (CI's included) always compiles the kernels, GPU or not,
# for sm_90 (CUDAARCHS overrides it; an install without it builds sm_80 and sm_90, the same source
# through another ptxas target).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build/tests}
EMU_BUILD_DIR=${EMU_BUILD_DIR:-build/emulated}
LOGS=build/logs
if [ -z "${FLASHDL_CUDA:-}" ]; then
  if command -v nvcc >/dev/null 2>&1; then FLASHDL_CUDA=ON; else FLASHDL_CUDA=OFF; fi
fi
export CUDAARCHS=${CUDAARCHS:-90}
mkdir -p "$LOGS"

START=$SECONDS
STEP_NAME=""
STEP_START=0
TIMES=()
clock() { local s=$((SECONDS - START)); printf '%d:%02d' $((s / 60)) $((s % 60)); }
end_step() {
  [ -n "$STEP_NAME" ] && TIMES+=("$(printf '%6ds  %s' $((SECONDS - STEP_START)) "$STEP_NAME")")
  return 0
}
step() {
  end_step
  STEP_NAME=$1
  STEP_START=$SECONDS
  printf '\n[%s] ==== %s\n' "$(clock)" "$1"
}
# Prints the lines of its input that match the extended regex $1, leading blanks dropped, cut at
# 120 characters, each as soon as it arrives: bash's own read, no awk (mawk, Debian's default,
# reads a pipe in 4 KB blocks, which held the build's progress back for minutes).
progress_lines() {
  local line
  while IFS= read -r line; do
    if [[ $line =~ $1 ]]; then
      line=${line#"${line%%[![:space:]]*}"}
      printf '%s\n' "${line:0:120}"
    fi
  done
}

# Runs a command with its output in $LOGS/$1.log, printing only the lines matching $2 (progress);
# on failure, the log's last 80 lines.
quietly() {
  local log=$LOGS/$1.log pattern=$2
  shift 2
  if ! "$@" > >(tee "$log" | progress_lines "$pattern") 2>&1; then
    sleep 1
    echo "---- failed: $*  (last 80 lines of $log)"
    tail -n 80 "$log"
    return 1
  fi
  sleep 0.2  # let the progress filter print its last line
}
trap 'status=$?; end_step; if [ $status -ne 0 ]; then echo; echo "[$(clock)] FAILED in: $STEP_NAME"; fi' EXIT

step "1/8 frameworks: torch 2.13 (CPU), jax, transformers, flax; linters; into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
# They go into the active environment (use a virtual environment to keep them apart).
"$PYTHON" -m pip install -q "torch==2.13.0" || echo "note: torch not installed, its tests will skip"
"$PYTHON" -m pip install -q jax || echo "note: jax not installed, its tests will skip"
"$PYTHON" -m pip install -q transformers \
  || echo "note: transformers not installed, its tests will skip"
"$PYTHON" -m pip install -q flax || echo "note: flax not installed, its tests will skip"
"$PYTHON" -m pip install -q -r tools/lint-requirements.txt

step "2/8 habits: ruff, mypy, clang-format (tools/lint.sh)"
PYTHON="$PYTHON" bash tools/lint.sh

step "3/8 flashdl with its C++ tests (FLASHDL_CUDA=$FLASHDL_CUDA, CUDAARCHS=$CUDAARCHS, tree $BUILD_DIR)"
# -v for the build's progress lines ([n/N] Building ...); the whole output is in the log.
quietly pip_install '^ *\[[0-9]+/[0-9]+\]|flashdl: CUDA backend|Successfully installed' \
  "$PYTHON" -m pip install -v ".[test,docs]" \
  -Cbuild-dir="$BUILD_DIR" \
  -Ccmake.define.FLASHDL_BUILD_TESTS=ON \
  -Ccmake.define.FLASHDL_CUDA="$FLASHDL_CUDA"

step "4/8 C++ suite (ctest, CPU kernels once per compiled instruction set)"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2

step "5/8 documentation: sphinx-build -W, doctests, every public name in the reference"
PYTHON="$PYTHON" bash tools/check_docs.sh

step "6/8 Python suite (pytest)"
"$PYTHON" -m pytest tests/python -q -n 2

# The CUDA kernels on the CPU: the CUDA backend's sources compiled against flashdl's CUDA host
# emulator (FLASHDL_CUDA=EMULATE, tests/cuda_emulator) and the CUDA C++ tests' quick cases run on
# it (ctest label "emulator": two thread orders, the 99 KiB tiles, an sm_80 part; label
# "emulator_full" runs the complete suites).
EMU_TARGETS=(test_emulator test_cuda_forward test_cuda_backward test_cuda_block_sparse
             test_cuda_kvcache test_cuda_varlen test_cuda_extras test_cuda_wide_offsets)
step "7/8 CUDA C++ quick cases on the CUDA host emulator (tree $EMU_BUILD_DIR)"
cmake -S . -B "$EMU_BUILD_DIR" -DFLASHDL_CUDA=EMULATE -DFLASHDL_EMU_ASAN=OFF \
  -DFLASHDL_BUILD_PYTHON=OFF -DFLASHDL_BUILD_TESTS=ON >/dev/null
quietly build-emulated '^\[ *[0-9]+(/[0-9]+|%)\]' \
  cmake --build "$EMU_BUILD_DIR" -j 2 --target "${EMU_TARGETS[@]}"
ctest --test-dir "$EMU_BUILD_DIR" -L '^emulator$' --output-on-failure -j 2

step "8/8 sdist, then a manylinux CPU wheel from it, smoke-tested in a fresh venv"
PYTHON="$PYTHON" bash tools/build_wheels.sh --smoke build/dist

end_step
STEP_NAME=""
printf '\n[%s] all steps passed. Seconds per step:\n' "$(clock)"
printf '%s\n' "${TIMES[@]}"
