#!/usr/bin/env bash
# Builds the CUDA C++ tests for a GPU on a machine without one (nvcc is enough) and packs them for
# tools/gpu_check.sh, so that a short GPU lease spends no time compiling them:
#
#   bash tools/gpu_prebuild.sh [ARCHIVE] [ARCH]     (default build/gpu-tests.tar.xz, sm 90)
#
# then, on the GPU machine, from the repository root:
#
#   GPU_CHECK_CPP_DIR=ARCHIVE GPU_CHECK_JOBS=4 bash tools/gpu_check.sh OUTDIR
#
# (gpu_check.sh unpacks the archive and builds only the Python module, beside the C++ steps; the
# archive also holds the core libraries, libflashdl_core.a and libflashdl_cuda.a, so that build
# compiles the bindings alone and links those: CMake's FLASHDL_PREBUILT_CORE. They must come from
# the same tree as the checkout on the GPU machine.)
# The build tree is build/gpu-pre (incremental on later runs); the five test executables share
# the library's kernels, so xz with a dictionary larger than one of them packs the five into about
# one's size (about 8 MB from 117 MB for sm_90). The executables link the CUDA runtime statically;
# the GPU machine needs a driver that supports this nvcc's CUDA version.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ARCHIVE=${1:-build/gpu-tests.tar.xz}
ARCH=${2:-90}
BUILD=build/gpu-pre
TESTS=(test_cuda_forward test_cuda_backward test_cuda_block_sparse test_cuda_kvcache test_cuda_varlen
       test_cuda_extras test_cuda_wide_offsets)

command -v nvcc >/dev/null || { echo "gpu_prebuild.sh: nvcc not on PATH" >&2; exit 2; }
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHDL_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DFLASHDL_BUILD_PYTHON=OFF -DFLASHDL_BUILD_TESTS=ON >/dev/null
cmake --build "$BUILD" --target "${TESTS[@]}" flashdl_core flashdl_cuda
mkdir -p "$(dirname "$ARCHIVE")" "$BUILD/lib"
cp -f "$BUILD/libflashdl_core.a" "$BUILD/src/cuda/libflashdl_cuda.a" "$BUILD/lib/"
tar -C "$BUILD" -cf - "${TESTS[@]/#/tests/cpp/cuda/}" lib/libflashdl_core.a lib/libflashdl_cuda.a |
  xz -T1 --lzma2=preset=6,dict=128MiB >"$ARCHIVE.part"
mv -f "$ARCHIVE.part" "$ARCHIVE"
echo "gpu_prebuild.sh: $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1)), CUDA C++ tests for sm_$ARCH"
