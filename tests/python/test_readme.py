"""Every ```python snippet of README.md runs on its own, in a fresh interpreter, as a first-time
user would paste it (a snippet needing torch or JAX skips where that framework is missing)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
SNIPPETS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 3


@pytest.mark.parametrize("code", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_readme_snippet_runs(code, tmp_path):
    for framework in ("torch", "jax", "transformers"):
        if re.search(rf"^\s*(import|from) {framework}\b", code, flags=re.M):
            pytest.importorskip(framework)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"README snippet failed:\n{code}\n{r.stderr}"
