#!/usr/bin/env bash
# The compiler's view of every CUDA kernel, for review without a GPU: registers, spills, stack and
# shared memory (ptxas -v) per kernel, and, when cuobjdump is on PATH (with nvdisasm), the counts of
# tensor-core (HMMA), cp.async (LDGSTS), local-memory (LDL/STL) and global atomic (RED/ATOM)
# instructions in the SASS. Writes a markdown table to stdout.
#
#   bash tools/kernel_report.sh [BUILD_DIR] [ARCH]     (defaults: build/dev, 90)
#
# BUILD_DIR must be a configured CMake tree with the CUDA backend (it holds the generated
# translation units); nothing in it is modified.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build/dev}
ARCH=${2:-90}
GEN="$BUILD_DIR/src/cuda/generated"
if [ ! -d "$GEN" ]; then
  echo "no generated CUDA sources in $GEN: configure with -DFLASHDL_CUDA=ON first" >&2
  exit 2
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

compile() {  # one generated translation unit -> object + ptxas log
  local name ftz=
  name=$(basename "$1" .cu)
  case "$name" in fwd_* | bwd_*) ftz=-ftz=true ;; esac  # as src/cuda/CMakeLists.txt compiles them
  nvcc $ftz -DFLASHDL_CUDA_ARCHS=\""$ARCH"\" -Iinclude -Isrc -Isrc/cuda -O3 -DNDEBUG -std=c++17 \
    --expt-relaxed-constexpr --generate-code=arch=compute_"$ARCH",code=sm_"$ARCH" \
    -Xptxas -v -c "$1" -o "$WORK/$name.o" 2> "$WORK/$name.log"
}
export -f compile
export ARCH WORK
# The generated translation units, and the sources that define kernels of their own (kvcache.cu's
# append and combine, merge.cu's merge_states).
ls "$GEN"/*.cu src/cuda/*.cu | xargs -P "$(nproc)" -I{} bash -c 'compile {}'

echo "# CUDA kernels, sm_$ARCH: ptxas report"
echo
echo "nvcc: $(nvcc --version | tail -1)"
echo
echo "| translation unit | kernel | registers | spill stores / loads (bytes) | stack (bytes) | static smem (bytes) |"
echo "|---|---|---:|---:|---:|---:|"
for log in "$WORK"/*.log; do
  unit=$(basename "$log" .log)
  awk -v unit="$unit" '
    /Compiling entry function/ {
      fn = $0; sub(/.*function ./, "", fn); sub(/. for .*/, "", fn)
      cmd = "c++filt \"" fn "\""; cmd | getline fn; close(cmd)
      sub(/\(.*/, "", fn); sub(/^void /, "", fn); gsub(/flashdl::cuda::/, "", fn)
      gsub(/\|/, "\\|", fn)
    }
    /bytes stack frame/ { stack = $1; st = $5; ld = $9 }
    /Used [0-9]+ registers/ {
      regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
      smem = 0
      if (match($0, /[0-9]+ bytes smem/)) { smem = substr($0, RSTART, RLENGTH); sub(/ .*/, "", smem) }
      printf "| %s | `%s` | %s | %s / %s | %s | %s |\n", unit, fn, regs, st, ld, stack, smem
    }' "$log"
done

if command -v cuobjdump > /dev/null 2>&1 && cuobjdump -sass "$WORK"/$(ls "$WORK" | grep '\.o$' | head -1) > /dev/null 2>&1; then
  echo
  echo "## SASS instruction counts (cuobjdump -sass)"
  echo
  echo "| translation unit | kernel | HMMA | LDGSTS | LDL/STL | RED/ATOM |"
  echo "|---|---|---:|---:|---:|---:|"
  for obj in "$WORK"/*.o; do
    unit=$(basename "$obj" .o)
    cuobjdump -sass "$obj" | awk -v unit="$unit" '
      /Function :/ { fn = $3; order[++n] = fn }
      /HMMA/ { h[fn]++ } /LDGSTS/ { c[fn]++ } /[^A-Z](LDL|STL)[. ]/ { l[fn]++ }
      /[^A-Z](RED|REDG|ATOM|ATOMG)[. ]/ { a[fn]++ }
      END {
        for (i = 1; i <= n; ++i) {
          fn = order[i]; cmd = "c++filt \"" fn "\""; cmd | getline name; close(cmd)
          sub(/\(.*/, "", name); sub(/^void /, "", name); gsub(/flashdl::cuda::/, "", name)
          printf "| %s | `%s` | %d | %d | %d | %d |\n", unit, name, h[fn], c[fn], l[fn], a[fn]
        }
      }'
  done
else
  echo
  echo "(cuobjdump with nvdisasm not on PATH: no SASS counts; pip's nvidia-cuda-cuobjdump and"
  echo "nvidia-cuda-nvdisasm wheels provide them)"
fi
