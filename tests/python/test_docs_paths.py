"""Every documentation page the project's own files name by path (a Markdown page or an image
under docs/) exists: a page moved or renamed without its mentions fails here, with the file and
line."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where prose and comments name documentation pages. Measured results record the commands as they
# ran (benchmarks/results/, and a page's "- command:" line) and are left as written.
SCANNED = ["README.md", "CMakeLists.txt", "pyproject.toml", "docs", "python", "src", "include",
           "cmake", "tests", "tools", "benchmarks", "examples"]
SKIPPED_DIRS = {"results", "__pycache__", "_build"}
SUFFIXES = {".md", ".rst", ".py", ".pyi", ".cpp", ".hpp", ".cu", ".cuh", ".in", ".cmake", ".txt",
            ".toml", ".sh", ".yml", ".yaml"}
MENTION = re.compile(r"(?<![\w/.-])docs/[\w./-]+\.(?:md|rst|png)")


def _files():
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            for f in sorted(path.rglob("*")):
                if (f.is_file() and (f.suffix in SUFFIXES or f.name == "CMakeLists.txt")
                        and not SKIPPED_DIRS & set(f.relative_to(ROOT).parts)):
                    yield f


def test_every_named_docs_page_exists():
    missing = []
    for f in _files():
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if line.startswith("- command:"):
                continue
            for m in MENTION.finditer(line):
                if not (ROOT / m.group(0)).exists():
                    missing.append(f"{f.relative_to(ROOT)}:{n}: {m.group(0)}")
    assert not missing, "documentation pages named but not there:\n" + "\n".join(missing)
