#!/usr/bin/env bash
# The habits check, run by the test command (tests/run.sh step 2) in seconds: over python/flashdl
# ruff's lint rules and its formatting (ruff format --check), then mypy, all as pyproject.toml
# configures them, and the package's import graph (tools/import_graph.py: no import circle, no
# private name taken from another module, no file over 800 lines); then tools/lint_cpp.sh
# (clang-format over the C++ and CUDA sources). Exits non-zero on any finding, after running every
# check.
#
#   python -m pip install -r tools/lint-requirements.txt    # the pinned versions, once
#   bash tools/lint.sh
#
# To fix what the formatters report: python -m ruff format && python -m ruff check --fix, and
# bash tools/lint_cpp.sh --fix. mypy's cache is build/mypy_cache.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
status=0

# The version pinned in tools/lint-requirements.txt for package $1.
pinned() { sed -n "s/^$1==//p" tools/lint-requirements.txt; }

# Refuses a version other than the pinned one (other versions format and flag differently).
check_version() {
  local name=$1 have want
  want=$(pinned "$name")
  have=$("$PYTHON" -m "$name" --version 2>/dev/null | sed -n 's/^[a-z]* \([0-9][0-9.]*\).*/\1/p')
  if [ "$have" != "$want" ]; then
    echo "lint.sh: $name ${have:-not installed} in $PYTHON, expected $want" \
         "($PYTHON -m pip install -r tools/lint-requirements.txt)" >&2
    status=1
    return 1
  fi
}

step() {
  local start=$SECONDS
  echo "== lint: $*"
  "$@" || status=1
  echo "   ($((SECONDS - start)) s)"
}

if check_version ruff; then
  step "$PYTHON" -m ruff check --no-cache --quiet
  step "$PYTHON" -m ruff format --no-cache --check --quiet
fi
if check_version mypy; then
  step "$PYTHON" -m mypy --cache-dir build/mypy_cache
fi
step "$PYTHON" tools/import_graph.py
if [ -f tools/lint_cpp.sh ]; then
  step bash tools/lint_cpp.sh
fi

if [ "$status" -ne 0 ]; then
  echo "lint.sh: FAILED" >&2
fi
exit "$status"
