// Variable-length batches (flash-attn's varlen layout): validated once whole. On the CPU each
// sequence then runs as a batch-1 dense problem over its own rows; on CUDA the whole packed batch
// is one launch whose CTAs read their sequence's offsets (Params.cu_seqlens_*). No padding is
// computed either way. The paged form gathers its keys first (varlen_paged.cpp).
#include <string>
#include <vector>

#include "backend.hpp"
#include "dispatch.hpp"
#include "fill_params.hpp"
#include "flashdl/api.hpp"
#include "validate.hpp"
#include "varlen_paged.hpp"

namespace flashdl {

namespace {

using namespace validate;

// A rank-3 (total, heads, headdim) array as the rank-4 batch-1 view (1, total, heads, headdim).
TensorView as_batch1(const TensorView& t) {
  TensorView r = t;
  r.rank = 4;
  r.shape = {1, t.shape[0], t.shape[1], t.shape[2]};
  r.strides = {0, t.strides[0], t.strides[1], t.strides[2]};
  return r;
}

// The varlen lse (nheads, total_q) as the dense (1, nheads, total_q).
TensorView lse_as_batch1(const TensorView& lse) {
  TensorView r = lse;
  r.rank = 3;
  r.shape = {1, lse.shape[0], lse.shape[1], 0};
  r.strides = {0, lse.strides[0], lse.strides[1], 0};
  return r;
}

// Rows [start, start + len) of dimension `dim` of a batch-1 view.
TensorView slice(const TensorView& t, int dim, int64_t start, int64_t len) {
  TensorView r = t;
  r.shape[dim] = len;
  if (start != 0)
    r.data = static_cast<char*>(t.data) +
             start * t.strides[dim] * static_cast<int64_t>(dtype_size(t.dtype));
  return r;
}

// cu_seqlens checked for rank, dtype and device and, in host memory, read and checked against
// the total length and max_seqlen. CPU q: the offsets must be on the CPU. CUDA q: on the CPU
// (read and checked here; the backend copies them to the device) or on the device of q (read by
// the kernels only: no host round trip, and so no check of the values here; the kernels clamp
// them into range, see detail::sequence_of). read_values false (Options::validate_only) skips
// reading them. Returns the offsets read, or an empty vector.
std::vector<int64_t> read_cu_seqlens(const char* name, const TensorView& cu, Device q_device,
                                     const char* total_name, int64_t total, const char* max_name,
                                     int64_t max_seqlen, bool read_values) {
  check_rank(name, cu, 1, "(batch + 1,)");
  check_dtype(name, cu, DType::int32, "cumulative sequence lengths are int32");
  if (cu.device.type != DeviceType::cpu && cu.device != q_device)
    fail(ErrorKind::value,
         std::string(name) + ": expected an array on the CPU (host memory) " +
             (q_device.type == DeviceType::cpu
                  ? std::string("")
                  : std::string("or on the device of q, ") + device_name(q_device.type) + ":" +
                        std::to_string(q_device.id)) +
             ", got " + device_name(cu.device.type) + ":" + std::to_string(cu.device.id));
  if (cu.shape[0] < 1)
    fail(ErrorKind::value, std::string(name) +
                               ": expected shape (batch + 1,) with cu[0] == 0, "
                               "got an empty array");
  if (max_seqlen < 0)
    fail(ErrorKind::value,
         std::string(max_name) + ": expected >= 0, got " + std::to_string(max_seqlen));
  if (cu.device.type != DeviceType::cpu || !read_values) return {};
  const auto* c = static_cast<const int32_t*>(cu.data);
  std::vector<int64_t> off(static_cast<size_t>(cu.shape[0]));
  for (int64_t i = 0; i < cu.shape[0]; ++i) off[i] = c[i * cu.strides[0]];
  if (off[0] != 0)
    fail(ErrorKind::value,
         std::string(name) + ": expected " + name + "[0] == 0, got " + std::to_string(off[0]));
  for (size_t b = 0; b + 1 < off.size(); ++b) {
    const int64_t len = off[b + 1] - off[b];
    if (len < 0)
      fail(ErrorKind::value, std::string(name) + ": expected non-decreasing offsets, got " + name +
                                 "[" + std::to_string(b + 1) + "] = " + std::to_string(off[b + 1]) +
                                 " < " + name + "[" + std::to_string(b) +
                                 "] = " + std::to_string(off[b]));
    if (len > max_seqlen)
      fail(ErrorKind::value, std::string(max_name) + ": sequence " + std::to_string(b) + " of " +
                                 name + " has length " + std::to_string(len) + ", more than " +
                                 max_name + " = " + std::to_string(max_seqlen));
  }
  if (off.back() != total)
    fail(ErrorKind::value, std::string(name) + ": expected the last offset to equal " + total_name +
                               " = " + std::to_string(total) + ", got " +
                               std::to_string(off.back()));
  return off;
}

struct VarlenBatch {
  std::vector<int64_t> cu_q, cu_k;  // the offsets, when read on the host
  int64_t nseq = 0;                 // sequences in the batch
  int64_t batch() const { return nseq; }
};

// The varlen-only checks: ranks and shapes of the packed arrays, the device, the offsets.
// Everything else (dtypes, devices, strides, overlap, options) is check_attention_args' job on
// the batch-1 views of the whole arrays.
VarlenBatch check_varlen_layout(const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& out, const TensorView& lse,
                                const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                int64_t max_seqlen_q, int64_t max_seqlen_k, bool read_values) {
  check_rank("q", q, 3, "(total_q, nheads, headdim)");
  check_rank("k", k, 3, "(total_k, nheads_kv, headdim)");
  check_rank("v", v, 3, "(total_k, nheads_kv, headdim)");
  check_rank("out", out, 3, "(total_q, nheads, headdim)");
  check_rank("lse", lse, 2, "(nheads, total_q)");
  if (k.shape[2] != q.shape[2])
    fail(ErrorKind::value, "k: headdim " + std::to_string(k.shape[2]) +
                               " does not match the headdim of q, " + std::to_string(q.shape[2]));
  check_shape("v", v, {k.shape[0], k.shape[1], k.shape[2]}, "(the shape of k)");
  check_shape("out", out, {q.shape[0], q.shape[1], q.shape[2]}, "(the shape of q)");
  check_shape("lse", lse, {q.shape[1], q.shape[0]}, "(nheads, total_q)");
  VarlenBatch vb;
  vb.cu_q = read_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device, "total_q", q.shape[0],
                            "max_seqlen_q", max_seqlen_q, read_values);
  vb.cu_k = read_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device, "total_k", k.shape[0],
                            "max_seqlen_k", max_seqlen_k, read_values);
  if (cu_seqlens_k.device != cu_seqlens_q.device)
    fail(ErrorKind::value, std::string("cu_seqlens_k: expected an array on the device of "
                                       "cu_seqlens_q, ") +
                               device_name(cu_seqlens_q.device.type) + ":" +
                               std::to_string(cu_seqlens_q.device.id) + ", got " +
                               device_name(cu_seqlens_k.device.type) + ":" +
                               std::to_string(cu_seqlens_k.device.id));
  if (cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0])
    fail(ErrorKind::value, "cu_seqlens_k: expected shape " + shape_str({cu_seqlens_q.shape[0]}) +
                               " (batch + 1, as cu_seqlens_q), got " + shape_str(cu_seqlens_k));
  vb.nseq = cu_seqlens_q.shape[0] - 1;
  return vb;
}

// The block mask of a packed call is sized by its batch of sequences and max_seqlen, not by the
// batch-1 views the other checks see.
Shapes mask_extents(const VarlenBatch& vb, const Shapes& whole, int64_t max_seqlen_q,
                    int64_t max_seqlen_k) {
  return Shapes{vb.batch(),   max_seqlen_q,    max_seqlen_k,
                whole.nheads, whole.nheads_kv, whole.headdim};
}

// Params of sequence b: its block-mask plane and ALiBi slopes (their batch index is the
// sequence's) and its dropout stream (that of dense batch b).
void select_sequence(Params& p, int64_t b) {
  if (p.block_mask_ptr != nullptr) p.block_mask_ptr += b * p.block_mask_batch_stride;
  if (p.alibi_slopes_ptr != nullptr) p.alibi_slopes_ptr += b * p.alibi_batch_stride;
  p.dropout_batch_offset += b;
}

// Params of the sequence whose query rows start at packed row q0: its rows of the bias, mask and
// dbias ((nheads, total_q, max_seqlen_k); a broadcast row axis has stride 0), as a batch-1 call
// over its seqlen_q rows.
void select_rows(Params& p, int64_t q0) {
  if (p.bias_ptr != nullptr) {
    const int64_t es = static_cast<int64_t>(dtype_size(p.bias_dtype));
    p.bias_ptr = static_cast<const char*>(p.bias_ptr) + q0 * p.bias_row_stride * es;
    if (p.dbias_ptr != nullptr)
      p.dbias_ptr = static_cast<char*>(p.dbias_ptr) + q0 * p.dbias_row_stride * es;
    if (p.bias_rows > 1) p.bias_rows = p.seqlen_q;
  }
  if (p.mask_ptr != nullptr) p.mask_ptr += q0 * p.mask_row_stride;
}

// The one-launch form (CUDA): Params made with mask_extents' shapes (batch = the sequences,
// seqlen bounds = max_seqlen; the batch-1 views already have batch stride 0), plus the offsets.
// Sequence b's block-mask plane and dropout stream follow from its batch index as in a dense call.
void set_offsets(Params& p, const TensorView& cu_q, const TensorView& cu_k, int64_t total_q,
                 int64_t total_k) {
  p.cu_seqlens_q = static_cast<const int32_t*>(cu_q.data);
  p.cu_seqlens_k = static_cast<const int32_t*>(cu_k.data);
  p.cu_seqlens_q_stride = cu_q.strides[0];
  p.cu_seqlens_k_stride = cu_k.strides[0];
  p.cu_seqlens_host = cu_q.device.type == DeviceType::cpu;  // cu_k is on the same device
  p.total_q = total_q;
  p.total_k = total_k;
}

}  // namespace

void forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                    int64_t max_seqlen_q, int64_t max_seqlen_k, const TensorView& out,
                    const TensorView& lse, const Options& options, const PagedKv& paged) {
  if (paged.block_table.defined() || paged.seqused_k.defined()) {
    // The pages (or used rows) gathered into contiguous buffers, then the contiguous path:
    // every other check is its, and the result that of contiguous keys, bit for bit.
    Gathered g;
    if (!gather_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, paged, options, g)) {
      check_rank("out", out, 3, "(total_q, nheads, headdim)");
      return;
    }
    forward_varlen(q, g.kt, g.vt, cu_seqlens_q, g.cut, max_seqlen_q, max_seqlen_k, out, lse,
                   options);
    if (g.device) g.device->release();  // on the stream, behind the forward
    return;
  }
  const VarlenBatch vb = check_varlen_layout(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, !options.validate_only);
  const TensorView q4 = as_batch1(q), k4 = as_batch1(k), v4 = as_batch1(v), o4 = as_batch1(out),
                   l3 = lse_as_batch1(lse);
  const Shapes whole = check_attention_args(q4, k4, v4, o4, l3, options);
  check_block_mask(options, mask_extents(vb, whole, max_seqlen_q, max_seqlen_k), q.device,
                   {{"out", &out}, {"lse", &lse}});
  check_score_mods(options, mask_extents(vb, whole, max_seqlen_q, max_seqlen_k), q.device,
                   {{"out", &out}, {"lse", &lse}});
  check_extras(options, mask_extents(vb, whole, max_seqlen_q, max_seqlen_k), q.device,
               {{"out", &out}, {"lse", &lse}}, q.shape[0]);
  if (options.validate_only) return;
  if (whole.nheads == 0 || vb.batch() == 0) return;
  if (q.device.type != DeviceType::cpu) {
    if (max_seqlen_q == 0) return;  // nothing to write
    Params p = make_params(q4, k4, v4, o4, l3, options,
                           mask_extents(vb, whole, max_seqlen_q, max_seqlen_k));
    set_offsets(p, cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0]);
    return dispatch_forward(p);
  }
  // Each sequence is a batch-1 dense problem over its own rows: causal and window alignment are
  // per sequence for free, and no padding is computed. The backend runs them together.
  std::vector<Params> problems;
  for (int64_t b = 0; b < vb.batch(); ++b) {
    const int64_t q0 = vb.cu_q[b], sq = vb.cu_q[b + 1] - q0;
    const int64_t k0 = vb.cu_k[b], sk = vb.cu_k[b + 1] - k0;
    if (sq == 0) continue;  // nothing to write
    const Shapes s{1, sq, sk, whole.nheads, whole.nheads_kv, whole.headdim};
    Params p = make_params(slice(q4, 1, q0, sq), slice(k4, 1, k0, sk), slice(v4, 1, k0, sk),
                           slice(o4, 1, q0, sq), slice(l3, 2, q0, sq), options, s);
    select_sequence(p, b);
    select_rows(p, q0);
    problems.push_back(p);
  }
  cpu::forward_batch(problems);
}

void backward_varlen(const TensorView& dout, const TensorView& q, const TensorView& k,
                     const TensorView& v, const TensorView& out, const TensorView& lse,
                     const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                     int64_t max_seqlen_q, int64_t max_seqlen_k, const TensorView& dq,
                     const TensorView& dk, const TensorView& dv, const Options& options) {
  const VarlenBatch vb = check_varlen_layout(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, !options.validate_only);
  check_rank("dout", dout, 3, "(total_q, nheads, headdim)");
  check_rank("dq", dq, 3, "(total_q, nheads, headdim)");
  check_rank("dk", dk, 3, "(total_k, nheads_kv, headdim)");
  check_rank("dv", dv, 3, "(total_k, nheads_kv, headdim)");
  check_shape("dout", dout, {q.shape[0], q.shape[1], q.shape[2]}, "(the shape of q)");
  check_shape("dq", dq, {q.shape[0], q.shape[1], q.shape[2]}, "(the shape of q)");
  check_shape("dk", dk, {k.shape[0], k.shape[1], k.shape[2]}, "(the shape of k)");
  check_shape("dv", dv, {k.shape[0], k.shape[1], k.shape[2]}, "(the shape of v)");
  const TensorView do4 = as_batch1(dout), q4 = as_batch1(q), k4 = as_batch1(k), v4 = as_batch1(v),
                   o4 = as_batch1(out), l3 = lse_as_batch1(lse), dq4 = as_batch1(dq),
                   dk4 = as_batch1(dk), dv4 = as_batch1(dv);
  const Shapes whole = check_backward_args(do4, q4, k4, v4, o4, l3, dq4, dk4, dv4, options);
  check_block_mask(options, mask_extents(vb, whole, max_seqlen_q, max_seqlen_k), q.device,
                   {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
  check_score_mods(options, mask_extents(vb, whole, max_seqlen_q, max_seqlen_k), q.device,
                   {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
  check_extras(options, mask_extents(vb, whole, max_seqlen_q, max_seqlen_k), q.device,
               {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}}, q.shape[0]);
  if (options.validate_only) return;
  zero_extra_grads(options);
  if (whole.nheads == 0 || vb.batch() == 0) return;
  if (q.device.type != DeviceType::cpu) {
    Params p = make_backward_params(do4, q4, k4, v4, o4, l3, dq4, dk4, dv4, options,
                                    mask_extents(vb, whole, max_seqlen_q, max_seqlen_k));
    set_offsets(p, cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0]);
    return dispatch_backward(p);
  }
  // Sequences with no query rows still run: the backend writes their dk, dv (zeros).
  std::vector<Params> problems;
  for (int64_t b = 0; b < vb.batch(); ++b) {
    const int64_t q0 = vb.cu_q[b], sq = vb.cu_q[b + 1] - q0;
    const int64_t k0 = vb.cu_k[b], sk = vb.cu_k[b + 1] - k0;
    const Shapes s{1, sq, sk, whole.nheads, whole.nheads_kv, whole.headdim};
    Params p = make_backward_params(slice(do4, 1, q0, sq), slice(q4, 1, q0, sq),
                                    slice(k4, 1, k0, sk), slice(v4, 1, k0, sk),
                                    slice(o4, 1, q0, sq), slice(l3, 2, q0, sq),
                                    slice(dq4, 1, q0, sq), slice(dk4, 1, k0, sk),
                                    slice(dv4, 1, k0, sk), options, s);
    select_sequence(p, b);
    select_rows(p, q0);
    p.dsinks_ptr = nullptr;  // summed over every sequence below
    problems.push_back(p);
  }
  if (options.dbias.defined()) {
    // Sequences may add into the same dbias elements (a bias broadcast over rows or heads): one
    // after another, each over every thread, in sequence order (reproducible).
    for (const Params& p : problems) cpu::backward(p);
  } else {
    cpu::backward_batch(problems);
  }
  if (options.dsinks.defined())  // the packed rows as one batch-1 problem
    cpu::sinks_backward(
        make_backward_params(do4, q4, k4, v4, o4, l3, dq4, dk4, dv4, options, whole));
}

}  // namespace flashdl
