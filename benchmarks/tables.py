"""What every benchmark table shares: the machine line and how a table is printed and saved."""
from __future__ import annotations

import platform
import subprocess


def cpu_model() -> str:
    """The CPU's model name from lscpu (the processor string where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def emit(lines, out=None):
    """Prints the markdown lines and, with `out`, writes them to that file."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "w") as fh:
            fh.write(text)
