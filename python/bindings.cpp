// flashdl._ext: DLPack arrays in, flashdl::TensorView out, one call into the C++ core.
// Validation lives in the core (src/validate.cpp and the entry points' files); this file only
// translates what the core cannot see: DLPack dtype codes and device types, and TensorView's rank
// limit. No CUDA headers here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flashdl/api.hpp"
#include "xla_ffi.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

[[noreturn]] void fail(flashdl::ErrorKind kind, const std::string& msg) {
  throw flashdl::Error(kind, msg);
}

std::string dlpack_dtype_str(nb::dlpack::dtype dt) {
  using C = nb::dlpack::dtype_code;
  std::string name;
  switch (static_cast<C>(dt.code)) {
    case C::Int: name = "int"; break;
    case C::UInt: name = "uint"; break;
    case C::Float: name = "float"; break;
    case C::Bfloat: name = "bfloat"; break;
    case C::Complex: name = "complex"; break;
    case C::Bool: return "bool";
    default: name = "dlpack-code-" + std::to_string(dt.code) + "-"; break;
  }
  return name + std::to_string(dt.bits) + (dt.lanes != 1 ? "x" + std::to_string(dt.lanes) : "");
}

// The float override: NumPy's ml_dtypes bfloat16 cannot cross DLPack, so it arrives as a 16-bit
// integer view and `dtype="bfloat16"` names what it really is.
enum class Override { none, bfloat16 };

Override parse_override(const std::optional<std::string>& dtype) {
  if (!dtype) return Override::none;
  if (*dtype == "bfloat16") return Override::bfloat16;
  fail(flashdl::ErrorKind::value, "dtype: expected None or 'bfloat16', got '" + *dtype + "'");
}

constexpr const char* kFloatDtypes = "float16, bfloat16, float32 or float64";

flashdl::DType convert_dtype(const char* name, nb::dlpack::dtype dt, Override ov, bool is_float,
                             const char* expected) {
  using C = nb::dlpack::dtype_code;
  const auto code = static_cast<C>(dt.code);
  if (dt.lanes == 1) {
    if (is_float && ov == Override::bfloat16 && (code == C::UInt || code == C::Int) &&
        dt.bits == 16)
      return flashdl::DType::bfloat16;
    if (code == C::Float && dt.bits == 16) return flashdl::DType::float16;
    if (code == C::Float && dt.bits == 32) return flashdl::DType::float32;
    if (code == C::Float && dt.bits == 64) return flashdl::DType::float64;
    if (code == C::Bfloat && dt.bits == 16) return flashdl::DType::bfloat16;
    if (code == C::Int && dt.bits == 32) return flashdl::DType::int32;
    if (code == C::Bool) return flashdl::DType::boolean;
  }
  fail(flashdl::ErrorKind::type, std::string(name) + ": unsupported dtype " + dlpack_dtype_str(dt) +
                                     " (expected " + expected + ")");
}

flashdl::Device convert_device(const char* name, int type, int id) {
  if (type == nb::device::cpu::value || type == nb::device::cuda_host::value)
    return {flashdl::DeviceType::cpu, 0};
  if (type == nb::device::cuda::value || type == nb::device::cuda_managed::value)
    return {flashdl::DeviceType::cuda, id};
  fail(flashdl::ErrorKind::unsupported, std::string(name) + ": unsupported DLPack device type " +
                                            std::to_string(type) +
                                            " (flashdl runs on the CPU and on CUDA GPUs)");
}

template <typename Array>
flashdl::TensorView to_view(const char* name, const Array& a, Override ov, bool is_float,
                            const char* expected = kFloatDtypes) {
  flashdl::TensorView t;
  // TensorView holds at most kMaxRank extents; the core reports every other rank mismatch.
  if (a.ndim() > static_cast<size_t>(flashdl::kMaxRank))
    fail(flashdl::ErrorKind::value, std::string(name) + ": expected an array of rank 1 to " +
                                        std::to_string(flashdl::kMaxRank) + ", got rank " +
                                        std::to_string(a.ndim()));
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.dtype = convert_dtype(name, a.dtype(), ov, is_float, expected);
  t.device = convert_device(name, a.device_type(), a.device_id());
  t.rank = static_cast<int>(a.ndim());
  for (int i = 0; i < t.rank; ++i) {
    t.shape[i] = static_cast<int64_t>(a.shape(i));
    t.strides[i] = a.stride(i);
  }
  return t;
}

flashdl::Options make_options(std::optional<double> softmax_scale, bool causal, int64_t window_left,
                              int64_t window_right, const std::string& schedule, double dropout_p,
                              uint64_t seed, uint64_t offset, uintptr_t stream, int64_t sram_bytes,
                              int num_threads, bool deterministic) {
  flashdl::Options o;
  o.softmax_scale = softmax_scale ? *softmax_scale : std::numeric_limits<double>::quiet_NaN();
  if (softmax_scale && std::isnan(*softmax_scale))
    fail(flashdl::ErrorKind::value, "softmax_scale: expected a finite number or None, got nan");
  o.causal = causal;
  o.window_left = window_left;
  o.window_right = window_right;
  o.schedule = flashdl::parse_schedule(schedule);
  o.dropout_p = static_cast<float>(dropout_p);
  o.seed = seed;
  o.offset = offset;
  o.deterministic = deterministic;
  o.stream = reinterpret_cast<void*>(stream);
  o.sram_bytes = sram_bytes;
  o.num_threads = num_threads;
  return o;
}

// The dropout slice (Options::dropout_batch_offset): where this call's batch and heads sit in
// the call whose mask it draws a slice of; the core checks them.
void set_dropout_slice(flashdl::Options& o, int64_t batch_offset, int64_t head_offset,
                       int64_t nheads_total) {
  o.dropout_batch_offset = batch_offset;
  o.dropout_head_offset = head_offset;
  o.dropout_nheads_total = nheads_total;
}

// The score modifiers: ALiBi slopes (None: off; the core checks float32, shape and device) and
// softcap (0: off).
void set_score_mods(flashdl::Options& o, const std::optional<InArray>& alibi_slopes,
                    double softcap) {
  if (alibi_slopes)
    o.alibi_slopes = to_view("alibi_slopes", *alibi_slopes, Override::none, false, "float32");
  o.softcap = softcap;
}

// The options the attention entry points (dense and varlen, forward and backward) take alike:
// make_options' scalars, the block-sparse mask (a bool array over blocks of (block_size_q,
// block_size_k); None: dense; the core checks its shape, dtype and device) and the score
// modifiers.
flashdl::Options attention_options(std::optional<double> softmax_scale, bool causal,
                                   int64_t window_left, int64_t window_right,
                                   const std::string& schedule, double dropout_p, uint64_t seed,
                                   uint64_t offset, uintptr_t stream, int64_t sram_bytes,
                                   int num_threads, bool deterministic,
                                   const std::optional<InArray>& block_mask, int64_t block_size_q,
                                   int64_t block_size_k, const std::optional<InArray>& alibi_slopes,
                                   double softcap) {
  flashdl::Options o = make_options(softmax_scale, causal, window_left, window_right, schedule,
                                    dropout_p, seed, offset, stream, sram_bytes, num_threads,
                                    deterministic);
  if (block_mask) o.block_mask = to_view("block_mask", *block_mask, Override::none, false, "bool");
  o.block_size_q = block_size_q;
  o.block_size_k = block_size_k;
  set_score_mods(o, alibi_slopes, softcap);
  return o;
}

// Attention sinks (None: none) and, in the backward, the array for their gradient (None: not
// wanted); the core checks shape, dtype and device.
void set_extras(flashdl::Options& o, Override ov, const std::optional<InArray>& bias,
                const std::optional<InArray>& mask, const std::optional<InArray>& sinks,
                const std::optional<OutArray>& dbias, const std::optional<OutArray>& dsinks) {
  constexpr const char* kBias = "float32, float16 or bfloat16";
  if (bias) o.bias = to_view("bias", *bias, ov, true, kBias);
  if (mask) o.mask = to_view("mask", *mask, Override::none, false, "bool");
  if (sinks) o.sinks = to_view("sinks", *sinks, Override::none, false, "float32");
  if (dbias) o.dbias = to_view("dbias", *dbias, ov, true, kBias);
  if (dsinks) o.dsinks = to_view("dsinks", *dsinks, Override::none, false, "float32");
}

void forward(const InArray& q, const InArray& k, const InArray& v, const OutArray& out,
             const OutArray& lse, std::optional<std::string> dtype,
             std::optional<double> softmax_scale, bool causal, int64_t window_left,
             int64_t window_right, const std::string& schedule, double dropout_p, uint64_t seed,
             uint64_t offset, uintptr_t stream, int64_t sram_bytes, int num_threads,
             const std::optional<InArray>& block_mask, int64_t block_size_q, int64_t block_size_k,
             const std::optional<InArray>& alibi_slopes, double softcap, bool validate_only,
             const std::optional<InArray>& sinks, const std::optional<InArray>& bias,
             const std::optional<InArray>& mask, int64_t dropout_batch_offset,
             int64_t dropout_head_offset, int64_t dropout_nheads_total) {
  const Override ov = parse_override(dtype);
  flashdl::Options o = attention_options(softmax_scale, causal, window_left, window_right, schedule,
                                         dropout_p, seed, offset, stream, sram_bytes, num_threads,
                                         false, block_mask, block_size_q, block_size_k,
                                         alibi_slopes, softcap);
  set_dropout_slice(o, dropout_batch_offset, dropout_head_offset, dropout_nheads_total);
  set_extras(o, ov, bias, mask, sinks, std::nullopt, std::nullopt);
  o.validate_only = validate_only;
  const auto tq = to_view("q", q, ov, true), tk = to_view("k", k, ov, true),
             tv = to_view("v", v, ov, true), to = to_view("out", out, ov, true),
             tl = to_view("lse", lse, Override::none, false);
  nb::gil_scoped_release release;
  flashdl::forward(tq, tk, tv, to, tl, o);
}

// The common eager call (flashdl._api._fast_forward): every option at its default but causal,
// positional arguments (keyword parsing was a tenth of a tiny call), and lse None where the
// caller does not want it: the core then writes a scratch this call frees.
void forward_default(const InArray& q, const InArray& k, const InArray& v, const OutArray& out,
                     const std::optional<OutArray>& lse, bool causal) {
  flashdl::Options o;
  o.causal = causal;
  const auto tq = to_view("q", q, Override::none, true), tk = to_view("k", k, Override::none, true),
             tv = to_view("v", v, Override::none, true),
             to = to_view("out", out, Override::none, true);
  flashdl::TensorView tl;
  std::unique_ptr<float[]> scratch;
  if (lse) {
    tl = to_view("lse", *lse, Override::none, false);
  } else {
    // (batch, nheads, seqlen_q) of a (batch, seqlen_q, nheads, headdim) q; another rank gets an
    // empty placeholder and the core reports q.
    static float placeholder;
    const bool rank4 = tq.rank == 4;
    const int64_t b = rank4 ? tq.shape[0] : 0, h = rank4 ? tq.shape[2] : 0,
                  s = rank4 ? tq.shape[1] : 0;
    const int64_t n = b * h * s;
    if (n > 0) scratch.reset(new float[static_cast<size_t>(n)]);
    tl = flashdl::make_view(n > 0 ? scratch.get() : &placeholder, flashdl::DType::float32,
                            {b, h, s});
  }
  nb::gil_scoped_release release;
  flashdl::forward(tq, tk, tv, to, tl, o);
}

void backward(const InArray& dout, const InArray& q, const InArray& k, const InArray& v,
              const InArray& out, const InArray& lse, const OutArray& dq, const OutArray& dk,
              const OutArray& dv, std::optional<std::string> dtype,
              std::optional<double> softmax_scale, bool causal, int64_t window_left,
              int64_t window_right, const std::string& schedule, double dropout_p, uint64_t seed,
              uint64_t offset, uintptr_t stream, int64_t sram_bytes, int num_threads,
              bool deterministic, const std::optional<InArray>& block_mask, int64_t block_size_q,
              int64_t block_size_k, const std::optional<InArray>& alibi_slopes, double softcap,
              const std::optional<InArray>& sinks, const std::optional<OutArray>& dsinks,
              const std::optional<InArray>& bias, const std::optional<InArray>& mask,
              const std::optional<OutArray>& dbias, int64_t dropout_batch_offset,
              int64_t dropout_head_offset, int64_t dropout_nheads_total) {
  const Override ov = parse_override(dtype);
  flashdl::Options o = attention_options(softmax_scale, causal, window_left, window_right, schedule,
                                         dropout_p, seed, offset, stream, sram_bytes, num_threads,
                                         deterministic, block_mask, block_size_q, block_size_k,
                                         alibi_slopes, softcap);
  set_dropout_slice(o, dropout_batch_offset, dropout_head_offset, dropout_nheads_total);
  set_extras(o, ov, bias, mask, sinks, dbias, dsinks);
  const auto tdo = to_view("dout", dout, ov, true), tq = to_view("q", q, ov, true),
             tk = to_view("k", k, ov, true), tv = to_view("v", v, ov, true),
             to = to_view("out", out, ov, true), tl = to_view("lse", lse, Override::none, false),
             tdq = to_view("dq", dq, ov, true), tdk = to_view("dk", dk, ov, true),
             tdv = to_view("dv", dv, ov, true);
  nb::gil_scoped_release release;
  flashdl::backward(tdo, tq, tk, tv, to, tl, tdq, tdk, tdv, o);
}

// cu_seqlens: int32 offsets in host memory, read by the core.
flashdl::TensorView cu_view(const char* name, const InArray& a) {
  return to_view(name, a, Override::none, false, "int32");
}

void forward_varlen(const InArray& q, const InArray& k, const InArray& v,
                    const InArray& cu_seqlens_q, const InArray& cu_seqlens_k, int64_t max_seqlen_q,
                    int64_t max_seqlen_k, const OutArray& out, const OutArray& lse,
                    std::optional<std::string> dtype, std::optional<double> softmax_scale,
                    bool causal, int64_t window_left, int64_t window_right,
                    const std::string& schedule, double dropout_p, uint64_t seed, uint64_t offset,
                    uintptr_t stream, int64_t sram_bytes, int num_threads,
                    const std::optional<InArray>& block_mask, int64_t block_size_q,
                    int64_t block_size_k, const std::optional<InArray>& alibi_slopes,
                    double softcap, bool validate_only, const std::optional<InArray>& block_table,
                    const std::optional<InArray>& seqused_k, const std::optional<InArray>& sinks,
                    const std::optional<InArray>& bias, const std::optional<InArray>& mask) {
  const Override ov = parse_override(dtype);
  flashdl::Options o = attention_options(softmax_scale, causal, window_left, window_right, schedule,
                                         dropout_p, seed, offset, stream, sram_bytes, num_threads,
                                         false, block_mask, block_size_q, block_size_k,
                                         alibi_slopes, softcap);
  set_extras(o, ov, bias, mask, sinks, std::nullopt, std::nullopt);
  o.validate_only = validate_only;
  const auto tq = to_view("q", q, ov, true), tk = to_view("k", k, ov, true),
             tv = to_view("v", v, ov, true), tcq = cu_view("cu_seqlens_q", cu_seqlens_q),
             tck = cu_view("cu_seqlens_k", cu_seqlens_k), to = to_view("out", out, ov, true),
             tl = to_view("lse", lse, Override::none, false);
  flashdl::PagedKv pk;
  if (block_table)
    pk.block_table = to_view("block_table", *block_table, Override::none, false, "int32");
  if (seqused_k) pk.seqused_k = to_view("seqused_k", *seqused_k, Override::none, false, "int32");
  nb::gil_scoped_release release;
  flashdl::forward_varlen(tq, tk, tv, tcq, tck, max_seqlen_q, max_seqlen_k, to, tl, o, pk);
}

void backward_varlen(const InArray& dout, const InArray& q, const InArray& k, const InArray& v,
                     const InArray& out, const InArray& lse, const InArray& cu_seqlens_q,
                     const InArray& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                     const OutArray& dq, const OutArray& dk, const OutArray& dv,
                     std::optional<std::string> dtype, std::optional<double> softmax_scale,
                     bool causal, int64_t window_left, int64_t window_right,
                     const std::string& schedule, double dropout_p, uint64_t seed, uint64_t offset,
                     uintptr_t stream, int64_t sram_bytes, int num_threads, bool deterministic,
                     const std::optional<InArray>& block_mask, int64_t block_size_q,
                     int64_t block_size_k, const std::optional<InArray>& alibi_slopes,
                     double softcap, const std::optional<InArray>& sinks,
                     const std::optional<OutArray>& dsinks, const std::optional<InArray>& bias,
                     const std::optional<InArray>& mask, const std::optional<OutArray>& dbias) {
  const Override ov = parse_override(dtype);
  flashdl::Options o = attention_options(softmax_scale, causal, window_left, window_right, schedule,
                                         dropout_p, seed, offset, stream, sram_bytes, num_threads,
                                         deterministic, block_mask, block_size_q, block_size_k,
                                         alibi_slopes, softcap);
  set_extras(o, ov, bias, mask, sinks, dbias, dsinks);
  const auto tdo = to_view("dout", dout, ov, true), tq = to_view("q", q, ov, true),
             tk = to_view("k", k, ov, true), tv = to_view("v", v, ov, true),
             to = to_view("out", out, ov, true), tl = to_view("lse", lse, Override::none, false),
             tcq = cu_view("cu_seqlens_q", cu_seqlens_q),
             tck = cu_view("cu_seqlens_k", cu_seqlens_k), tdq = to_view("dq", dq, ov, true),
             tdk = to_view("dk", dk, ov, true), tdv = to_view("dv", dv, ov, true);
  nb::gil_scoped_release release;
  flashdl::backward_varlen(tdo, tq, tk, tv, to, tl, tcq, tck, max_seqlen_q, max_seqlen_k, tdq, tdk,
                           tdv, o);
}

// k_cache and v_cache arrive read-only (nanobind) but are written when k_new and v_new are given:
// the Python layer refuses arrays it knows to be read-only (NumPy's flag, JAX arrays).
void forward_kvcache(const InArray& q, const InArray& k_cache, const InArray& v_cache,
                     const InArray& cache_seqlens, const std::optional<InArray>& k_new,
                     const std::optional<InArray>& v_new, const std::optional<InArray>& block_table,
                     const OutArray& out, const OutArray& lse, std::optional<std::string> dtype,
                     std::optional<double> softmax_scale, bool causal, int64_t window_left,
                     int64_t window_right, int64_t num_splits, uintptr_t stream, int num_threads,
                     const std::optional<InArray>& alibi_slopes, double softcap,
                     const std::optional<InArray>& rotary_cos,
                     const std::optional<InArray>& rotary_sin, bool rotary_interleaved,
                     const std::optional<InArray>& cache_batch_idx,
                     const std::optional<InArray>& cache_leftpad,
                     const std::optional<InArray>& sinks, const std::optional<InArray>& bias,
                     const std::optional<InArray>& mask) {
  const Override ov = parse_override(dtype);
  flashdl::Options o = make_options(softmax_scale, causal, window_left, window_right, "auto", 0.0,
                                    0, 0, stream, 0, num_threads, false);
  set_score_mods(o, alibi_slopes, softcap);
  set_extras(o, ov, bias, mask, sinks, std::nullopt, std::nullopt);
  o.num_splits = num_splits;
  const flashdl::TensorView none{};
  const auto tq = to_view("q", q, ov, true), tkc = to_view("k_cache", k_cache, ov, true),
             tvc = to_view("v_cache", v_cache, ov, true),
             tlen = to_view("cache_seqlens", cache_seqlens, Override::none, false, "int32"),
             tk = k_new ? to_view("k", *k_new, ov, true) : none,
             tv = v_new ? to_view("v", *v_new, ov, true) : none,
             tbt = block_table
                       ? to_view("block_table", *block_table, Override::none, false, "int32")
                       : none,
             to = to_view("out", out, ov, true), tl = to_view("lse", lse, Override::none, false);
  flashdl::KvCacheExtras x;
  if (rotary_cos) x.rotary_cos = to_view("rotary_cos", *rotary_cos, ov, true);
  if (rotary_sin) x.rotary_sin = to_view("rotary_sin", *rotary_sin, ov, true);
  x.rotary_interleaved = rotary_interleaved;
  if (cache_batch_idx)
    x.cache_batch_idx = to_view("cache_batch_idx", *cache_batch_idx, Override::none, false,
                                "int32");
  if (cache_leftpad)
    x.cache_leftpad = to_view("cache_leftpad", *cache_leftpad, Override::none, false, "int32");
  nb::gil_scoped_release release;
  flashdl::forward_kvcache(tq, tkc, tvc, tlen, tk, tv, tbt, to, tl, o, x);
}

void merge_states(const std::vector<InArray>& outs, const std::vector<InArray>& lses,
                  const OutArray& out, const OutArray& lse, std::optional<std::string> dtype,
                  uintptr_t stream) {
  const Override ov = parse_override(dtype);
  std::vector<flashdl::TensorView> to, tl;
  for (size_t i = 0; i < outs.size(); ++i)
    to.push_back(to_view(("outs[" + std::to_string(i) + "]").c_str(), outs[i], ov, true));
  for (size_t i = 0; i < lses.size(); ++i)
    tl.push_back(
        to_view(("lses[" + std::to_string(i) + "]").c_str(), lses[i], Override::none, false));
  const auto tout = to_view("out", out, ov, true),
             tlse = to_view("lse", lse, Override::none, false);
  nb::gil_scoped_release release;
  flashdl::merge_states(to, tl, tout, tlse, reinterpret_cast<void*>(stream));
}

void dropout_mask(const OutArray& mask_out, double dropout_p, uint64_t seed, uint64_t offset) {
  const auto tm = to_view("mask_out", mask_out, Override::none, false);
  nb::gil_scoped_release release;
  flashdl::dropout_mask(tm, dropout_p, seed, offset);
}

nb::dict build_info() {
  const flashdl::BuildInfo b = flashdl::build_info();
  nb::dict d;
  d["version"] = b.version;
  d["cuda_compiled"] = b.cuda_compiled;
  d["cuda_architectures"] = b.cuda_architectures;
  d["cuda_device_count"] = b.cuda_device_count;
  d["cuda_status"] = b.cuda_status;
  d["cpu_isa"] = b.cpu_isa;
  d["cpu_threads"] = b.cpu_threads;
  d["cpu_sram_bytes"] = b.cpu_sram_bytes;
  return d;
}

// The XLA FFI custom-call targets (xla_ffi.hpp) as (name, platform, capsule) for
// jax.ffi.register_ffi_target; flashdl.jax registers them on first use.
nb::list xla_ffi_targets() {
  nb::list out;
  for (const auto& t : flashdl::xla_ffi::targets())
    out.append(nb::make_tuple(t.name, t.platform, nb::capsule(reinterpret_cast<void*>(t.handler))));
  return out;
}

void translate_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const flashdl::Error& e) {
    PyObject* type = PyExc_RuntimeError;
    if (e.kind() == flashdl::ErrorKind::value) type = PyExc_ValueError;
    if (e.kind() == flashdl::ErrorKind::type) type = PyExc_TypeError;
    if (e.kind() == flashdl::ErrorKind::not_implemented) type = PyExc_NotImplementedError;
    PyErr_SetString(type, e.what());
  }
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "flashdl's C++ core: exact FlashAttention over DLPack arrays (destination passing).";
  nb::register_exception_translator(translate_error);

  m.def("forward", &forward, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(),
        "out"_a.noconvert(), "lse"_a.noconvert(), nb::kw_only(), "dtype"_a = nb::none(),
        "softmax_scale"_a = nb::none(), "causal"_a = false, "window_left"_a = -1,
        "window_right"_a = -1, "schedule"_a = "auto", "dropout_p"_a = 0.0, "seed"_a = 0,
        "offset"_a = 0, "stream"_a = 0, "sram_bytes"_a = 0, "num_threads"_a = 0,
        "block_mask"_a.noconvert() = nb::none(), "block_size_q"_a = 128, "block_size_k"_a = 128,
        "alibi_slopes"_a.noconvert() = nb::none(), "softcap"_a = 0.0, "validate_only"_a = false,
        "sinks"_a.noconvert() = nb::none(), "bias"_a.noconvert() = nb::none(),
        "mask"_a.noconvert() = nb::none(), "dropout_batch_offset"_a = 0,
        "dropout_head_offset"_a = 0, "dropout_nheads_total"_a = 0,
        "Attention forward (validate_only: check the arguments, compute nothing): writes out (like "
        "q) and lse (float32, (batch, nheads, seqlen_q)).");

  m.def("forward_default", &forward_default, "q"_a.noconvert(), "k"_a.noconvert(),
        "v"_a.noconvert(), "out"_a.noconvert(), "lse"_a.noconvert().none(), "causal"_a,
        "forward with every option at its default but causal; lse None: not returned.");

  m.def("backward", &backward, "dout"_a.noconvert(), "q"_a.noconvert(), "k"_a.noconvert(),
        "v"_a.noconvert(), "out"_a.noconvert(), "lse"_a.noconvert(), "dq"_a.noconvert(),
        "dk"_a.noconvert(), "dv"_a.noconvert(), nb::kw_only(), "dtype"_a = nb::none(),
        "softmax_scale"_a = nb::none(), "causal"_a = false, "window_left"_a = -1,
        "window_right"_a = -1, "schedule"_a = "auto", "dropout_p"_a = 0.0, "seed"_a = 0,
        "offset"_a = 0, "stream"_a = 0, "sram_bytes"_a = 0, "num_threads"_a = 0,
        "deterministic"_a = false, "block_mask"_a.noconvert() = nb::none(), "block_size_q"_a = 128,
        "block_size_k"_a = 128, "alibi_slopes"_a.noconvert() = nb::none(), "softcap"_a = 0.0,
        "sinks"_a.noconvert() = nb::none(), "dsinks"_a.noconvert() = nb::none(),
        "bias"_a.noconvert() = nb::none(), "mask"_a.noconvert() = nb::none(),
        "dbias"_a.noconvert() = nb::none(), "dropout_batch_offset"_a = 0,
        "dropout_head_offset"_a = 0, "dropout_nheads_total"_a = 0,
        "Attention backward: writes dq, dk, dv (shaped and typed like q, k, v).");

  m.def("forward_varlen", &forward_varlen, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(),
        "cu_seqlens_q"_a.noconvert(), "cu_seqlens_k"_a.noconvert(), "max_seqlen_q"_a,
        "max_seqlen_k"_a, "out"_a.noconvert(), "lse"_a.noconvert(), nb::kw_only(),
        "dtype"_a = nb::none(), "softmax_scale"_a = nb::none(), "causal"_a = false,
        "window_left"_a = -1, "window_right"_a = -1, "schedule"_a = "auto", "dropout_p"_a = 0.0,
        "seed"_a = 0, "offset"_a = 0, "stream"_a = 0, "sram_bytes"_a = 0, "num_threads"_a = 0,
        "block_mask"_a.noconvert() = nb::none(), "block_size_q"_a = 128, "block_size_k"_a = 128,
        "alibi_slopes"_a.noconvert() = nb::none(), "softcap"_a = 0.0, "validate_only"_a = false,
        "block_table"_a.noconvert() = nb::none(), "seqused_k"_a.noconvert() = nb::none(),
        "sinks"_a.noconvert() = nb::none(), "bias"_a.noconvert() = nb::none(),
        "mask"_a.noconvert() = nb::none(),
        "Variable-length forward (validate_only: check the arguments but not the values of "
        "cu_seqlens, compute nothing): q (total_q, nheads, headdim), k, v (total_k, nheads_kv, "
        "headdim), cu_seqlens int32 (batch + 1,) on the CPU; writes out (like q) and lse "
        "(float32, (nheads, total_q)).");

  m.def("backward_varlen", &backward_varlen, "dout"_a.noconvert(), "q"_a.noconvert(),
        "k"_a.noconvert(), "v"_a.noconvert(), "out"_a.noconvert(), "lse"_a.noconvert(),
        "cu_seqlens_q"_a.noconvert(), "cu_seqlens_k"_a.noconvert(), "max_seqlen_q"_a,
        "max_seqlen_k"_a, "dq"_a.noconvert(), "dk"_a.noconvert(), "dv"_a.noconvert(), nb::kw_only(),
        "dtype"_a = nb::none(), "softmax_scale"_a = nb::none(), "causal"_a = false,
        "window_left"_a = -1, "window_right"_a = -1, "schedule"_a = "auto", "dropout_p"_a = 0.0,
        "seed"_a = 0, "offset"_a = 0, "stream"_a = 0, "sram_bytes"_a = 0, "num_threads"_a = 0,
        "deterministic"_a = false, "block_mask"_a.noconvert() = nb::none(), "block_size_q"_a = 128,
        "block_size_k"_a = 128, "alibi_slopes"_a.noconvert() = nb::none(), "softcap"_a = 0.0,
        "sinks"_a.noconvert() = nb::none(), "dsinks"_a.noconvert() = nb::none(),
        "bias"_a.noconvert() = nb::none(), "mask"_a.noconvert() = nb::none(),
        "dbias"_a.noconvert() = nb::none(),
        "Variable-length backward: writes dq, dk, dv (shaped and typed like q, k, v).");

  m.def("forward_kvcache", &forward_kvcache, "q"_a.noconvert(), "k_cache"_a.noconvert(),
        "v_cache"_a.noconvert(), "cache_seqlens"_a.noconvert(), "k"_a.noconvert().none(),
        "v"_a.noconvert().none(), "block_table"_a.noconvert().none(), "out"_a.noconvert(),
        "lse"_a.noconvert(), nb::kw_only(), "dtype"_a = nb::none(), "softmax_scale"_a = nb::none(),
        "causal"_a = false, "window_left"_a = -1, "window_right"_a = -1, "num_splits"_a = 0,
        "stream"_a = 0, "num_threads"_a = 0, "alibi_slopes"_a.noconvert() = nb::none(),
        "softcap"_a = 0.0, "rotary_cos"_a.noconvert() = nb::none(),
        "rotary_sin"_a.noconvert() = nb::none(), "rotary_interleaved"_a = false,
        "cache_batch_idx"_a.noconvert() = nb::none(), "cache_leftpad"_a.noconvert() = nb::none(),
        "sinks"_a.noconvert() = nb::none(), "bias"_a.noconvert() = nb::none(),
        "mask"_a.noconvert() = nb::none(),
        "Attention over a KV cache: appends k, v (when given) to k_cache, v_cache at "
        "cache_seqlens, then writes out (like q) and lse (float32, (batch, nheads, seqlen_q)).");

  m.def("merge_states", &merge_states, "outs"_a.noconvert(), "lses"_a.noconvert(),
        "out"_a.noconvert(), "lse"_a.noconvert(), nb::kw_only(), "dtype"_a = nb::none(),
        "stream"_a = 0,
        "Merges attention results over disjoint key sets: writes out and lse (CUDA arrays: on "
        "`stream`, a cudaStream_t as an int; 0: the legacy default stream).");

  m.def("dropout_mask", &dropout_mask, "mask_out"_a.noconvert(), nb::kw_only(), "dropout_p"_a,
        "seed"_a, "offset"_a = 0,
        "Writes the dropout keep-mask of (dropout_p, seed, offset) into mask_out, bool "
        "(batch, nheads, seqlen_q, seqlen_k).");

  m.def("xla_ffi_targets", &xla_ffi_targets,
        "XLA FFI handlers of this build: a list of (target name, platform, PyCapsule).");

  m.def("build_info", &build_info, "What this build and machine offer.");
  m.def("set_num_threads", &flashdl::set_num_threads, "n"_a,
        "CPU threads for later calls; 0 restores the default.");
}
