#!/usr/bin/env bash
# The project's test command (README: "Run the tests"): installs flashdl with its C++ tests built in
# the same CMake tree, runs the C++ suite with ctest, then the CUDA C++ tests on the CUDA host
# emulator (a second CMake tree), then the Python suite with pytest, then builds the sdist and a
# manylinux CPU wheel and smoke-tests that wheel in a fresh venv.
# FLASHDL_CUDA=AUTO|ON|OFF chooses the CUDA backend; by default it is ON wherever nvcc is on PATH,
# so a machine with the CUDA toolkit (CI's included) always compiles the kernels, GPU or not.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build/tests}
if [ -z "${FLASHDL_CUDA:-}" ]; then
  if command -v nvcc >/dev/null 2>&1; then FLASHDL_CUDA=ON; else FLASHDL_CUDA=OFF; fi
fi

# Optional frameworks the suite also exercises; their tests skip when an install is impossible.
# Say where they go: this changes the caller's environment, not a throwaway one.
echo "tests/run.sh: installing torch, jax and transformers (and flashdl) into the active Python" \
  "environment," \
  "$("$PYTHON" -c 'import sys; print(sys.prefix)')"
"$PYTHON" -m pip install -q "torch==2.13.0" || echo "note: torch not installed, its tests will skip"
"$PYTHON" -m pip install -q jax || echo "note: jax not installed, its tests will skip"
"$PYTHON" -m pip install -q transformers \
  || echo "note: transformers not installed, its tests will skip"

"$PYTHON" -m pip install -q ".[test]" \
  -Cbuild-dir="$BUILD_DIR" \
  -Ccmake.define.FLASHDL_BUILD_TESTS=ON \
  -Ccmake.define.FLASHDL_CUDA="$FLASHDL_CUDA"

ctest --test-dir "$BUILD_DIR" --output-on-failure -j 2

# The CUDA kernels on the CPU: the CUDA backend's sources compiled against flashdl's CUDA host
# emulator (FLASHDL_CUDA=EMULATE, tests/cuda_emulator) and the CUDA C++ tests' quick cases run on
# it (ctest label "emulator"; "emulator_full" runs the complete suites), then once more built with
# AddressSanitizer (every access outside a device allocation or shared memory is an error).
EMU_BUILD_DIR=${EMU_BUILD_DIR:-build/emulated}
for asan in OFF ON; do
  dir=$EMU_BUILD_DIR$([ $asan = ON ] && echo -asan || true)
  cmake -S . -B "$dir" -DFLASHDL_CUDA=EMULATE -DFLASHDL_EMU_ASAN=$asan -DFLASHDL_BUILD_PYTHON=OFF \
    -DFLASHDL_BUILD_TESTS=ON >/dev/null
  cmake --build "$dir" -j 2 --target test_emulator test_cuda_forward test_cuda_backward \
    test_cuda_block_sparse test_cuda_kvcache test_cuda_varlen
  ctest --test-dir "$dir" -L '^emulator$' --output-on-failure -j 2
done

"$PYTHON" -m pytest tests/python -q

# The distributions: sdist, a CPU wheel built from it and repaired to a manylinux tag, installed
# into a fresh virtual environment and smoke-tested there (tools/build_wheels.sh).
PYTHON="$PYTHON" bash tools/build_wheels.sh --smoke build/dist
