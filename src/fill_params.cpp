// The one flat Params of a call, filled from views and options that validate.cpp has checked:
// strides, the resolved scale, window and schedule, and the optional arrays' pointers.
#include "fill_params.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace flashdl {

using validate::Shapes;

namespace {

// Whether a host boolean mask keeps every score (no zero byte among its elements; an axis of
// stride 0 is read once). Stops at the first zero, so a mask that hides something costs little.
bool keeps_every_score(const TensorView& m) {
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
void set_extra_params(Params& p, const Options& o, const Shapes& s) {
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

}  // namespace

bool dbias_written_by_kernels(const Params& p) {
  return p.device.type == DeviceType::cpu && p.dbias_ptr != nullptr &&
         p.schedule != Schedule::reference && p.bias_batch == p.batch && p.bias_heads == p.nheads &&
         p.bias_rows == p.seqlen_q && p.window_left < 0 && p.window_right < 0 &&
         p.block_mask_ptr == nullptr && p.mask_ptr == nullptr;
}

#define FLASHDL_SET_STRIDES(P, prefix, t)   \
  P.prefix##_batch_stride = (t).strides[0]; \
  P.prefix##_row_stride = (t).strides[1];   \
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

}  // namespace flashdl
