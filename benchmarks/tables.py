"""What every benchmark table shares: the machine line, the FLOP count and how a table is printed
and saved."""
from __future__ import annotations

import platform
import subprocess

# flash-attn's benchmark count: the backward is 2.5x the forward's FLOPs, forward+backward 3.5x.
PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def attention_flops(b, h, sq, sk, d, causal, pass_="fwd"):
    """FLOPs of one pass as flash-attn's benchmarks count them: the forward is 4*b*h*sq*sk*d (two
    matrix products), halved when causal."""
    f = 4.0 * b * h * sq * sk * d
    return (f / 2 if causal else f) * PASS_FACTOR[pass_]


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


def nvidia_driver() -> str:
    """The NVIDIA driver version nvidia-smi reports ("unknown" without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        return out.splitlines()[0].strip() if out.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def gpu_model(torch, device=0) -> str:
    """The GPU's name, compute capability, multiprocessors and memory, as torch reports them."""
    p = torch.cuda.get_device_properties(device)
    return (f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
            f"{p.total_memory / 2**30:.1f} GiB)")
