#!/usr/bin/env bash
CLANG_FORMAT_VERSION=21.1.8
# Checks that every tracked C++/CUDA file (*.hpp *.cpp *.cu *.cuh *.inl *.h) is formatted as
# .clang-format says, with the clang-format of the PyPI wheel clang-format==$CLANG_FORMAT_VERSION
# (other versions break some lines differently). Exits non-zero, naming each file and line, when
# one is not.
#
#   bash tools/lint_cpp.sh          check (the test command runs this)
#   bash tools/lint_cpp.sh --fix    rewrite the files in place
#
# The clang-format used: $CLANG_FORMAT if set, else the one on PATH, which must be version
# $CLANG_FORMAT_VERSION (pip install clang-format==$CLANG_FORMAT_VERSION).
set -euo pipefail
cd "$(dirname "$0")/.."

FIX=0
for arg in "$@"; do
  case "$arg" in
    --fix) FIX=1 ;;
    *) echo "lint_cpp.sh: unknown argument $arg (expected --fix)" >&2; exit 2 ;;
  esac
done

CF=${CLANG_FORMAT:-clang-format}
if ! command -v "$CF" >/dev/null 2>&1; then
  echo "lint_cpp.sh: $CF not found; pip install clang-format==$CLANG_FORMAT_VERSION" >&2
  exit 2
fi
HAVE=$("$CF" --version | sed -n 's/.*clang-format version \([0-9][0-9.]*\).*/\1/p')
if [ "$HAVE" != "$CLANG_FORMAT_VERSION" ]; then
  echo "lint_cpp.sh: $CF is version ${HAVE:-unknown}, expected $CLANG_FORMAT_VERSION" \
       "(pip install clang-format==$CLANG_FORMAT_VERSION)" >&2
  exit 2
fi

FILES=()
while IFS= read -r -d '' f; do
  [ -f "$f" ] && FILES+=("$f")  # a file deleted but not yet committed is skipped
done < <(git ls-files -z -- '*.hpp' '*.cpp' '*.cu' '*.cuh' '*.inl' '*.h')
[ "${#FILES[@]}" -gt 0 ] || { echo "lint_cpp.sh: no C++ files found" >&2; exit 2; }

if [ "$FIX" = 1 ]; then
  printf '%s\0' "${FILES[@]}" | xargs -0 -n 50 "$CF" -i --style=file
  echo "lint_cpp.sh: formatted ${#FILES[@]} files"
else
  printf '%s\0' "${FILES[@]}" | xargs -0 -n 50 "$CF" --dry-run -Werror --style=file
  echo "lint_cpp.sh: ${#FILES[@]} files formatted as .clang-format says"
fi
