"""Sphinx configuration for flashdl's documentation site.

Build: ``sphinx-build -W --keep-going -b html docs build/docs/html`` (or ``bash tools/check_docs.sh``,
which also runs the doctests and checks that every public name is in the API reference).
The reference is generated from the installed package's docstrings, so flashdl must be importable
(``python -m pip install .``, then ``bash tools/check_docs.sh --deps`` for Sphinx and the theme;
an editable install picks up docstring edits at once).
"""

from __future__ import annotations

import json
import pathlib
import re

import flashdl

ROOT = pathlib.Path(__file__).resolve().parent.parent

project = "flashdl"
author = "the flashdl developers"
copyright = "2026, the flashdl developers"
release = flashdl.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx_copybutton",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# ---- MyST (the markdown pages) ---------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3

# ---- the API reference (autodoc + napoleon, NumPy-style docstrings) --------------------------
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_ivar = True
# Signatures as written (one per function, not one per typing overload); types are in the
# docstrings' Parameters sections.
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": False}
# Broken references to functions, modules and attributes are errors (-W); the free-form type
# descriptions of NumPy docstrings ("array (batch, seqlen, nheads, headdim)") are not classes.
nitpicky = True
nitpick_ignore_regex = [("py:class", r".*")]

# ---- doctest builder: the examples in the pages and in the docstrings --------------------------
doctest_global_setup = """
import os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np
np.random.seed(0)
"""
doctest_default_flags = (__import__("doctest").ELLIPSIS
                         | __import__("doctest").NORMALIZE_WHITESPACE
                         | __import__("doctest").DONT_ACCEPT_TRUE_FOR_1)

# ---- HTML --------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"flashdl {release}"
html_static_path: list[str] = []
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True


# ---- Performance: one page per measured table in benchmarks/results/ ---------------------------
def _write_results_pages() -> None:
    """Writes docs/performance/results/<name>.md for every benchmarks/results/<name>.md: a title
    (the file's first heading) and a MyST include of the file itself, so the tables on the site
    are the measured files, never copies. The directory is generated (git-ignored)."""
    out = ROOT / "docs" / "performance" / "results"
    out.mkdir(parents=True, exist_ok=True)
    wanted = {}
    for src in sorted((ROOT / "benchmarks" / "results").glob("*.md")):
        text = src.read_text(encoding="utf-8")
        inc = f"../../../benchmarks/results/{src.name}"
        m = re.search(r"^# (.+)$", text, flags=re.M)
        if m is None:
            title, parts = src.stem, [(inc, "")]
        else:
            title = m.group(1).strip()
            # The first heading is the page's title; a later level-1 heading becomes level 2.
            offset = 1 if re.search(r"^# ", text[m.end():], flags=re.M) else 0
            # Options as a YAML block: a '#' would start a comment in ':option: value' form.
            parts = [(inc, f"---\nstart-after: {json.dumps(m.group(0))}\n"
                           f"heading-offset: {offset}\n---\n")]
            if text[:m.start()].strip():  # words before the first heading come first
                parts.insert(0, (inc, f"---\nend-before: {json.dumps(m.group(0))}\n---\n"))
        body = f"# {title}\n\nMeasured results, included from `benchmarks/results/{src.name}`.\n\n"
        for path, options in parts:
            body += f"```{{include}} {path}\n{options}```\n\n"
        wanted[src.stem + ".md"] = body
    for stale in out.glob("*.md"):
        if stale.name not in wanted:
            stale.unlink()
    for name, body in wanted.items():
        path = out / name
        if not path.exists() or path.read_text(encoding="utf-8") != body:
            path.write_text(body, encoding="utf-8")


_write_results_pages()
