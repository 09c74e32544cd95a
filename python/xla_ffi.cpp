// flashdl's XLA FFI handlers: XLA's call frame in, one call into the C++ core, an XLA error out
// when the core refuses (its message names the argument). See xla_ffi.hpp for the targets.
#include "xla_ffi.hpp"

#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "flashdl/api.hpp"

namespace flashdl::xla_ffi {
namespace {

using namespace xla_abi;

[[noreturn]] void fail(ErrorKind kind, const std::string& msg) { throw flashdl::Error(kind, msg); }

enum class Platform { cpu, cuda };

// The decoded call frame: buffers as TensorViews on the call's device, attributes by name.
class Frame {
 public:
  Frame(const CallFrame* cf, Platform platform) : cf_(cf) {
    if (platform == Platform::cuda) {
      const Api* api = cf->api;
      const size_t need = offsetof(Api, device_ordinal_get) + sizeof(void*);
      if (api->struct_size < need || api->device_ordinal_get == nullptr)
        fail(ErrorKind::unsupported, "this XLA has no device ordinal query (XLA FFI < 0.1)");
      DeviceOrdinalGetArgs dev{kDeviceOrdinalGetArgsSize, nullptr, cf->ctx, 0};
      StreamGetArgs st{kStreamGetArgsSize, nullptr, cf->ctx, nullptr};
      if (api->device_ordinal_get(&dev) != nullptr || api->stream_get(&st) != nullptr)
        fail(ErrorKind::runtime, "XLA did not give the call's device and stream");
      device_ = {DeviceType::cuda, dev.device_ordinal};
      stream_ = st.stream;
    }
  }

  void* stream() const { return stream_; }
  bool on_cuda() const { return device_.type == DeviceType::cuda; }
  Device device() const { return device_; }
  int64_t nargs() const { return cf_->args.size; }
  int64_t nrets() const { return cf_->rets.size; }
  const Buffer* raw_arg(int64_t i) const { return static_cast<const Buffer*>(cf_->args.args[i]); }
  const Buffer* raw_ret(int64_t i) const { return static_cast<const Buffer*>(cf_->rets.rets[i]); }

  // Optional attributes (the ones added after the first release of these targets): `fallback`
  // when the call does not carry them, so frames built for the older targets keep working.
  bool has(std::string_view name) const { return lookup(name) >= 0; }
  int64_t integer_or(std::string_view name, int64_t fallback) const {
    return has(name) ? integer(name) : fallback;
  }
  double real_or(std::string_view name, double fallback) const {
    return has(name) ? real(name) : fallback;
  }

  // Argument i as a view named `name`. keep > 0: every axis before the last `keep` folds into
  // one leading (batch) axis, so rank keep + 1 comes out of any rank > keep.
  TensorView arg(int64_t i, const char* name, int keep = 0) const {
    if (i >= cf_->args.size)
      fail(ErrorKind::value, std::string(name) + ": missing (the call has " +
                                 std::to_string(cf_->args.size) + " arguments)");
    return view(static_cast<const Buffer*>(cf_->args.args[i]), name, keep);
  }
  TensorView ret(int64_t i, const char* name, int keep = 0) const {
    if (i >= cf_->rets.size)
      fail(ErrorKind::value, std::string(name) + ": missing (the call has " +
                                 std::to_string(cf_->rets.size) + " results)");
    return view(static_cast<const Buffer*>(cf_->rets.rets[i]), name, keep);
  }

  bool flag(std::string_view name) const { return integer(name) != 0; }

  int64_t integer(std::string_view name) const {
    const Scalar& s = scalar(name);
    switch (s.dtype) {
      case kPred: return *static_cast<const bool*>(s.value) ? 1 : 0;
      case kS8: return *static_cast<const int8_t*>(s.value);
      case kS16: return *static_cast<const int16_t*>(s.value);
      case kS32: return *static_cast<const int32_t*>(s.value);
      case kS64: return *static_cast<const int64_t*>(s.value);
      case kU8: return *static_cast<const uint8_t*>(s.value);
      case kU16: return *static_cast<const uint16_t*>(s.value);
      case kU32: return *static_cast<const uint32_t*>(s.value);
      default: break;
    }
    fail(ErrorKind::type, std::string(name) + ": expected an integer or bool attribute");
  }

  double real(std::string_view name) const {
    const Scalar& s = scalar(name);
    if (s.dtype == kF64) return *static_cast<const double*>(s.value);
    if (s.dtype == kF32) return *static_cast<const float*>(s.value);
    return static_cast<double>(integer(name));
  }

  std::string text(std::string_view name) const {
    const int64_t i = find(name, kAttrString);
    const auto* span = static_cast<const ByteSpan*>(cf_->attrs.attrs[i]);
    return std::string(span->ptr, span->len);
  }

 private:
  int64_t lookup(std::string_view name) const {
    for (int64_t i = 0; i < cf_->attrs.size; ++i) {
      const ByteSpan* n = cf_->attrs.names[i];
      if (std::string_view(n->ptr, n->len) == name) return i;
    }
    return -1;
  }

  int64_t find(std::string_view name, AttrType type) const {
    const int64_t i = lookup(name);
    if (i < 0) fail(ErrorKind::value, std::string(name) + ": missing attribute");
    if (cf_->attrs.types[i] != type)
      fail(ErrorKind::type, std::string(name) + ": attribute of the wrong kind");
    return i;
  }

  const Scalar& scalar(std::string_view name) const {
    return *static_cast<const Scalar*>(cf_->attrs.attrs[find(name, kAttrScalar)]);
  }

  TensorView view(const Buffer* b, const char* name, int keep) const {
    TensorView t;
    t.data = b->data;
    t.device = device_;
    switch (b->dtype) {
      case kF16: t.dtype = DType::float16; break;
      case kBF16: t.dtype = DType::bfloat16; break;
      case kF32: t.dtype = DType::float32; break;
      case kF64: t.dtype = DType::float64; break;
      case kS32: t.dtype = DType::int32; break;
      case kPred: t.dtype = DType::boolean; break;
      default:
        fail(ErrorKind::type, std::string(name) + ": unsupported XLA element type " +
                                  std::to_string(static_cast<int>(b->dtype)));
    }
    const int64_t lead = keep > 0 && b->rank > keep ? b->rank - keep : 0;
    const int64_t rank = lead > 0 ? keep + 1 : b->rank;
    if (rank > kMaxRank)
      fail(ErrorKind::value, std::string(name) + ": rank " + std::to_string(b->rank) +
                                 " is more than flashdl's " + std::to_string(kMaxRank));
    t.rank = static_cast<int>(rank);
    int64_t outer = 1;
    for (int64_t i = 0; i < lead; ++i) outer *= b->dims[i];
    for (int64_t i = 0; i < rank; ++i)
      t.shape[i] = lead > 0 ? (i == 0 ? outer : b->dims[lead + i - 1]) : b->dims[i];
    int64_t stride = 1;  // XLA hands custom calls dense row-major buffers
    for (int64_t i = rank - 1; i >= 0; --i) {
      t.strides[i] = stride;
      stride *= t.shape[i];
    }
    return t;
  }

  const CallFrame* cf_;
  Device device_{};
  void* stream_ = nullptr;
};

// The dropout seed: a uint32 (2,) buffer (low word, high word), a traced value of the JAX program,
// read on the host; or (4,): (low word, high word, dropout_batch_offset, dropout_head_offset),
// which flashdl.jax's sharded calls build per shard from jax.lax.axis_index (the shard's place in
// the whole call, so that its mask is the slice of the whole call's; the global head count comes
// as the attribute dropout_nheads_total). On CUDA its bytes are copied to the host on the
// call's stream, which the handler then waits for (flashdl::copy_to_host): the host blocks until
// the work XLA queued before this call has run, and the kernel launches after that (no overlap of
// the host with that work).
void read_seed(const Frame& f, int64_t i, Options& o) {
  if (i >= f.nargs()) fail(ErrorKind::value, "seed: missing (dropout_p > 0 needs the seed buffer)");
  const Buffer* b = f.raw_arg(i);
  if (b->dtype != kU32 || b->rank != 1 || (b->dims[0] != 2 && b->dims[0] != 4))
    fail(ErrorKind::type,
         "seed: expected a uint32 buffer of shape (2,) (low word, high word) or "
         "(4,) (low word, high word, batch offset, head offset)");
  const int64_t n = b->dims[0];
  uint32_t w[4] = {0, 0, 0, 0};
  copy_to_host(w, make_view(b->data, DType::int32, {n}, f.device()), f.stream(), "seed");
  o.seed = static_cast<uint64_t>(w[0]) | (static_cast<uint64_t>(w[1]) << 32);
  o.dropout_batch_offset = static_cast<int64_t>(w[2]);
  o.dropout_head_offset = static_cast<int64_t>(w[3]);
}

// Sinks (and dSinks) travel as float32 (nheads,), or as (batch, nheads) with every row equal (the
// dense targets: one row per batch entry, so that they shard and fold with q's batch): the core
// reads row 0 and the (nheads,) view of it is returned; `rows` gets the number of rows.
TensorView first_row(TensorView t, int64_t& rows) {
  rows = 1;
  if (t.rank == 2) {
    rows = t.shape[0];
    t.rank = 1;
    t.shape[0] = t.shape[1];
    t.strides[0] = t.strides[1];
  }
  return t;
}

// The optional array arguments after the fixed ones, in this order when present: block_mask
// (attribute has_block_mask), alibi_slopes (has_alibi), bias (has_bias), mask (has_mask), sinks
// (has_sinks), seed (dropout_p > 0; see read_seed). `first` is the index of the first of them. In the backward
// (first_ret >= 0) dbias (with has_bias) and dsinks (with has_sinks) are the results from
// first_ret on; dsinks_rows gets the rows of the dsinks buffer (see first_row).
void optional_args(const Frame& f, int64_t first, Options& o, int64_t first_ret = -1,
                   int64_t* dsinks_rows = nullptr) {
  int64_t i = first;
  if (f.integer_or("has_block_mask", 0) != 0) {
    o.block_mask = f.arg(i++, "block_mask", 3);
    o.block_size_q = f.integer("block_size_q");
    o.block_size_k = f.integer("block_size_k");
  }
  if (f.integer_or("has_alibi", 0) != 0) o.alibi_slopes = f.arg(i++, "alibi_slopes", 1);
  const bool has_bias = f.integer_or("has_bias", 0) != 0;
  const bool has_sinks = f.integer_or("has_sinks", 0) != 0;
  if (has_bias) o.bias = f.arg(i++, "bias", 3);
  if (f.integer_or("has_mask", 0) != 0) o.mask = f.arg(i++, "mask", 3);
  int64_t rows = 1;
  if (has_sinks) o.sinks = first_row(f.arg(i++, "sinks", 1), rows);
  if (first_ret >= 0) {
    int64_t r = first_ret;
    if (has_bias) o.dbias = f.ret(r++, "dbias", 3);
    if (has_sinks) o.dsinks = first_row(f.ret(r++, "dsinks", 1), rows);
    if (dsinks_rows != nullptr) *dsinks_rows = has_sinks ? rows : 0;
  }
  o.dropout_p = static_cast<float>(f.real_or("dropout_p", 0.0));
  o.offset = static_cast<uint64_t>(f.integer_or("offset", 0));
  o.dropout_nheads_total = f.integer_or("dropout_nheads_total", 0);
  if (o.dropout_p != 0.0f) read_seed(f, i++, o);
}

// After a backward that wrote dsinks into row 0 of a (rows, nheads) buffer: the other rows get
// zeros, so that the sum over the rows (the transpose of the broadcast) is dSinks. Only the CPU
// runs sinks (the core refuses them on CUDA before anything is written).
void zero_other_rows(const Frame& f, const Options& o, int64_t rows) {
  if (rows <= 1 || f.on_cuda()) return;
  const int64_t h = o.dsinks.shape[0];
  std::memset(static_cast<float*>(o.dsinks.data) + h, 0,
              static_cast<size_t>((rows - 1) * h) * sizeof(float));
}

Options options_of(const Frame& f, bool backward) {
  Options o;
  o.causal = f.flag("causal");
  o.softmax_scale = f.real("softmax_scale");  // NaN: 1/sqrt(headdim)
  o.window_left = f.integer("window_left");
  o.window_right = f.integer("window_right");
  o.schedule = parse_schedule(f.text("schedule"));
  o.softcap = f.real("softcap");
  if (backward) o.deterministic = f.flag("deterministic");
  o.stream = f.stream();
  return o;
}

void attention_fwd(const Frame& f) {
  Options o = options_of(f, false);
  optional_args(f, 3, o);
  flashdl::forward(f.arg(0, "q", 3), f.arg(1, "k", 3), f.arg(2, "v", 3), f.ret(0, "out", 3),
                   f.ret(1, "lse", 2), o);
}

void attention_bwd(const Frame& f) {
  Options o = options_of(f, true);
  int64_t rows = 0;
  optional_args(f, 6, o, 3, &rows);
  flashdl::backward(f.arg(0, "dout", 3), f.arg(1, "q", 3), f.arg(2, "k", 3), f.arg(3, "v", 3),
                    f.arg(4, "out", 3), f.arg(5, "lse", 2), f.ret(0, "dq", 3), f.ret(1, "dk", 3),
                    f.ret(2, "dv", 3), o);
  zero_other_rows(f, o, rows);
}

// Attention over a KV cache. Arguments q, k_cache, v_cache, cache_seqlens, then k_new, v_new
// (has_new), block_table (has_block_table), alibi_slopes (has_alibi), rotary_cos, rotary_sin
// (has_rotary; rotary_interleaved), cache_batch_idx (has_batch_idx), cache_leftpad (has_leftpad)
// -- each attribute only sent when set, so plain calls keep their HLO; results out, lse, and with
// has_new the updated k_cache, v_cache, which alias the argument caches (input_output_aliases):
// the append writes them in place. Should XLA hand over distinct buffers, the CPU handler copies
// the caches first, so the arguments are never written.
// A KV-cache table (cache_seqlens, block_table, cache_batch_idx, cache_leftpad: int32, read on
// the host by the core) as a host view: on CUDA its bytes are copied into `store` on the call's
// stream, which is then synchronised (as for the dropout seed). 4 * batch bytes per table,
// 4 * batch * max_pages for block_table; the first copy waits for the work queued before.
TensorView host_table(const Frame& f, const TensorView& t, std::vector<int32_t>& store,
                      const char* name) {
  if (!f.on_cuda() || !t.defined()) return t;
  if (t.dtype != DType::int32) fail(ErrorKind::type, std::string(name) + ": expected int32");
  store.resize(static_cast<size_t>(t.numel()));
  copy_to_host(store.data(), t, f.stream(), name);
  TensorView h = t;
  h.data = store.data();
  h.device = Device{};
  return h;
}

void kvcache_fwd(const Frame& f) {
  Options o = options_of(f, false);
  o.num_splits = f.integer_or("num_splits", 0);
  const bool has_new = f.integer_or("has_new", 0) != 0;
  TensorView kc = f.arg(1, "k_cache"), vc = f.arg(2, "v_cache"), kn{}, vn{}, bt{};
  int64_t i = 4;
  if (has_new) {
    kn = f.arg(i++, "k");
    vn = f.arg(i++, "v");
  }
  std::vector<int32_t> host[4];
  if (f.integer_or("has_block_table", 0) != 0)
    bt = host_table(f, f.arg(i++, "block_table"), host[0], "block_table");
  if (f.integer_or("has_alibi", 0) != 0) o.alibi_slopes = f.arg(i++, "alibi_slopes");
  KvCacheExtras x;
  if (f.integer_or("has_rotary", 0) != 0) {
    x.rotary_cos = f.arg(i++, "rotary_cos");
    x.rotary_sin = f.arg(i++, "rotary_sin");
    x.rotary_interleaved = f.integer_or("rotary_interleaved", 0) != 0;
  }
  if (f.integer_or("has_batch_idx", 0) != 0)
    x.cache_batch_idx = host_table(f, f.arg(i++, "cache_batch_idx"), host[1], "cache_batch_idx");
  if (f.integer_or("has_leftpad", 0) != 0)
    x.cache_leftpad = host_table(f, f.arg(i++, "cache_leftpad"), host[2], "cache_leftpad");
  // Sinks (nheads,), bias and mask (rank 4, size-1 axes broadcast): operands only when given.
  if (f.integer_or("has_sinks", 0) != 0) o.sinks = f.arg(i++, "sinks");
  if (f.integer_or("has_bias", 0) != 0) o.bias = f.arg(i++, "bias");
  if (f.integer_or("has_mask", 0) != 0) o.mask = f.arg(i++, "mask");
  if (has_new) {
    if (f.nrets() < 4)
      fail(ErrorKind::value,
           "k_cache: appending needs the updated caches as results 2 and 3 (the "
           "call has " +
               std::to_string(f.nrets()) + " results)");
    for (int j = 0; j < 2; ++j) {
      const Buffer* in = f.raw_arg(1 + j);
      const Buffer* out = f.raw_ret(2 + j);
      if (in->data == out->data) continue;
      if (f.on_cuda())
        fail(ErrorKind::unsupported, std::string(j ? "v_cache" : "k_cache") +
                                         ": XLA did not alias the updated cache with the argument");
      const TensorView t = f.arg(1 + j, j ? "v_cache" : "k_cache");
      std::memcpy(out->data, in->data, static_cast<size_t>(t.numel()) * dtype_size(t.dtype));
    }
    kc = f.ret(2, "k_cache");
    vc = f.ret(3, "v_cache");
  }
  const TensorView seqlens = host_table(f, f.arg(3, "cache_seqlens"), host[3], "cache_seqlens");
  flashdl::forward_kvcache(f.arg(0, "q"), kc, vc, seqlens, kn, vn, bt, f.ret(0, "out"),
                           f.ret(1, "lse"), o, x);
}

// merge_states: arguments outs[0..n), lses[0..n) (n = half the arguments); results out, lse.
// Leading axes fold into the batch as in the dense targets (jax.vmap's broadcast_all).
void merge_fwd(const Frame& f) {
  const int64_t n = f.nargs() / 2;
  std::vector<TensorView> outs, lses;
  for (int64_t i = 0; i < n; ++i) {
    outs.push_back(f.arg(i, ("outs[" + std::to_string(i) + "]").c_str(), 3));
    lses.push_back(f.arg(n + i, ("lses[" + std::to_string(i) + "]").c_str(), 2));
  }
  flashdl::merge_states(outs, lses, f.ret(0, "out", 3), f.ret(1, "lse", 2), f.stream());
}

void varlen_fwd(const Frame& f) {
  Options o = options_of(f, false);
  optional_args(f, 5, o);
  flashdl::forward_varlen(f.arg(0, "q"), f.arg(1, "k"), f.arg(2, "v"), f.arg(3, "cu_seqlens_q"),
                          f.arg(4, "cu_seqlens_k"), f.integer("max_seqlen_q"),
                          f.integer("max_seqlen_k"), f.ret(0, "out"), f.ret(1, "lse"), o);
}

void varlen_bwd(const Frame& f) {
  Options o = options_of(f, true);
  optional_args(f, 8, o, 3);
  flashdl::backward_varlen(f.arg(0, "dout"), f.arg(1, "q"), f.arg(2, "k"), f.arg(3, "v"),
                           f.arg(4, "out"), f.arg(5, "lse"), f.arg(6, "cu_seqlens_q"),
                           f.arg(7, "cu_seqlens_k"), f.integer("max_seqlen_q"),
                           f.integer("max_seqlen_k"), f.ret(0, "dq"), f.ret(1, "dk"),
                           f.ret(2, "dv"), o);
}

FfiError* make_error(const CallFrame* cf, ErrorCode code, const char* msg) {
  ErrorCreateArgs args{kErrorCreateArgsSize, nullptr, msg, code};
  return cf->api->error_create(&args);
}

// Every handler: answer XLA's registration-time metadata query, check the frame, run, and turn
// the core's exceptions into XLA errors (no exception crosses the C ABI).
template <void (*Run)(const Frame&), Platform P>
FfiError* handle(CallFrame* cf) {
  if (cf->extension_start != nullptr && cf->extension_start->type == kExtensionMetadata) {
    auto* ext = reinterpret_cast<MetadataExtension*>(cf->extension_start);
    if (ext->extension_base.struct_size >= kMetadataExtensionSize &&
        ext->metadata->struct_size >= kMetadataSize) {
      ext->metadata->api_version = ApiVersion{kApiVersionSize, nullptr, kApiMajor, kApiMinor};
      ext->metadata->traits = 0;
    }
    return nullptr;  // a metadata left unfilled (version 0.0) makes XLA refuse the handler
  }
  if (cf->struct_size < kCallFrameSize)
    return make_error(cf, kInvalidArgument, "flashdl: XLA's call frame is older than FFI 0.1");
  if (cf->stage != kExecute) return nullptr;  // only the execute stage does work
  try {
    Run(Frame(cf, P));
    return nullptr;
  } catch (const flashdl::Error& e) {
    const ErrorCode code = e.kind() == ErrorKind::unsupported ? kUnimplemented
                           : e.kind() == ErrorKind::runtime   ? kInternal
                                                              : kInvalidArgument;
    return make_error(cf, code, e.what());
  } catch (const std::exception& e) {
    return make_error(cf, kInternal, e.what());
  }
}

}  // namespace

std::vector<Target> targets() {
  std::vector<Target> t = {
      {"flashdl_attention_fwd", "cpu", handle<attention_fwd, Platform::cpu>},
      {"flashdl_attention_bwd", "cpu", handle<attention_bwd, Platform::cpu>},
      {"flashdl_attention_varlen_fwd", "cpu", handle<varlen_fwd, Platform::cpu>},
      {"flashdl_attention_varlen_bwd", "cpu", handle<varlen_bwd, Platform::cpu>},
      {"flashdl_attention_kvcache", "cpu", handle<kvcache_fwd, Platform::cpu>},
      {"flashdl_merge_states", "cpu", handle<merge_fwd, Platform::cpu>},
  };
  if (build_info().cuda_compiled) {
    t.push_back({"flashdl_attention_fwd", "CUDA", handle<attention_fwd, Platform::cuda>});
    t.push_back({"flashdl_attention_bwd", "CUDA", handle<attention_bwd, Platform::cuda>});
    t.push_back({"flashdl_attention_varlen_fwd", "CUDA", handle<varlen_fwd, Platform::cuda>});
    t.push_back({"flashdl_attention_varlen_bwd", "CUDA", handle<varlen_bwd, Platform::cuda>});
    t.push_back({"flashdl_attention_kvcache", "CUDA", handle<kvcache_fwd, Platform::cuda>});
    t.push_back({"flashdl_merge_states", "CUDA", handle<merge_fwd, Platform::cuda>});
  }
  return t;
}

}  // namespace flashdl::xla_ffi
