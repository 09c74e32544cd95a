#!/usr/bin/env bash
# The long checks, run by hand after tests/run.sh (which they complement, not replace): once per
# change to the kernels, the emulator or the core. On a 2-core machine about an hour in all.
#   --asan      the CUDA C++ tests' quick cases on the CUDA host emulator built with
#               AddressSanitizer (build/emulated-asan): every access outside a device allocation
#               or a block's shared memory is an error (about 4 min to build, 3 min to run)
#   --full      the complete emulated CUDA suites, as on a GPU (ctest label emulator_full in
#               build/emulated; about 25 min)
#   --thorough  the Python suite with the "thorough" hypothesis profile (400 examples a property)
#   --stress    the fuzzer's long run (2,000 calls, about 5 min) and the input of more than 2^31
#               elements (about 9 GB of memory, 1 min)
#   --sanitize  the CPU backend, C++ tests and extension under AddressSanitizer and
#               UndefinedBehaviorSanitizer (tools/sanitize.sh long; its own build, several minutes)
# With no option, all of them. Needs what tests/run.sh installed (flashdl, pytest, hypothesis).
#
#   bash tests/run_long.sh [--asan] [--full] [--thorough] [--stress] [--sanitize]
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
EMU_BUILD_DIR=${EMU_BUILD_DIR:-build/emulated}
ASAN=0 FULL=0 THOROUGH=0 STRESS=0 SANITIZE=0
for arg in "$@"; do
  case "$arg" in
    --asan) ASAN=1 ;;
    --full) FULL=1 ;;
    --thorough) THOROUGH=1 ;;
    --stress) STRESS=1 ;;
    --sanitize) SANITIZE=1 ;;
    *) echo "run_long.sh: unknown option $arg (expected --asan, --full, --thorough, --stress," \
         "--sanitize)" >&2; exit 2 ;;
  esac
done
if [ $# -eq 0 ]; then ASAN=1 FULL=1 THOROUGH=1 STRESS=1 SANITIZE=1; fi

START=$SECONDS
step() { local s=$((SECONDS - START)); printf '\n[%d:%02d] ==== %s\n' $((s / 60)) $((s % 60)) "$1"; }
EMU_TARGETS=(test_emulator test_cuda_forward test_cuda_backward test_cuda_block_sparse
             test_cuda_kvcache test_cuda_varlen test_cuda_extras test_cuda_wide_offsets)
emulated_tree() {  # $1 = build dir, $2 = OFF|ON (AddressSanitizer)
  cmake -S . -B "$1" -DFLASHDL_CUDA=EMULATE -DFLASHDL_EMU_ASAN="$2" \
    -DFLASHDL_BUILD_PYTHON=OFF -DFLASHDL_BUILD_TESTS=ON >/dev/null
  cmake --build "$1" -j 2 --target "${EMU_TARGETS[@]}"
}

if [ $ASAN = 1 ]; then
  step "emulated quick cases under AddressSanitizer ($EMU_BUILD_DIR-asan)"
  emulated_tree "$EMU_BUILD_DIR-asan" ON
  ctest --test-dir "$EMU_BUILD_DIR-asan" -L '^emulator$' --output-on-failure -j 2
fi
if [ $FULL = 1 ]; then
  step "the complete emulated CUDA suites ($EMU_BUILD_DIR, label emulator_full)"
  emulated_tree "$EMU_BUILD_DIR" OFF
  ctest --test-dir "$EMU_BUILD_DIR" -L '^emulator_full$' --output-on-failure -j 2
fi
if [ $THOROUGH = 1 ]; then
  step "the Python suite, hypothesis profile 'thorough'"
  FLASHDL_HYPOTHESIS_PROFILE=thorough "$PYTHON" -m pytest tests/python -q -n 2
fi
if [ $STRESS = 1 ]; then
  step "the fuzzer's long run and the input of more than 2^31 elements"
  FLASHDL_FUZZ_CALLS=2000 FLASHDL_FUZZ_SEED=2026 "$PYTHON" -m pytest tests/python/test_fuzz.py -q
  FLASHDL_STRESS_HUGE=1 "$PYTHON" -m pytest tests/python/test_stress.py -q
fi
if [ $SANITIZE = 1 ]; then
  step "AddressSanitizer and UndefinedBehaviorSanitizer over the CPU backend (tools/sanitize.sh long)"
  bash tools/sanitize.sh long
fi
s=$((SECONDS - START))
printf '\n[%d:%02d] run_long.sh: all selected checks passed\n' $((s / 60)) $((s % 60))
