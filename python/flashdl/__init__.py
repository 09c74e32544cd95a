"""flashdl: exact FlashAttention (FA-1 and FA-2 schedules) on the CPU and CUDA GPUs.

    import flashdl
    out = flashdl.attention(q, k, v, causal=True)      # NumPy, PyTorch, JAX (CPU) or CuPy arrays
    dq, dk, dv = flashdl.attention_backward(dout, q, k, v, out, lse, causal=True)
    out, lse, seed = flashdl.attention(q, k, v, dropout_p=0.1, return_lse=True, return_seed=True)
    keep = flashdl.dropout_mask(b, h, sq, sk, 0.1, seed)   # the mask that call applied
    out = flashdl.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)  # packed, no padding
    out = flashdl.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k=k, v=v)

    import flashdl.torch                               # autograd: loss.backward() flows through
    out = flashdl.torch.attention(q, k, v, causal=True)

Layout (batch, seqlen, nheads, headdim). `python -m flashdl` runs a check and a comparison with
naive attention; `flashdl.info()` says what this build and machine offer.
"""

from typing import TYPE_CHECKING

from ._api import attention, attention_backward, dropout_mask
from ._info import info, set_num_threads
from ._kvcache import attention_with_kvcache, merge_states, merge_states_list
from ._varlen import attention_varlen, attention_varlen_backward

__version__ = info()["version"]
__all__ = [
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "dropout_mask",
    "info",
    "merge_states",
    "merge_states_list",
    "set_num_threads",
    "__version__",
]

if not TYPE_CHECKING:
    # Hidden from type checkers, which would otherwise accept any flashdl.<name>: for them,
    # `import flashdl.torch` (as documented) is what makes flashdl.torch known.
    def __getattr__(name):
        # flashdl.torch, .jax and .transformers import their framework: load them when asked.
        if name in ("torch", "jax", "transformers"):
            import importlib

            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module 'flashdl' has no attribute {name!r}")
