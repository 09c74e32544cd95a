#!/usr/bin/env bash
# Builds and checks flashdl's documentation site (docs/ -> build/docs/html):
#   1. the HTML site, warnings as errors (broken cross-references, bad markup, a docstring that
#      does not parse);
#   2. the doctest builder: every example in the pages and in the docstrings runs and gives the
#      output shown;
#   3. every public name (each module's __all__, and each public class) of flashdl,
#      flashdl.torch, flashdl.jax, flashdl.flash_attn and flashdl.transformers is in the reference.
# Needs flashdl installed in the active Python (the site's reference is generated from it), the
# `docs` extra's packages (Sphinx, the theme, MyST, sphinx-copybutton), and torch, jax,
# transformers and ml_dtypes for the examples that use them. Exits non-zero on any failure.
#
#   bash tools/check_docs.sh          # then open build/docs/html/index.html
#   bash tools/check_docs.sh --deps   # first installs the docs extra's packages, as pyproject.toml
#                                     # lists them, into the active Python; flashdl as installed
#                                     # (pip install ".[docs]" would compile the library again)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=build/docs
status=0

if [ "${1:-}" = "--deps" ]; then
  deps=$("$PYTHON" - <<'PY'
import pathlib
import re

text = pathlib.Path("pyproject.toml").read_text(encoding="utf-8")
extras = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
docs = re.search(r"^docs\s*=\s*\[(.*?)\]", extras.group(1), re.M | re.S) if extras else None
if docs is None:
    raise SystemExit("check_docs.sh: no docs extra in pyproject.toml")
print("\n".join(re.findall(r'"([^"]+)"', docs.group(1))))
PY
  ) || exit 1
  mapfile -t DEPS <<< "$deps"
  echo "== docs: installing the docs extra's packages: ${DEPS[*]}"
  "$PYTHON" -m pip install -q "${DEPS[@]}" || exit 1
elif [ $# -gt 0 ]; then
  echo "usage: bash tools/check_docs.sh [--deps]" >&2
  exit 2
fi

echo "== docs: HTML (sphinx-build -W --keep-going)"
# -E: a fresh environment, so that warnings of pages unchanged since the last build are reported.
"$PYTHON" -m sphinx -W --keep-going -q -E -b html -d "$OUT/doctrees" docs "$OUT/html" || status=1

echo "== docs: doctest (the examples in the pages and the docstrings)"
"$PYTHON" -m sphinx -W --keep-going -q -b doctest -d "$OUT/doctrees" docs "$OUT/doctest" \
  || status=1
if [ -f "$OUT/doctest/output.txt" ]; then
  tail -n 4 "$OUT/doctest/output.txt"
fi

echo "== docs: every public name in the API reference"
"$PYTHON" - "$OUT/html/objects.inv" <<'PY' || status=1
import importlib
import inspect
import sys

from sphinx.util.inventory import InventoryFile

MODULES = ["flashdl", "flashdl.torch", "flashdl.jax", "flashdl.flash_attn", "flashdl.transformers"]
with open(sys.argv[1], "rb") as f:
    inv = InventoryFile.load(f, "", lambda base, uri: uri)
documented = {name for kind, entries in inv.items() if kind.startswith("py:") for name in entries}

missing, count = [], 0
for modname in MODULES:
    mod = importlib.import_module(modname)
    names = set(mod.__all__)
    names |= {n for n, obj in vars(mod).items() if inspect.isclass(obj) and not n.startswith("_")
              and getattr(obj, "__module__", "") == modname}
    for name in sorted(names):
        count += 1
        if f"{modname}.{name}" not in documented:
            missing.append(f"{modname}.{name}")
if missing:
    print("not in the API reference (docs/api/):", *missing, sep="\n  ")
    sys.exit(1)
print(f"all {count} public names are in the reference")
PY

if [ "$status" -ne 0 ]; then
  echo "check_docs.sh: FAILED" >&2
else
  echo "check_docs.sh: OK (site in $OUT/html/index.html)"
fi
exit "$status"
