// Validation of the attention entry points' arguments and options, and nothing else: Params are
// filled in fill_params.cpp and dispatched in dispatch.cpp, after these checks have passed.
#include "validate.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

namespace flashdl::validate {

namespace {

constexpr double kMaxScale = 1e30;

bool is_float_storage(DType d) {
  return d == DType::float16 || d == DType::bfloat16 || d == DType::float32 || d == DType::float64;
}

}  // namespace

// The dropout slice options (Options::dropout_batch_offset and its siblings). With dropout, the
// stream key of the last plane, (batch - 1 + batch offset) * nheads_total + nheads_total - 1,
// must stay below 2^32 (Philox's counter word, philox.hpp), so no two planes share a draw.
static void check_dropout_slice(const Options& o, const Shapes& s) {
  constexpr int64_t kLimit = int64_t{1} << 32;
  if (o.dropout_batch_offset < 0 || o.dropout_batch_offset >= kLimit)
    fail(ErrorKind::value, "dropout_batch_offset: expected 0 <= offset < 2^32, got " +
                               std::to_string(o.dropout_batch_offset));
  if (o.dropout_head_offset < 0 || o.dropout_head_offset >= kLimit)
    fail(ErrorKind::value, "dropout_head_offset: expected 0 <= offset < 2^32, got " +
                               std::to_string(o.dropout_head_offset));
  if (o.dropout_nheads_total < 0 || o.dropout_nheads_total >= kLimit)
    fail(ErrorKind::value,
         "dropout_nheads_total: expected 0 (the nheads of q) or a head count "
         "below 2^32, got " +
             std::to_string(o.dropout_nheads_total));
  const int64_t total = o.dropout_nheads_total == 0 ? s.nheads : o.dropout_nheads_total;
  if (o.dropout_head_offset + s.nheads > total)
    fail(ErrorKind::value,
         "dropout_nheads_total: expected at least dropout_head_offset + nheads = " +
             std::to_string(o.dropout_head_offset) + " + " + std::to_string(s.nheads) + " = " +
             std::to_string(o.dropout_head_offset + s.nheads) + " heads, got " +
             std::to_string(total) + (o.dropout_nheads_total == 0 ? " (0: the nheads of q)" : ""));
  // Both factors are below 2^32 here, so the product is checked without overflow by division.
  // Only with dropout: a call without it draws nothing, whatever its extents.
  const int64_t batches = o.dropout_batch_offset + s.batch;
  if (o.dropout_p > 0.0f && total > 0 && batches > kLimit / total)
    fail(ErrorKind::value,
         "dropout_batch_offset: (dropout_batch_offset + batch) * "
         "dropout_nheads_total = " +
             std::to_string(batches) + " * " + std::to_string(total) +
             " dropout planes exceed the 2^32 of the dropout stream");
}

// Checks q, k, v, out, lse and the options; returns the problem's extents.
Shapes check_attention_args(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const TensorView& lse, const Options& o) {
  const char* qlay = "(batch, seqlen_q, nheads, headdim)";
  const char* klay = "(batch, seqlen_k, nheads_kv, headdim)";
  check_rank("q", q, 4, qlay);
  check_rank("k", k, 4, klay);
  check_rank("v", v, 4, klay);
  check_rank("out", out, 4, qlay);
  check_rank("lse", lse, 3, "(batch, nheads, seqlen_q)");

  if (!is_float_storage(q.dtype))
    fail(ErrorKind::type,
         std::string("q: expected dtype float16, bfloat16, float32 or float64, got ") +
             dtype_name(q.dtype));
  for (auto [name, t] : {NamedView{"k", &k}, {"v", &v}, {"out", &out}})
    check_storage(name, *t, q.dtype, "the dtype of q", q.device);
  check_storage("lse", lse, DType::float32, "lse is always float32", q.device);
  check_last_dim_contiguous("q", q);

  Shapes s{q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]};
  if (k.shape[0] != s.batch)
    fail(ErrorKind::value, "k: batch " + std::to_string(k.shape[0]) +
                               " does not match the batch of q, " + std::to_string(s.batch));
  if (k.shape[3] != s.headdim)
    fail(ErrorKind::value, "k: headdim " + std::to_string(k.shape[3]) +
                               " does not match the headdim of q, " + std::to_string(s.headdim));
  check_shape("v", v, {s.batch, s.seqlen_k, s.nheads_kv, s.headdim}, "(the shape of k)");
  check_shape("out", out, {s.batch, s.seqlen_q, s.nheads, s.headdim}, "(the shape of q)");
  check_shape("lse", lse, {s.batch, s.nheads, s.seqlen_q}, "(batch, nheads, seqlen_q)");

  if (s.nheads_kv == 0 ? s.nheads != 0 : s.nheads % s.nheads_kv != 0)
    fail(ErrorKind::value, "k: nheads_kv " + std::to_string(s.nheads_kv) +
                               " must divide nheads of q, " + std::to_string(s.nheads));

  const bool on_cuda = q.device.type == DeviceType::cuda;
  if (on_cuda) {
    if (q.dtype != DType::float16 && q.dtype != DType::bfloat16)
      fail(ErrorKind::type, std::string("q: the CUDA backend takes float16 or bfloat16, got ") +
                                dtype_name(q.dtype));
    const int64_t d = s.headdim;
    if (d != 32 && d != 64 && d != 96 && d != 128 && d != 192 && d != 256)
      fail(ErrorKind::value, "q: the CUDA backend takes headdim 32, 64, 96, 128, 192 or 256, got " +
                                 std::to_string(d));
  } else if (s.headdim < 1 || s.headdim > 256) {
    fail(ErrorKind::value, "q: headdim must be in 1..256, got " + std::to_string(s.headdim));
  }

  for (auto [name, t] : {NamedView{"q", &q}, {"k", &k}, {"v", &v}}) {
    check_no_overlap("out", out, name, *t);
    check_no_overlap("lse", lse, name, *t);
  }
  check_no_overlap("lse", lse, "out", out);
  // validate_only calls (flashdl.jax's trace-time checks) pass stand-ins of stride 0 for the
  // outputs XLA allocates itself: nothing is written through them.
  if (!o.validate_only) {
    check_no_self_overlap("out", out);
    check_no_self_overlap("lse", lse);
  }

  // Scores are carried in float32 (scale * log2(e) among them): 1e30 keeps that factor finite
  // and leaves room for |q.k| up to 1e8 before a score overflows.
  if (std::isnan(o.softmax_scale)) {
    // None: 1 / sqrt(headdim)
  } else if (!(std::fabs(o.softmax_scale) <= kMaxScale)) {
    fail(ErrorKind::value,
         "softmax_scale: expected a finite number of magnitude <= 1e30 or "
         "None, got " +
             num_str(o.softmax_scale));
  }
  if (o.window_left < -1 || o.window_right < -1)
    fail(ErrorKind::value,
         "window_size: expected (left, right) with each >= 0 or -1 for "
         "unbounded, got (" +
             std::to_string(o.window_left) + ", " + std::to_string(o.window_right) + ")");
  if (!(o.dropout_p >= 0.0f && o.dropout_p < 1.0f))
    fail(ErrorKind::value,
         "dropout_p: expected a probability in [0, 1), got " + num_str(o.dropout_p));
  if (o.offset >= (uint64_t{1} << 32))
    fail(ErrorKind::value,
         "offset: expected a dropout stream offset below 2^32, got " + std::to_string(o.offset));
  check_dropout_slice(o, s);
  if (o.sram_bytes < 0)
    fail(ErrorKind::value,
         "sram_bytes: expected >= 0 (0: from the device), got " + std::to_string(o.sram_bytes));
  if (o.num_threads < 0)
    fail(ErrorKind::value,
         "num_threads: expected >= 0 (0: default), got " + std::to_string(o.num_threads));
  switch (o.schedule) {
    case Schedule::automatic:
    case Schedule::fa1:
    case Schedule::fa2:
    case Schedule::reference: break;
    default:
      fail(ErrorKind::value, "schedule: expected auto, fa1, fa2 or reference, got code " +
                                 std::to_string(static_cast<int>(o.schedule)));
  }
  if (on_cuda && o.schedule == Schedule::reference)
    fail(ErrorKind::unsupported,
         "schedule: 'reference' runs on the CPU only (float64 oracle); "
         "copy the arrays to the CPU to use it");
  return s;
}

void check_block_mask(const Options& o, const Shapes& s, Device device,
                      std::initializer_list<NamedView> outputs) {
  if (o.block_size_q < 1 || o.block_size_k < 1)
    fail(ErrorKind::value, "block_size: expected block sizes >= 1, got (" +
                               std::to_string(o.block_size_q) + ", " +
                               std::to_string(o.block_size_k) + ")");
  const TensorView& m = o.block_mask;
  if (!m.defined()) return;
  const char* layout = "(nblocks_q, nblocks_k) or (batch or 1, nheads or 1, nblocks_q, nblocks_k)";
  check_defined("block_mask", m);
  if (m.rank != 2 && m.rank != 4)
    fail(ErrorKind::value,
         std::string("block_mask: expected rank 2 or 4 ") + layout + ", got shape " + shape_str(m));
  check_dtype("block_mask", m, DType::boolean, "one flag per block");
  check_device("block_mask", m, device);
  // ceil(n / block) without n + block - 1, which overflows for blocks near 2^63.
  auto nblocks = [](int64_t n, int64_t block) { return n == 0 ? 0 : 1 + (n - 1) / block; };
  const int64_t nbq = nblocks(s.seqlen_q, o.block_size_q);
  const int64_t nbk = nblocks(s.seqlen_k, o.block_size_k);
  const int64_t* n = m.shape.data();
  const bool blocks_ok = n[m.rank - 2] == nbq && n[m.rank - 1] == nbk;
  const bool lead_ok = m.rank == 2 ||
                       ((n[0] == 1 || n[0] == s.batch) && (n[1] == 1 || n[1] == s.nheads));
  if (!blocks_ok || !lead_ok)
    fail(ErrorKind::value,
         "block_mask: expected shape " + shape_str({nbq, nbk}) + " or " +
             shape_str({s.batch, s.nheads, nbq, nbk}) + " (size 1 broadcasts batch or heads): " +
             "ceil(seqlen / block_size) blocks for seqlen_q " + std::to_string(s.seqlen_q) +
             ", seqlen_k " + std::to_string(s.seqlen_k) + " and block_size (" +
             std::to_string(o.block_size_q) + ", " + std::to_string(o.block_size_k) + "), got " +
             shape_str(m));
  check_last_dim_contiguous("block_mask", m);
  for (auto [name, t] : outputs) check_no_overlap(name, *t, "block_mask", m);
}

void check_score_mods(const Options& o, const Shapes& s, Device device,
                      std::initializer_list<NamedView> outputs) {
  // The float kernels carry softcap * log2(e), scale / softcap and slope * log2(e) in float32:
  // [1e-30, 1e30] keeps softcap * log2(e) finite and normal (a cap of 1e30 is no cap at all, one
  // of 1e-30 flattens every score to within 1e-30 of 0), and scale / softcap, which may then
  // exceed float32, is clamped to its largest finite value (detail::score_mod_of), where tanh is
  // already +-1 for every product q.k a float32 holds as a normal number.
  constexpr double kMaxMod = 1e30, kMinCap = 1e-30;
  if (!(o.softcap == 0.0 || (o.softcap >= kMinCap && o.softcap <= kMaxMod)))
    fail(ErrorKind::value,
         "softcap: expected 0 (off) or a number in [1e-30, 1e30], got " + num_str(o.softcap));
  const TensorView& a = o.alibi_slopes;
  if (!a.defined()) return;
  check_defined("alibi_slopes", a);
  const bool shape_ok = (a.rank == 1 && a.shape[0] == s.nheads) ||
                        (a.rank == 2 && a.shape[0] == s.batch && a.shape[1] == s.nheads);
  if (!shape_ok)
    fail(ErrorKind::value, "alibi_slopes: expected shape " + shape_str({s.nheads}) + " or " +
                               shape_str({s.batch, s.nheads}) +
                               " ((nheads,) or (batch, nheads)), got " + shape_str(a));
  check_dtype("alibi_slopes", a, DType::float32, "ALiBi slopes are float32, as in flash-attn");
  check_device("alibi_slopes", a, device);
  check_last_dim_contiguous("alibi_slopes", a);
  for (auto [name, t] : outputs) check_no_overlap(name, *t, "alibi_slopes", a);
  // Host slopes are read here; device ones are not (that would cost a synchronisation).
  if (device.type == DeviceType::cpu && a.numel() > 0) {
    const auto* base = static_cast<const float*>(a.data);
    const int64_t rows = a.rank == 2 ? a.shape[0] : 1, row_stride = a.rank == 2 ? a.strides[0] : 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < s.nheads; ++h) {
        // Compared in float32, the slopes' own type: float32(1e30) is the limit itself, though
        // it exceeds 1e30 as a double (1.0000000150474662e30).
        const float x = base[r * row_stride + h * a.strides[a.rank - 1]];
        if (!(std::fabs(x) <= static_cast<float>(kMaxMod)))
          fail(ErrorKind::value,
               "alibi_slopes: expected finite slopes of at most 1e30 in "
               "magnitude, got " +
                   num_str(x) + " at " + (a.rank == 2 ? "[" + std::to_string(r) + ", " : "[") +
                   std::to_string(h) + "]");
      }
  }
}

// A float32 (nheads,) array of the problem's device: the sinks, or (written) their gradient.
static void check_per_head(const char* name, const TensorView& t, const Shapes& s, Device device) {
  check_defined(name, t);
  if (!(t.rank == 1 && t.shape[0] == s.nheads))
    fail(ErrorKind::value, std::string(name) + ": expected shape " + shape_str({s.nheads}) +
                               " (nheads,), one per query head, got " + shape_str(t));
  check_dtype(name, t, DType::float32, "one float32 logit per query head");
  check_device(name, t, device);
}

// The extents a bias or mask must broadcast to: dense (batch, nheads, seqlen_q, seqlen_k), or
// varlen (nheads, total_q, max_seqlen_k).
struct ExtraExtents {
  int rank;
  int64_t ext[4];
  const char* layout;
};

static ExtraExtents extra_extents(const Shapes& s, int64_t varlen_total_q) {
  if (varlen_total_q >= 0)
    return {3,
            {s.nheads, varlen_total_q, s.seqlen_k, 0},
            "(nheads or 1, total_q or 1, max_seqlen_k)"};
  return {4,
          {s.batch, s.nheads, s.seqlen_q, s.seqlen_k},
          "(batch or 1, nheads or 1, seqlen_q or 1, seqlen_k)"};
}

// A bias or mask: rank, every leading axis 1 (or of stride 0) or the problem's extent, the key axis
// the problem's, on `device`.
static void check_broadcastable(const char* name, const TensorView& t, const ExtraExtents& x,
                                Device device) {
  check_defined(name, t);
  const std::string want = x.rank == 4 ? shape_str({x.ext[0], x.ext[1], x.ext[2], x.ext[3]})
                                       : shape_str({x.ext[0], x.ext[1], x.ext[2]});
  bool ok = t.rank == x.rank;
  for (int a = 0; ok && a < x.rank; ++a) {
    const bool last = a == x.rank - 1;
    ok = t.shape[a] == x.ext[a] || (!last && t.shape[a] == 1);
  }
  if (!ok)
    fail(ErrorKind::value, std::string(name) + ": expected a shape broadcastable to " + want + " " +
                               x.layout + ", got " + shape_str(t));
  check_device(name, t, device);
}

void check_extras(const Options& o, const Shapes& s, Device device,
                  std::initializer_list<NamedView> outputs, int64_t varlen_total_q) {
  const ExtraExtents x = extra_extents(s, varlen_total_q);
  if (o.bias.defined()) {
    check_broadcastable("bias", o.bias, x, device);
    if (!(o.bias.dtype == DType::float32 || o.bias.dtype == DType::float16 ||
          o.bias.dtype == DType::bfloat16 || o.bias.dtype == DType::float64))
      fail(ErrorKind::type, std::string("bias: expected dtype float32, float16 or bfloat16 (an "
                                        "additive float bias), got ") +
                                dtype_name(o.bias.dtype));
    for (auto [name, t] : outputs) check_no_overlap(name, *t, "bias", o.bias);
  }
  if (o.mask.defined()) {
    check_broadcastable("mask", o.mask, x, device);
    check_dtype("mask", o.mask, DType::boolean, "a boolean mask, True = keep");
    for (auto [name, t] : outputs) check_no_overlap(name, *t, "mask", o.mask);
  }
  if (o.dbias.defined()) {
    if (!o.bias.defined())
      fail(ErrorKind::value, "dbias: given without bias; expected bias (the forward's) too");
    check_defined("dbias", o.dbias);
    if (o.dbias.rank != o.bias.rank ||
        !std::equal(o.dbias.shape.begin(), o.dbias.shape.begin() + o.bias.rank,
                    o.bias.shape.begin()))
      fail(ErrorKind::value, "dbias: expected the shape of bias, " + shape_str(o.bias) + ", got " +
                                 shape_str(o.dbias));
    check_dtype("dbias", o.dbias, o.bias.dtype, "the dtype of bias");
    check_device("dbias", o.dbias, device);
    for (int a = 0; a + 1 < o.bias.rank; ++a)
      if (o.bias.shape[a] > 1 && o.bias.strides[a] == 0)
        fail(ErrorKind::value, "bias: a stride of 0 along axis " + std::to_string(a) + " (size " +
                                   std::to_string(o.bias.shape[a]) +
                                   ") in a backward that "
                                   "returns dbias; expected a size-1 axis there, which dbias "
                                   "sums into");
    check_no_overlap("dbias", o.dbias, "bias", o.bias);
    if (o.mask.defined()) check_no_overlap("dbias", o.dbias, "mask", o.mask);
    for (auto [name, t] : outputs) check_no_overlap("dbias", o.dbias, name, *t);
    if (!o.validate_only) check_no_self_overlap("dbias", o.dbias);
  }
  if (o.sinks.defined()) {
    check_per_head("sinks", o.sinks, s, device);
    for (auto [name, t] : outputs) check_no_overlap(name, *t, "sinks", o.sinks);
    // Host sinks are read here; device ones are not (that would cost a synchronisation).
    const auto* base = static_cast<const float*>(o.sinks.data);
    for (int64_t h = 0; device.type == DeviceType::cpu && h < s.nheads; ++h) {
      const float x = base[h * o.sinks.strides[0]];
      if (!std::isfinite(x))
        fail(ErrorKind::value, "sinks: expected finite logits, got " + num_str(x) + " at [" +
                                   std::to_string(h) + "]");
    }
  }
  if (o.dsinks.defined()) {
    if (!o.sinks.defined())
      fail(ErrorKind::value, "dsinks: given without sinks; expected sinks (the forward's) too");
    check_per_head("dsinks", o.dsinks, s, device);
    check_no_overlap("dsinks", o.dsinks, "sinks", o.sinks);
    for (auto [name, t] : outputs) check_no_overlap("dsinks", o.dsinks, name, *t);
    if (o.dbias.defined()) check_no_overlap("dsinks", o.dsinks, "dbias", o.dbias);
    if (!o.validate_only) check_no_self_overlap("dsinks", o.dsinks);
  }
}

// The backward's checks beyond check_attention_args: dout, dq, dk, dv.
Shapes check_backward_args(const TensorView& dout, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& out, const TensorView& lse,
                           const TensorView& dq, const TensorView& dk, const TensorView& dv,
                           const Options& options) {
  const Shapes s = check_attention_args(q, k, v, out, lse, options);
  const char* qlay = "(batch, seqlen_q, nheads, headdim)";
  const char* klay = "(batch, seqlen_k, nheads_kv, headdim)";
  check_rank("dout", dout, 4, qlay);
  check_rank("dq", dq, 4, qlay);
  check_rank("dk", dk, 4, klay);
  check_rank("dv", dv, 4, klay);
  for (auto [name, t] : {NamedView{"dout", &dout}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}})
    check_storage(name, *t, q.dtype, "the dtype of q", q.device);
  check_shape("dout", dout, {s.batch, s.seqlen_q, s.nheads, s.headdim}, "(the shape of q)");
  check_shape("dq", dq, {s.batch, s.seqlen_q, s.nheads, s.headdim}, "(the shape of q)");
  check_shape("dk", dk, {s.batch, s.seqlen_k, s.nheads_kv, s.headdim}, "(the shape of k)");
  check_shape("dv", dv, {s.batch, s.seqlen_k, s.nheads_kv, s.headdim}, "(the shape of v)");
  const NamedView inputs[] = {{"dout", &dout}, {"q", &q},     {"k", &k},
                              {"v", &v},       {"out", &out}, {"lse", &lse}};
  const NamedView grads[] = {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}};
  for (auto [gname, g] : grads)
    for (auto [iname, in] : inputs) check_no_overlap(gname, *g, iname, *in);
  check_no_overlap("dq", dq, "dk", dk);
  check_no_overlap("dq", dq, "dv", dv);
  check_no_overlap("dk", dk, "dv", dv);
  if (!options.validate_only)
    for (auto [gname, g] : grads) check_no_self_overlap(gname, *g);

  return s;
}

}  // namespace flashdl::validate
