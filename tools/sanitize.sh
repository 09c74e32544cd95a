#!/usr/bin/env bash
# The CPU backend under AddressSanitizer and UndefinedBehaviorSanitizer: the core, the C++ tests
# and the Python extension are built with -fsanitize=address,undefined in a tree of their own
# (build/sanitize), then ctest runs the C++ tests and pytest runs Python tests against that
# extension (libasan preloaded into the interpreter, leak detection off for the interpreter's own
# allocations). Any report stops the run with a non-zero exit.
#
#   tools/sanitize.sh [short|long]
#     short (default): test_validation, test_math and test_forward under ctest; the Python
#                      error, reliability and KV-cache tests (a few minutes once built)
#     long:            every CPU ctest test, and every Python test file that runs on the CPU
#
# The build takes several minutes on two cores (CMAKE_BUILD_PARALLEL_LEVEL sets the jobs).
set -euo pipefail

mode=${1:-short}
case "$mode" in short|long) ;; *) echo "usage: $0 [short|long]" >&2; exit 2 ;; esac
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build/sanitize
san="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"

cmake -S "$root" -B "$build" -DFLASHDL_CUDA=OFF -DFLASHDL_BUILD_PYTHON=ON \
  -DFLASHDL_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$(command -v python3)" \
  -Dnanobind_DIR="$(python3 -m nanobind --cmake_dir)" \
  -DCMAKE_CXX_FLAGS="$san" -DCMAKE_C_FLAGS="$san" \
  -DCMAKE_EXE_LINKER_FLAGS="$san" -DCMAKE_SHARED_LINKER_FLAGS="$san" \
  -DCMAKE_MODULE_LINKER_FLAGS="$san" >/dev/null
cmake --build "$build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"

export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:detect_odr_violation=0:protect_shadow_gap=0:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

echo "== ctest ($mode)"
if [ "$mode" = short ]; then
  ctest --test-dir "$build" --output-on-failure -R '^(test_validation|test_math|test_forward)$'
else
  ctest --test-dir "$build" --output-on-failure -L '^cpu$'
fi

# The package as the sanitized build would install it: the sources, with this tree's extension.
# The interpreter runs with -S so that the editable install's import hook does not bring in the
# unsanitized extension; site-packages is then on PYTHONPATH as a plain directory.
pkg=$build/pkg/flashdl
rm -rf "$build/pkg"
mkdir -p "$pkg"
for f in "$root"/python/flashdl/*.py "$root"/python/flashdl/*.pyi "$root"/python/flashdl/py.typed; do
  ln -s "$f" "$pkg/"
done
ext=$(find "$build" -maxdepth 1 -name '_ext*.so' | head -n 1)
[ -n "$ext" ] || { echo "sanitize.sh: no _ext module in $build" >&2; exit 1; }
ln -s "$ext" "$pkg/"
site=$(python3 -c 'import site; print(":".join(site.getsitepackages()))')
export PYTHONPATH="$build/pkg:$root/tests/python:$site"
export LD_PRELOAD="$(g++ -print-file-name=libasan.so):$(g++ -print-file-name=libubsan.so)"
python3 -S -c "import flashdl._ext as e, sys; assert e.__file__.startswith('$build'), e.__file__"

echo "== pytest ($mode)"
cd "$root"
if [ "$mode" = short ]; then
  python3 -S -m pytest -q -p no:cacheprovider tests/python/test_errors.py \
    tests/python/test_reliability.py tests/python/test_kvcache.py
else
  python3 -S -m pytest -q -p no:cacheprovider tests/python \
    --ignore-glob='tests/python/test_cuda*' --ignore=tests/python/test_gpu_check.py \
    --ignore=tests/python/test_ring.py --ignore=tests/python/test_context_parallel.py \
    --ignore=tests/python/test_fuzz.py --ignore=tests/python/test_stress.py
fi
echo "sanitize.sh: $mode run clean"
