"""flashdl.jax: attention inside jax.jit, jax.grad and jax.vmap through XLA FFI custom calls."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import flashdl  # noqa: E402
import flashdl.jax as fj  # noqa: E402
from attn_oracle import assert_lse, assert_rule, backward, forward, fwd_ulps  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def arrays(shapes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s), dtype=dtype) for s in shapes]


def f64(*xs):
    return [np.asarray(x, np.float64) for x in xs]


CASES = [  # (b, sq, sk, h, hk, d), causal, window, softcap
    ((2, 11, 7, 4, 2, 16), True, (-1, -1), 0.0),     # GQA, bottom-right causal
    ((1, 33, 33, 2, 2, 32), False, (5, 3), 0.0),     # window
    ((2, 17, 40, 4, 1, 8), False, (-1, -1), 1.5),    # MQA, softcap
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape,causal,window,softcap", CASES)
def test_jit_forward_matches_oracle(dtype, shape, causal, window, softcap):
    b, sq, sk, h, hk, d = shape
    q, k, v = arrays([(b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)], dtype)
    f = jax.jit(lambda q, k, v: fj.attention(q, k, v, causal=causal, window_size=window,
                                             softcap=softcap, return_lse=True))
    out, lse = f(q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (b, h, sq)
    opts = dict(causal=causal, window=window, softcap=softcap)
    o_ref, lse_ref = forward(*f64(q, k, v), **opts)
    o_low, _ = forward(*f64(q, k, v), dtype=dtype, exact=False, **opts)
    assert_rule(np.asarray(out, np.float64), o_ref, o_low, dtype, ulps=fwd_ulps(dtype, q, k))
    assert_lse(np.asarray(lse), lse_ref)
    eager = flashdl.attention(q, k, v, causal=causal, window_size=window, softcap=softcap)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(eager))  # the same kernels


def _dpa_loss(w, causal):
    def loss(q, k, v):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
        return (o.astype(jnp.float32) * w).sum()
    return loss


def _flashdl_loss(w, causal):
    def loss(q, k, v):
        return (fj.attention(q, k, v, causal=causal).astype(jnp.float32) * w).sum()
    return loss


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_jit_grad_matches_jax_dot_product_attention(dtype, causal):
    """jax.jit(jax.grad(loss)) through flashdl is within flash-attn's rule of the float64 oracle,
    with jax.nn.dot_product_attention's own gradient (same dtype) as the low-precision baseline.
    seqlen_q == seqlen_k, where JAX's top-left causal and flashdl's bottom-right agree."""
    q, k, v = arrays([(2, 24, 4, 16), (2, 24, 2, 16), (2, 24, 2, 16)], dtype, seed=1)
    (w,) = arrays([(2, 24, 4, 16)], "float32", seed=2)
    got = jax.jit(jax.grad(_flashdl_loss(w, causal), argnums=(0, 1, 2)))(q, k, v)
    base = jax.jit(jax.grad(_dpa_loss(w, causal), argnums=(0, 1, 2)))(q, k, v)
    dout = np.broadcast_to(np.asarray(w, np.float64), q.shape)
    oracle = backward(dout, *f64(q, k, v), causal=causal)
    for name, g, b, o in zip(("dq", "dk", "dv"), got, base, oracle):
        assert g.dtype == q.dtype
        assert_rule(np.asarray(g, np.float64), o, np.asarray(b, np.float64), dtype, what=name,
                    ulps=8.0 if dtype == "float32" else 1.0, grad=True)


def test_hlo_holds_the_ffi_calls():
    q, k, v = arrays([(1, 8, 2, 8)] * 3, "float32")
    fwd = jax.jit(lambda q, k, v: fj.attention(q, k, v)).lower(q, k, v).as_text()
    grad = jax.jit(jax.grad(_flashdl_loss(1.0, True), argnums=(0, 1, 2))).lower(q, k, v)
    grad_text, compiled = grad.as_text(), grad.compile().as_text()
    assert "stablehlo.custom_call @flashdl_attention_fwd" in fwd
    assert "stablehlo.custom_call @flashdl_attention_bwd" in grad_text
    for target in ("flashdl_attention_fwd", "flashdl_attention_bwd"):  # the compiled HLO
        assert f'custom_call_target="{target}"' in compiled
        assert "api_version=API_VERSION_TYPED_FFI" in compiled
    for text in (fwd, grad_text, compiled):
        assert "callback" not in text.lower()


def test_vmap_folds_into_the_batch():
    q, k, v = arrays([(3, 2, 9, 2, 8), (3, 2, 5, 1, 8), (3, 2, 5, 1, 8)], "float32", seed=3)
    mapped = jax.jit(jax.vmap(lambda q, k, v: fj.attention(q, k, v, causal=True)))(q, k, v)
    one_by_one = [fj.attention(q[i], k[i], v[i], causal=True) for i in range(3)]
    np.testing.assert_array_equal(np.asarray(mapped), np.stack([np.asarray(o) for o in one_by_one]))
    # k, v shared across the mapped axis; and the gradient under vmap
    shared = jax.vmap(lambda q: fj.attention(q, k[0], v[0]))(q)
    np.testing.assert_array_equal(np.asarray(shared[1]), np.asarray(fj.attention(q[1], k[0], v[0])))
    per_example = jax.vmap(jax.grad(lambda q, k, v: fj.attention(q, k, v).sum()))(q, k, v)
    direct = jax.grad(lambda q: fj.attention(q, k[2], v[2]).sum())(q[2])
    np.testing.assert_allclose(np.asarray(per_example[2]), np.asarray(direct), rtol=1e-6,
                               atol=1e-6)


def test_return_lse_carries_no_gradient():
    q, k, v = arrays([(1, 6, 2, 8), (1, 9, 2, 8), (1, 9, 2, 8)], "float32", seed=4)
    _, lse = fj.attention(q, k, v, return_lse=True)
    assert_lse(np.asarray(lse), forward(*f64(q, k, v))[1])
    g = jax.grad(lambda q: fj.attention(q, k, v, return_lse=True)[1].sum())(q)
    assert not np.asarray(g).any()


def test_options_reach_the_kernel():
    """schedule, softmax_scale and deterministic are attributes of the call, not ignored."""
    q, k, v = arrays([(1, 20, 2, 16), (1, 20, 2, 16), (1, 20, 2, 16)], "float32", seed=5)
    o_ref, _ = forward(*f64(q, k, v), softmax_scale=0.3)
    for schedule in ("fa1", "fa2", "reference"):
        out = jax.jit(lambda q: fj.attention(q, k, v, softmax_scale=0.3, schedule=schedule))(q)
        np.testing.assert_allclose(np.asarray(out), o_ref, rtol=2e-5, atol=2e-6)
    g1 = jax.grad(lambda q: fj.attention(q, k, v, deterministic=True).sum())(q)
    g2 = jax.grad(lambda q: fj.attention(q, k, v, deterministic=True).sum())(q)
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))


def _packed(lengths_q, lengths_k, h, hk, d, dtype, seed):
    q, k, v = arrays([(sum(lengths_q), h, d), (sum(lengths_k), hk, d), (sum(lengths_k), hk, d)],
                     dtype, seed)
    cu_q = jnp.asarray(np.concatenate([[0], np.cumsum(lengths_q)]), jnp.int32)
    cu_k = jnp.asarray(np.concatenate([[0], np.cumsum(lengths_k)]), jnp.int32)
    return q, k, v, cu_q, cu_k


def test_varlen_jit_and_grad_match_each_sequence_alone():
    lq, lk = [5, 0, 12, 3], [7, 4, 12, 0]
    q, k, v, cu_q, cu_k = _packed(lq, lk, 4, 2, 16, "float32", seed=6)
    (w,) = arrays([q.shape], "float32", seed=7)

    def loss(q, k, v, cu_q, cu_k):
        return (fj.attention_varlen(q, k, v, cu_q, cu_k, 12, 12, causal=True) * w).sum()
    out = jax.jit(lambda *a: fj.attention_varlen(*a, 12, 12, causal=True))(q, k, v, cu_q, cu_k)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, cu_q, cu_k)
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, cu_q, cu_k).as_text()
    assert "flashdl_attention_varlen_bwd" in text and "callback" not in text.lower()
    for i in range(len(lq)):
        rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        args = [x[None] for x in (q[rq], k[rk], v[rk])]
        if lq[i] == 0:
            continue
        o = fj.attention(*args, causal=True)
        np.testing.assert_allclose(np.asarray(out[rq]), np.asarray(o[0]), rtol=1e-6, atol=1e-6)
        if lk[i] == 0:
            assert not np.asarray(out[rq]).any()  # no key: out 0
            continue
        dq, dk, dv = jax.grad(lambda q, k, v: (fj.attention(q, k, v, causal=True) * w[rq][None])
                              .sum(), argnums=(0, 1, 2))(*args)
        for got, want in ((grads[0][rq], dq), (grads[1][rk], dk), (grads[2][rk], dv)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want[0]), rtol=1e-5, atol=1e-6)


def test_zero_length_inputs():
    q, k, v = arrays([(0, 4, 2, 8), (0, 3, 2, 8), (0, 3, 2, 8)], "float32")
    assert jax.jit(fj.attention)(q, k, v).shape == (0, 4, 2, 8)
    q, k, v = arrays([(2, 0, 2, 8), (2, 3, 2, 8), (2, 3, 2, 8)], "float32")
    g = jax.grad(lambda k: fj.attention(q, k, v).sum())(k)
    assert g.shape == k.shape and not np.asarray(g).any()
    q, k, v = arrays([(2, 4, 2, 8), (2, 0, 2, 8), (2, 0, 2, 8)], "float32")
    out, lse = fj.attention(q, k, v, return_lse=True)
    assert not np.asarray(out).any() and np.isneginf(np.asarray(lse)).all()


@pytest.mark.parametrize("call,match,kind", [
    (lambda q, k, v: fj.attention(q[0], k[0], v[0]), r"\bq\b.*rank 4", ValueError),
    (lambda q, k, v: fj.attention(q, k[..., :4], v), r"\bk\b.*headdim", ValueError),
    (lambda q, k, v: fj.attention(q, k[:1], v[:1]), r"k: batch 1 does not match the batch of q, 2",
     ValueError),
    (lambda q, k, v: fj.attention(q, k.astype(jnp.float16), v), r"\bk\b.*dtype", TypeError),
    (lambda q, k, v: fj.attention(q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)),
     r"\bq\b.*dtype.*int32", TypeError),
    (lambda q, k, v: fj.attention(q.astype(jnp.bfloat16), k, v), r"\bk\b.*bfloat16", TypeError),
    (lambda q, k, v: fj.attention(q, k, v.astype(jnp.bfloat16)), r"\bv\b.*got bfloat16",
     TypeError),
    (lambda q, k, v: fj.attention(q, k, v, schedule="fa3"), r"\bschedule\b", ValueError),
    (lambda q, k, v: fj.attention(q, k, v, window_size=3), r"\bwindow_size\b", TypeError),
    (lambda q, k, v: fj.attention(q, k, v, softmax_scale="x"), r"\bsoftmax_scale\b", TypeError),
    (lambda q, k, v: fj.attention(q, k, v, softcap=-1.0), r"\bsoftcap\b", ValueError),
])
def test_errors_name_the_argument(call, match, kind):
    q, k, v = arrays([(2, 4, 2, 8)] * 3, "float32")
    before = [np.asarray(x).copy() for x in (q, k, v)]
    with pytest.raises(kind, match=match):
        jax.jit(call)(q, k, v)
    for x, b in zip((q, k, v), before):
        np.testing.assert_array_equal(np.asarray(x), b)


def test_varlen_errors():
    q, k, v, cu_q, cu_k = _packed([3, 4], [3, 4], 2, 2, 8, "float32", seed=8)
    with pytest.raises(TypeError, match=r"\bcu_seqlens_q\b.*int32"):
        fj.attention_varlen(q, k, v, cu_q.astype(jnp.float32), cu_k, 4, 4)
    with pytest.raises(ValueError, match=r"\bcu_seqlens_k\b"):
        fj.attention_varlen(q, k, v, cu_q, cu_k[:2], 4, 4)
    with pytest.raises(TypeError, match=r"\bmax_seqlen_q\b.*static"):
        jax.jit(lambda n: fj.attention_varlen(q, k, v, cu_q, cu_k, n, 4))(4)
    # offsets are data: checked by the core when the handler runs, reported through XLA
    bad = jnp.asarray([0, 5, 7], jnp.int32)
    with pytest.raises(Exception, match=r"max_seqlen_q|cu_seqlens_q"):
        jax.block_until_ready(jax.jit(lambda c: fj.attention_varlen(q, k, v, c, cu_k, 4, 4))(bad))


def test_abi_header_matches_jaxlib():
    """python/xla_ffi_abi.hpp, flashdl's own declaration of XLA's FFI C ABI, compiled next to the
    installed jaxlib's c_api.h: every offset, size and enum value it relies on must agree."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    checks = []
    pairs = {
        # By the metadata extension's member, not by name: the jaxlib on the H100 machine
        # (0.11.2) declares no XLA_FFI_Extension_Base, and its FFI calls ran there.
        "ExtensionBase": ("TheirExtensionBase", ["struct_size", "type", "next"]),
        "ApiVersion": ("XLA_FFI_Api_Version",
                       ["struct_size", "extension_start", "major_version", "minor_version"]),
        "ErrorCreateArgs": ("XLA_FFI_Error_Create_Args",
                            ["struct_size", "extension_start", "message", "errc"]),
        "Buffer": ("XLA_FFI_Buffer",
                   ["struct_size", "extension_start", "dtype", "data", "rank", "dims"]),
        "ByteSpan": ("XLA_FFI_ByteSpan", ["ptr", "len"]),
        "Scalar": ("XLA_FFI_Scalar", ["dtype", "value"]),
        "Args": ("XLA_FFI_Args", ["struct_size", "extension_start", "size", "types", "args"]),
        "Rets": ("XLA_FFI_Rets", ["struct_size", "extension_start", "size", "types", "rets"]),
        "Attrs": ("XLA_FFI_Attrs",
                  ["struct_size", "extension_start", "size", "types", "names", "attrs"]),
        "CallFrame": ("XLA_FFI_CallFrame", ["struct_size", "extension_start", "api", "ctx",
                                            "stage", "args", "rets", "attrs"]),
        "StreamGetArgs": ("XLA_FFI_Stream_Get_Args",
                          ["struct_size", "extension_start", "ctx", "stream"]),
        "DeviceOrdinalGetArgs": ("XLA_FFI_DeviceOrdinal_Get_Args",
                                 ["struct_size", "extension_start", "ctx", "device_ordinal"]),
        "Metadata": ("XLA_FFI_Metadata", ["struct_size", "api_version", "traits"]),
        "MetadataExtension": ("XLA_FFI_Metadata_Extension", ["extension_base", "metadata"]),
    }
    for ours, (theirs, fields) in pairs.items():
        for f in fields:
            checks.append(f"static_assert(offsetof(A::{ours}, {f}) == offsetof({theirs}, {f}), "
                          f"\"{ours}.{f}\");")
        if ours not in ("CallFrame", "Metadata"):  # their trailing fields are beyond our use
            checks.append(f"static_assert(sizeof(A::{ours}) == sizeof({theirs}), \"{ours}\");")
    api_fields = {"error_create": "XLA_FFI_Error_Create", "stream_get": "XLA_FFI_Stream_Get",
                  "device_ordinal_get": "XLA_FFI_DeviceOrdinal_Get"}
    for ours, theirs in api_fields.items():
        checks.append(f"static_assert(offsetof(A::Api, {ours}) == offsetof(XLA_FFI_Api, "
                      f"{theirs}), \"Api.{ours}\");")
    sizes = {"kCallFrameSize": "XLA_FFI_CallFrame_STRUCT_SIZE",
             "kMetadataSize": "XLA_FFI_Metadata_STRUCT_SIZE",
             "kMetadataExtensionSize": "XLA_FFI_Metadata_Extension_STRUCT_SIZE",
             "kApiVersionSize": "XLA_FFI_Api_Version_STRUCT_SIZE",
             "kErrorCreateArgsSize": "XLA_FFI_Error_Create_Args_STRUCT_SIZE",
             "kStreamGetArgsSize": "XLA_FFI_Stream_Get_Args_STRUCT_SIZE",
             "kDeviceOrdinalGetArgsSize": "XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE",
             "kBufferSize": "XLA_FFI_Buffer_STRUCT_SIZE"}
    for ours, theirs in sizes.items():
        checks.append(f"static_assert(A::{ours} == {theirs}, \"{ours}\");")
    enums = {"kExtensionMetadata": "XLA_FFI_Extension_Metadata",
             "kInvalidArgument": "XLA_FFI_Error_Code_INVALID_ARGUMENT",
             "kUnimplemented": "XLA_FFI_Error_Code_UNIMPLEMENTED",
             "kInternal": "XLA_FFI_Error_Code_INTERNAL", "kPred": "XLA_FFI_DataType_PRED",
             "kS8": "XLA_FFI_DataType_S8", "kS16": "XLA_FFI_DataType_S16",
             "kS32": "XLA_FFI_DataType_S32", "kS64": "XLA_FFI_DataType_S64",
             "kU8": "XLA_FFI_DataType_U8", "kU16": "XLA_FFI_DataType_U16",
             "kU32": "XLA_FFI_DataType_U32", "kF16": "XLA_FFI_DataType_F16",
             "kF32": "XLA_FFI_DataType_F32", "kF64": "XLA_FFI_DataType_F64",
             "kBF16": "XLA_FFI_DataType_BF16", "kArgBuffer": "XLA_FFI_ArgType_BUFFER",
             "kRetBuffer": "XLA_FFI_RetType_BUFFER", "kAttrScalar": "XLA_FFI_AttrType_SCALAR",
             "kAttrString": "XLA_FFI_AttrType_STRING",
             "kExecute": "XLA_FFI_ExecutionStage_EXECUTE"}
    for ours, theirs in enums.items():
        checks.append(f"static_assert(static_cast<int>(A::{ours}) == {theirs}, \"{ours}\");")
    checks.append("static_assert(A::kApiMajor == XLA_FFI_API_MAJOR && "
                  "A::kApiMinor <= XLA_FFI_API_MINOR, \"version\");")
    source = ("#include <cstddef>\n#include \"xla/ffi/api/c_api.h\"\n#include \"xla_ffi_abi.hpp\"\n"
              "namespace A = flashdl::xla_abi;\n"
              "using TheirExtensionBase = decltype(XLA_FFI_Metadata_Extension::extension_base);\n"
              + "\n".join(checks) + "\nint main() {}\n")
    run = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-x", "c++", "-",
                          f"-I{jax.ffi.include_dir()}", f"-I{ROOT / 'python'}"],
                         input=source, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("call,match", [
    # The caller's shapes, never the zero-length stand-ins of earlier trace-time checks.
    (lambda q, k, v: fj.attention(q, k, v[:, :3]),
     r"v: expected shape \(3, 10, 4, 32\) \(the shape of k\), got \(3, 3, 4, 32\)"),
    (lambda q, k, v: fj.attention(q, k[:, :, :3], v[:, :, :3]),
     r"nheads_kv 3 must divide nheads of q, 4"),
    (lambda q, k, v: fj.attention_varlen(q[0], k[0], v[0, :7], jnp.array([0, 4, 10], jnp.int32),
                                         jnp.array([0, 4, 10], jnp.int32), 6, 6),
     r"v: expected shape \(10, 4, 32\) \(the shape of k\), got \(7, 4, 32\)"),
])
def test_errors_quote_the_callers_shapes(call, match):
    q, k, v = arrays([(3, 10, 4, 32)] * 3, "float32")
    with pytest.raises(ValueError, match=match):
        jax.jit(call)(q, k, v)

