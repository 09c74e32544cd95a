// Validation (the only place) and the filling of Params from validated views.
#include "validate.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "backend.hpp"

namespace flashdl::validate {

namespace {

// Byte range [lo, hi) the view can touch; empty views touch nothing.
struct Extent {
  uintptr_t lo = 0, hi = 0;
};

Extent extent(const TensorView& t) {
  if (t.numel() == 0 || t.data == nullptr) return {};
  const auto base = reinterpret_cast<intptr_t>(t.data);
  const auto es = static_cast<intptr_t>(dtype_size(t.dtype));
  intptr_t lo = base, hi = base;
  for (int i = 0; i < t.rank; ++i) {
    const intptr_t span = static_cast<intptr_t>(t.strides[i]) * (t.shape[i] - 1) * es;
    (span < 0 ? lo : hi) += span;
  }
  return {static_cast<uintptr_t>(lo), static_cast<uintptr_t>(hi + es)};
}

constexpr double kMaxScale = 1e30;

bool is_float_storage(DType d) {
  return d == DType::float16 || d == DType::bfloat16 || d == DType::float32 ||
         d == DType::float64;
}

}  // namespace

// Plain string arithmetic, no iostreams: with an ostringstream here, every error message that
// printed a shape killed the Python process (SIGSEGV) on the H100 machine, in pytest workers that
// had also loaded torch, CuPy and JAX.
std::string shape_str(const TensorView& t) {
  std::string s = "(";
  for (int i = 0; i < t.rank; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  s += t.rank == 1 ? ",)" : ")";
  return s;
}

std::string shape_str(std::initializer_list<int64_t> shape) {
  TensorView t;
  t.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  return shape_str(t);
}

// std::to_chars without a precision writes the shortest text that reads back to the same value,
// so a dropout_p of 1.5 prints as "1.5" (std::to_string gives "1.500000", and 1e-9 as "0.000000").
// A float prints as the shortest float text: the 0.3 a caller wrote, not 0.300000012.
template <typename T>
static std::string shortest(T x) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

std::string num_str(double x) { return shortest(x); }
std::string num_str(float x) { return shortest(x); }

[[noreturn]] void fail(ErrorKind kind, const std::string& msg) { throw Error(kind, msg); }

void check_defined(const char* name, const TensorView& t) {
  if (t.rank <= 0 || t.rank > kMaxRank)
    fail(ErrorKind::value, std::string(name) + ": expected an array of rank 1 to 4, got rank " +
                               std::to_string(t.rank));
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] < 0)
      fail(ErrorKind::value, std::string(name) + ": negative extent in shape " + shape_str(t));
  if (t.data == nullptr && t.numel() > 0)
    fail(ErrorKind::value, std::string(name) + ": null data pointer for a non-empty array");
}

void check_rank(const char* name, const TensorView& t, int rank, const char* layout) {
  check_defined(name, t);
  if (t.rank != rank)
    fail(ErrorKind::value, std::string(name) + ": expected rank " + std::to_string(rank) + " " +
                               layout + ", got shape " + shape_str(t));
}

void check_shape(const char* name, const TensorView& t, std::initializer_list<int64_t> shape,
                 const char* layout) {
  int i = 0;
  bool ok = t.rank == static_cast<int>(shape.size());
  for (int64_t s : shape) ok = ok && t.shape[i++] == s;
  if (!ok)
    fail(ErrorKind::value, std::string(name) + ": expected shape " + shape_str(shape) + " " +
                               layout + ", got " + shape_str(t));
}

void check_dtype(const char* name, const TensorView& t, DType expected, const char* why) {
  if (t.dtype != expected)
    fail(ErrorKind::type, std::string(name) + ": expected dtype " + dtype_name(expected) + " (" +
                              why + "), got " + dtype_name(t.dtype));
}

void check_host_int32(const char* name, const TensorView& t, int rank, const char* layout) {
  check_rank(name, t, rank, layout);
  check_dtype(name, t, DType::int32, "indices and lengths are int32");
  if (t.device.type != DeviceType::cpu)
    fail(ErrorKind::value, std::string(name) + ": expected an array on the CPU (host memory), got " +
                               device_name(t.device.type) + ":" + std::to_string(t.device.id));
}

void check_device(const char* name, const TensorView& t, Device expected) {
  if (t.device != expected)
    fail(ErrorKind::value, std::string(name) + ": expected an array on " +
                               device_name(expected.type) + ":" + std::to_string(expected.id) +
                               " (the device of q), got " + device_name(t.device.type) + ":" +
                               std::to_string(t.device.id));
}

void check_last_dim_contiguous(const char* name, const TensorView& t) {
  const int last = t.rank - 1;
  // Empty arrays hold no element to reach, and exporters give them arbitrary (often 0) strides.
  if (t.numel() > 0 && t.shape[last] > 1 && t.strides[last] != 1)
    fail(ErrorKind::value, std::string(name) + ": the last dimension must be contiguous (stride 1), "
                               "got stride " + std::to_string(t.strides[last]));
}

namespace {

// Whether no two distinct indices of t address overlapping bytes, by a sufficient condition that
// holds for every view made by slicing (with steps), transposing or selecting from a contiguous
// array: the axes of extent > 1, sorted by |stride|, each have a stride (in bytes) at least the
// span of all smaller axes (element size plus sum of |stride| x (extent - 1)). A stride of 0 on an
// axis of extent > 1 (an expanded array) fails it and does overlap; other failures may not
// (strides such as (2, 3) for shape (3, 2) interleave without a collision) but are refused too.
// An axis of extent > 1 as the overlap checks see it: |stride| in bytes and extent.
struct Axis {
  __int128 stride, extent;
};

// Whether the n axes, sorted by stride, each stride at least the span of all smaller axes
// (starting from the element size es): then no two elements share a byte. At most kMaxRank + 1
// axes: an insertion sort (std::sort's threshold path drew GCC 12 -Warray-bounds false
// positives over the five-element array).
bool axes_never_collide(Axis* axes, int n, __int128 es) {
  for (int i = 1; i < n; ++i)
    for (int j = i; j > 0 && axes[j].stride < axes[j - 1].stride; --j)
      std::swap(axes[j], axes[j - 1]);
  __int128 span = es;
  for (int i = 0; i < n; ++i) {
    if (axes[i].stride < span) return false;
    span += axes[i].stride * (axes[i].extent - 1);
  }
  return true;
}

bool provably_no_self_overlap(const TensorView& t, int64_t& zero_axis) {
  zero_axis = -1;
  if (t.numel() == 0) return true;
  Axis axes[kMaxRank + 1];
  int n = 0;
  const __int128 es = static_cast<__int128>(dtype_size(t.dtype));
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] <= 1) continue;
    if (t.strides[i] == 0) {
      zero_axis = i;
      return false;
    }
    const __int128 st = t.strides[i] < 0 ? -static_cast<__int128>(t.strides[i]) : t.strides[i];
    axes[n++] = {st * es, t.shape[i]};
  }
  return axes_never_collide(axes, n, es);
}

// Whether a and b provably share no byte: disjoint spans, or (the interleaved views of one buffer,
// e.g. k and v sliced from a packed kv) the same shape and strides at a whole-element distance,
// where the two together are one view with a leading axis of extent 2 and stride that distance,
// proven free of self-overlap above.
bool provably_disjoint(const TensorView& a, const TensorView& b) {
  const Extent x = extent(a), y = extent(b);
  if (!(x.lo < x.hi && y.lo < y.hi && x.lo < y.hi && y.lo < x.hi)) return true;
  if (a.rank != b.rank || a.rank >= kMaxRank + 1 || dtype_size(a.dtype) != dtype_size(b.dtype))
    return false;
  for (int i = 0; i < a.rank; ++i)
    if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.strides[i] != b.strides[i])) return false;
  const auto es = static_cast<intptr_t>(dtype_size(a.dtype));
  const intptr_t delta = reinterpret_cast<intptr_t>(b.data) - reinterpret_cast<intptr_t>(a.data);
  if (delta % es != 0) return false;
  // TensorView holds kMaxRank axes: the pair is checked as a view of rank + 1 built by hand.
  Axis axes[kMaxRank + 1];
  int n = 0;
  const __int128 d = delta < 0 ? -static_cast<__int128>(delta) : delta;
  if (d == 0) return false;
  axes[n++] = {d, 2};
  for (int i = 0; i < a.rank; ++i) {
    if (a.shape[i] <= 1) continue;
    if (a.strides[i] == 0) return false;
    const __int128 st = a.strides[i] < 0 ? -static_cast<__int128>(a.strides[i]) : a.strides[i];
    axes[n++] = {st * es, a.shape[i]};
  }
  return axes_never_collide(axes, n, es);
}

}  // namespace

void check_no_overlap(const char* out_name, const TensorView& out, const char* in_name,
                      const TensorView& in) {
  if (provably_disjoint(out, in)) return;
  fail(ErrorKind::value,
       std::string(out_name) + ": output memory overlaps " + in_name +
           " (their memory spans intersect, and flashdl accepts intersecting spans only for "
           "views of the same shape and strides whose elements interleave without sharing "
           "one); flashdl never writes into an input or into one output through another, pass "
           "a separate array");
}

void check_no_self_overlap(const char* name, const TensorView& t) {
  int64_t zero_axis = -1;
  if (provably_no_self_overlap(t, zero_axis)) return;
  if (zero_axis >= 0)
    fail(ErrorKind::value, std::string(name) + ": the array is written but addresses one element "
                               "through several indices (stride 0 on axis " +
                               std::to_string(zero_axis) + " of extent " +
                               std::to_string(t.shape[zero_axis]) +
                               ", e.g. an expanded or broadcast array); pass an array with memory "
                               "of its own, such as a contiguous copy");
  std::string strides = "(";
  for (int i = 0; i < t.rank; ++i) strides += (i ? ", " : "") + std::to_string(t.strides[i]);
  strides += t.rank == 1 ? ",)" : ")";
  fail(ErrorKind::value, std::string(name) + ": the array is written, and its strides " + strides +
                             " for shape " + shape_str(t) +
                             " may address one element through two indices (flashdl writes "
                             "only views whose strides, sorted by size, each reach past the span "
                             "of the smaller axes); pass a contiguous array");
}

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
    fail(ErrorKind::value, "dropout_nheads_total: expected 0 (the nheads of q) or a head count "
                           "below 2^32, got " + std::to_string(o.dropout_nheads_total));
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
    fail(ErrorKind::value, "dropout_batch_offset: (dropout_batch_offset + batch) * "
                           "dropout_nheads_total = " + std::to_string(batches) + " * " +
                               std::to_string(total) +
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
    fail(ErrorKind::type, std::string("q: expected dtype float16, bfloat16, float32 or float64, got ") +
                              dtype_name(q.dtype));
  check_dtype("k", k, q.dtype, "the dtype of q");
  check_dtype("v", v, q.dtype, "the dtype of q");
  check_dtype("out", out, q.dtype, "the dtype of q");
  check_dtype("lse", lse, DType::float32, "lse is always float32");

  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"k", &k}, {"v", &v},
                         {"out", &out}, {"lse", &lse}})
    check_device(name, *t, q.device);

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

  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"q", &q}, {"k", &k}, {"v", &v},
                         {"out", &out}, {"lse", &lse}})
    check_last_dim_contiguous(name, *t);

  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"q", &q}, {"k", &k}, {"v", &v}}) {
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
    fail(ErrorKind::value, "softmax_scale: expected a finite number of magnitude <= 1e30 or "
                           "None, got " + num_str(o.softmax_scale));
  }
  if (o.window_left < -1 || o.window_right < -1)
    fail(ErrorKind::value, "window_size: expected (left, right) with each >= 0 or -1 for "
                           "unbounded, got (" + std::to_string(o.window_left) + ", " +
                               std::to_string(o.window_right) + ")");
  if (!(o.dropout_p >= 0.0f && o.dropout_p < 1.0f))
    fail(ErrorKind::value, "dropout_p: expected a probability in [0, 1), got " +
                               num_str(o.dropout_p));
  if (o.offset >= (uint64_t{1} << 32))
    fail(ErrorKind::value, "offset: expected a dropout stream offset below 2^32, got " +
                               std::to_string(o.offset));
  check_dropout_slice(o, s);
  if (o.sram_bytes < 0)
    fail(ErrorKind::value, "sram_bytes: expected >= 0 (0: from the device), got " +
                               std::to_string(o.sram_bytes));
  if (o.num_threads < 0)
    fail(ErrorKind::value, "num_threads: expected >= 0 (0: default), got " +
                               std::to_string(o.num_threads));
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
    fail(ErrorKind::unsupported, "schedule: 'reference' runs on the CPU only (float64 oracle); "
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
    fail(ErrorKind::value, std::string("block_mask: expected rank 2 or 4 ") + layout + ", got shape " +
                               shape_str(m));
  check_dtype("block_mask", m, DType::boolean, "one flag per block");
  check_device("block_mask", m, device);
  // ceil(n / block) without n + block - 1, which overflows for blocks near 2^63.
  auto nblocks = [](int64_t n, int64_t block) { return n == 0 ? 0 : 1 + (n - 1) / block; };
  const int64_t nbq = nblocks(s.seqlen_q, o.block_size_q);
  const int64_t nbk = nblocks(s.seqlen_k, o.block_size_k);
  const int64_t* n = m.shape.data();
  const bool blocks_ok = n[m.rank - 2] == nbq && n[m.rank - 1] == nbk;
  const bool lead_ok = m.rank == 2 || ((n[0] == 1 || n[0] == s.batch) &&
                                       (n[1] == 1 || n[1] == s.nheads));
  if (!blocks_ok || !lead_ok)
    fail(ErrorKind::value,
         "block_mask: expected shape " + shape_str({nbq, nbk}) + " or " +
             shape_str({s.batch, s.nheads, nbq, nbk}) + " (size 1 broadcasts batch or heads): " +
             "ceil(seqlen / block_size) blocks for seqlen_q " + std::to_string(s.seqlen_q) +
             ", seqlen_k " + std::to_string(s.seqlen_k) + " and block_size (" +
             std::to_string(o.block_size_q) + ", " + std::to_string(o.block_size_k) +
             "), got " + shape_str(m));
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
    fail(ErrorKind::value, "softcap: expected 0 (off) or a number in [1e-30, 1e30], got " +
                               num_str(o.softcap));
  const TensorView& a = o.alibi_slopes;
  if (!a.defined()) return;
  check_defined("alibi_slopes", a);
  const bool shape_ok = (a.rank == 1 && a.shape[0] == s.nheads) ||
                        (a.rank == 2 && a.shape[0] == s.batch && a.shape[1] == s.nheads);
  if (!shape_ok)
    fail(ErrorKind::value, "alibi_slopes: expected shape " + shape_str({s.nheads}) + " or " +
                               shape_str({s.batch, s.nheads}) + " ((nheads,) or (batch, nheads)), got " +
                               shape_str(a));
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
          fail(ErrorKind::value, "alibi_slopes: expected finite slopes of at most 1e30 in "
                                 "magnitude, got " + num_str(x) +
                                     " at " + (a.rank == 2 ? "[" + std::to_string(r) + ", " : "[") +
                                     std::to_string(h) + "]");
      }
  }
}

// Whether a host boolean mask keeps every score (no zero byte among its elements; an axis of
// stride 0 is read once). Stops at the first zero, so a mask that hides something costs little.
static bool keeps_every_score(const TensorView& m) {
  if (m.device.type != DeviceType::cpu) return false;  // device memory is not read here
  const auto* base = static_cast<const uint8_t*>(m.data);
  const int last = m.rank - 1;
  const int64_t n = m.strides[last] == 0 ? 1 : m.shape[last];
  int64_t outer = 1;
  for (int a = 0; a < last; ++a) outer *= m.strides[a] == 0 ? 1 : m.shape[a];
  for (int64_t r = 0; r < outer; ++r) {
    int64_t off = 0, rest = r;
    for (int a = last - 1; a >= 0; --a) {
      const int64_t extent = m.strides[a] == 0 ? 1 : m.shape[a];
      off += (rest % extent) * m.strides[a];
      rest /= extent;
    }
    const uint8_t* row = base + off;
    if (m.strides[last] == 1) {
      if (std::memchr(row, 0, static_cast<size_t>(n)) != nullptr) return false;
    } else {
      for (int64_t j = 0; j < n; ++j)
        if (row[j * m.strides[last]] == 0) return false;
    }
  }
  return true;
}

// The bias, mask and dbias fields of Params: dense rank-4 views (batch, nheads, rows, keys) or
// varlen rank-3 ones (nheads, rows, keys) with batch stride 0; a broadcast axis (size 1 or
// stride 0) gets stride 0, and bias_batch/heads/rows are 1 there. Empty arrays set nothing.
static void set_extra_params(Params& p, const Options& o, const Shapes& s) {
  auto axes = [](const TensorView& t, int64_t (&st)[4], int64_t (&n)[3]) {
    const int lead = 4 - t.rank;  // 1 for varlen: no batch axis
    for (int a = 0; a < 3; ++a) {
      const int ta = a - lead;
      const bool real = ta >= 0 && t.shape[ta] > 1 && t.strides[ta] != 0;
      st[a] = real ? t.strides[ta] : 0;
      n[a] = real ? t.shape[ta] : 1;
    }
    st[3] = t.strides[t.rank - 1];
  };
  int64_t st[4], n[3];
  if (o.bias.defined() && o.bias.numel() > 0) {
    axes(o.bias, st, n);
    p.bias_ptr = o.bias.data;
    p.bias_dtype = o.bias.dtype;
    p.bias_batch_stride = st[0];
    p.bias_head_stride = st[1];
    p.bias_row_stride = st[2];
    p.bias_col_stride = st[3];
    p.bias_batch = n[0];
    p.bias_heads = n[1];
    p.bias_rows = n[2];
    if (o.dbias.defined()) {
      // dbias has the bias's shape; the axes the bias broadcasts along are the ones dBias sums
      // over (validated: size 1 there, never stride 0 with a larger size).
      const int lead = 4 - o.dbias.rank;  // 1 for varlen: no batch axis
      p.dbias_ptr = o.dbias.data;
      p.dbias_batch_stride = (lead == 0 && n[0] > 1) ? o.dbias.strides[0] : 0;
      p.dbias_head_stride = n[1] > 1 ? o.dbias.strides[1 - lead] : 0;
      p.dbias_row_stride = n[2] > 1 ? o.dbias.strides[2 - lead] : 0;
      p.dbias_col_stride = o.dbias.strides[o.dbias.rank - 1];
    }
  }
  // A mask that hides nothing is no mask: the call is plain attention bit for bit (and takes
  // the plain kernels), for host arrays; a device mask is not read here.
  if (o.mask.defined() && o.mask.numel() > 0 && !keeps_every_score(o.mask)) {
    axes(o.mask, st, n);
    p.mask_ptr = static_cast<const uint8_t*>(o.mask.data);
    p.mask_batch_stride = st[0];
    p.mask_head_stride = st[1];
    p.mask_row_stride = st[2];
    p.mask_col_stride = st[3];
  }
  (void)s;
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
    return {3, {s.nheads, varlen_total_q, s.seqlen_k, 0},
            "(nheads or 1, total_q or 1, max_seqlen_k)"};
  return {4, {s.batch, s.nheads, s.seqlen_q, s.seqlen_k},
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
    fail(ErrorKind::value, std::string(name) + ": expected a shape broadcastable to " + want +
                               " " + x.layout + ", got " + shape_str(t));
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
                                        "additive float bias), got ") + dtype_name(o.bias.dtype));
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
      fail(ErrorKind::value, "dbias: expected the shape of bias, " + shape_str(o.bias) +
                                 ", got " + shape_str(o.dbias));
    check_dtype("dbias", o.dbias, o.bias.dtype, "the dtype of bias");
    check_device("dbias", o.dbias, device);
    for (int a = 0; a + 1 < o.bias.rank; ++a)
      if (o.bias.shape[a] > 1 && o.bias.strides[a] == 0)
        fail(ErrorKind::value, "bias: a stride of 0 along axis " + std::to_string(a) + " (size " +
                                   std::to_string(o.bias.shape[a]) + ") in a backward that "
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

bool dbias_written_by_kernels(const Params& p) {
  return p.device.type == DeviceType::cpu && p.dbias_ptr != nullptr &&
         p.schedule != Schedule::reference && p.bias_batch == p.batch &&
         p.bias_heads == p.nheads && p.bias_rows == p.seqlen_q && p.window_left < 0 &&
         p.window_right < 0 && p.block_mask_ptr == nullptr && p.mask_ptr == nullptr;
}

void advise_huge_pages(const TensorView& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (!t.defined() || t.device.type != DeviceType::cpu || t.data == nullptr) return;
  const auto es = static_cast<int64_t>(dtype_size(t.dtype));
  int64_t expect = 1;
  for (int a = t.rank - 1; a >= 0; --a) {  // row-major contiguous only
    if (t.shape[a] != 1 && t.strides[a] != expect) return;
    expect *= t.shape[a];
  }
  const int64_t bytes = expect * es;
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  if (bytes < int64_t{4} << 20) return;
  const auto begin = reinterpret_cast<uintptr_t>(t.data);
  const uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (begin + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // advice: errors ignored
#else
  (void)t;
#endif
}

void zero_extra_grads(const Options& o, bool zero_dbias) {
  if (o.dsinks.defined() && o.dsinks.device.type == DeviceType::cpu)
    for (int64_t h = 0; h < o.dsinks.shape[0]; ++h)
      static_cast<float*>(o.dsinks.data)[h * o.dsinks.strides[0]] = 0.0f;
  const TensorView& d = o.dbias;
  if (zero_dbias && d.defined() && d.device.type == DeviceType::cpu && d.numel() > 0) {
    // Every float dtype's +0 is all zero bits. Rank 3 (varlen) or 4, any strides.
    const auto es = static_cast<int64_t>(dtype_size(d.dtype));
    int64_t n[4] = {1, 1, 1, 1}, st[4] = {0, 0, 0, 0};
    for (int a = 0; a < d.rank; ++a) {
      n[4 - d.rank + a] = d.shape[a];
      st[4 - d.rank + a] = d.strides[a];
    }
    for (int64_t a = 0; a < n[0]; ++a)
      for (int64_t b = 0; b < n[1]; ++b)
        for (int64_t c = 0; c < n[2]; ++c) {
          char* row = static_cast<char*>(d.data) + (a * st[0] + b * st[1] + c * st[2]) * es;
          if (st[3] == 1) {  // a contiguous row at once
            std::memset(row, 0, static_cast<size_t>(n[3] * es));
            continue;
          }
          for (int64_t e = 0; e < n[3]; ++e)
            std::memset(row + e * st[3] * es, 0, static_cast<size_t>(es));
        }
  }
}

void refuse_bias_and_mask(const Options& o, const char* path) {
  if (o.bias.defined())
    fail(ErrorKind::not_implemented, std::string("bias: not yet on the ") + path + " path");
  if (o.mask.defined())
    fail(ErrorKind::not_implemented, std::string("mask: not yet on the ") + path + " path");
}

#define FLASHDL_SET_STRIDES(P, prefix, t) \
  P.prefix##_batch_stride = (t).strides[0];  \
  P.prefix##_row_stride = (t).strides[1];    \
  P.prefix##_head_stride = (t).strides[2]

Params make_params(const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& out, const TensorView& lse, const Options& o,
                   const Shapes& s) {
  Params p{};
  p.dtype = q.dtype;
  p.device = q.device;
  p.q_ptr = q.data;
  p.k_ptr = k.data;
  p.v_ptr = v.data;
  p.o_ptr = out.data;
  p.lse_ptr = static_cast<float*>(lse.data);
  p.batch = s.batch;
  p.seqlen_q = s.seqlen_q;
  p.seqlen_k = s.seqlen_k;
  p.nheads = s.nheads;
  p.nheads_kv = s.nheads_kv;
  p.headdim = s.headdim;
  p.h_h_k_ratio = s.nheads_kv > 0 ? s.nheads / s.nheads_kv : 1;
  FLASHDL_SET_STRIDES(p, q, q);
  FLASHDL_SET_STRIDES(p, k, k);
  FLASHDL_SET_STRIDES(p, v, v);
  FLASHDL_SET_STRIDES(p, o, out);
  p.lse_batch_stride = lse.strides[0];
  p.lse_head_stride = lse.strides[1];
  p.lse_row_stride = lse.strides[2];

  const double scale = std::isnan(o.softmax_scale)
                           ? 1.0 / std::sqrt(static_cast<double>(s.headdim > 0 ? s.headdim : 1))
                           : static_cast<double>(o.softmax_scale);
  p.scale_softmax = scale;
  p.scale_softmax_log2 = scale * 1.4426950408889634074;

  p.is_causal = o.causal;
  p.window_left = o.window_left;
  p.window_right = o.causal ? 0 : o.window_right;
  // A window that bounds nothing on either side is plain attention.
  if (p.window_left >= 0 && p.window_left >= s.seqlen_k + s.seqlen_q) p.window_left = -1;
  if (p.window_right >= 0 && p.window_right >= s.seqlen_k + s.seqlen_q) p.window_right = -1;

  const TensorView& bm = o.block_mask;
  if (bm.defined() && bm.numel() > 0) {
    const bool full = bm.rank == 4;
    p.block_mask_ptr = static_cast<const uint8_t*>(bm.data);
    p.block_mask_batch_stride = full && bm.shape[0] > 1 ? bm.strides[0] : 0;
    p.block_mask_head_stride = full && bm.shape[1] > 1 ? bm.strides[1] : 0;
    p.block_mask_row_stride = bm.strides[bm.rank - 2];
  }
  // A block at least as long as the sequence is one block either way; capping it keeps the
  // kernels' tile arithmetic far from overflow.
  p.block_q = std::min(o.block_size_q, std::max<int64_t>(s.seqlen_q, 1));
  p.block_k = std::min(o.block_size_k, std::max<int64_t>(s.seqlen_k, 1));

  const TensorView& slopes = o.alibi_slopes;
  if (slopes.defined() && slopes.numel() > 0) {
    p.alibi_slopes_ptr = static_cast<const float*>(slopes.data);
    p.alibi_batch_stride = slopes.rank == 2 ? slopes.strides[0] : 0;
    p.alibi_head_stride = slopes.strides[slopes.rank - 1];
  }
  p.softcap = o.softcap;
  set_extra_params(p, o, s);
  if (o.sinks.defined()) {
    p.sinks_ptr = static_cast<const float*>(o.sinks.data);
    p.sinks_stride = o.sinks.strides[0];
  }
  if (o.dsinks.defined()) {
    p.dsinks_ptr = static_cast<float*>(o.dsinks.data);
    p.dsinks_stride = o.dsinks.strides[0];
  }

  p.p_dropout = o.dropout_p;
  p.seed = o.seed;
  p.offset = o.offset;
  p.dropout_batch_offset = o.dropout_batch_offset;
  p.dropout_head_offset = o.dropout_head_offset;
  p.dropout_nheads = o.dropout_nheads_total == 0 ? s.nheads : o.dropout_nheads_total;
  p.schedule = o.schedule == Schedule::automatic ? Schedule::fa2 : o.schedule;
  p.auto_schedule = o.schedule == Schedule::automatic;
  p.deterministic = o.deterministic;
  p.stream = o.stream;
  p.sram_bytes = o.sram_bytes;
  p.num_threads = o.num_threads;
  return p;
}

void dispatch_forward(const Params& p) {
  if (p.device.type == DeviceType::cpu) return cpu::forward(p);
  if (!cuda::compiled())
    fail(ErrorKind::unsupported, "q: a CUDA array was given but flashdl was built without the CUDA "
                                 "backend");
  cuda::forward(p);
}

void dispatch_backward(const Params& p) {
  if (p.device.type == DeviceType::cpu) {
    cpu::backward(p);  // dbias was zeroed by the entry point (zero_extra_grads)
    if (p.dsinks_ptr != nullptr) cpu::sinks_backward(p);
    return;
  }
  if (!cuda::compiled())
    fail(ErrorKind::unsupported, "q: a CUDA array was given but flashdl was built without the CUDA "
                                 "backend");
  cuda::backward(p);
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
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"dout", &dout}, {"dq", &dq},
                         {"dk", &dk}, {"dv", &dv}}) {
    check_dtype(name, *t, q.dtype, "the dtype of q");
    check_device(name, *t, q.device);
  }
  check_shape("dout", dout, {s.batch, s.seqlen_q, s.nheads, s.headdim}, "(the shape of q)");
  check_shape("dq", dq, {s.batch, s.seqlen_q, s.nheads, s.headdim}, "(the shape of q)");
  check_shape("dk", dk, {s.batch, s.seqlen_k, s.nheads_kv, s.headdim}, "(the shape of k)");
  check_shape("dv", dv, {s.batch, s.seqlen_k, s.nheads_kv, s.headdim}, "(the shape of v)");
  for (auto [name, t] : {std::pair<const char*, const TensorView*>{"dout", &dout}, {"dq", &dq},
                         {"dk", &dk}, {"dv", &dv}})
    check_last_dim_contiguous(name, *t);
  const std::pair<const char*, const TensorView*> inputs[] = {
      {"dout", &dout}, {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}};
  const std::pair<const char*, const TensorView*> grads[] = {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}};
  for (auto [gname, g] : grads)
    for (auto [iname, in] : inputs) check_no_overlap(gname, *g, iname, *in);
  check_no_overlap("dq", dq, "dk", dk);
  check_no_overlap("dq", dq, "dv", dv);
  check_no_overlap("dk", dk, "dv", dv);
  if (!options.validate_only)
    for (auto [gname, g] : grads) check_no_self_overlap(gname, *g);

  return s;
}

Params make_backward_params(const TensorView& dout, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& out, const TensorView& lse,
                            const TensorView& dq, const TensorView& dk, const TensorView& dv,
                            const Options& options, const Shapes& s) {
  Params p = make_params(q, k, v, out, lse, options, s);
  p.do_ptr = dout.data;
  p.dq_ptr = dq.data;
  p.dk_ptr = dk.data;
  p.dv_ptr = dv.data;
  FLASHDL_SET_STRIDES(p, do, dout);
  FLASHDL_SET_STRIDES(p, dq, dq);
  FLASHDL_SET_STRIDES(p, dk, dk);
  FLASHDL_SET_STRIDES(p, dv, dv);
  return p;
}

}  // namespace flashdl::validate
