// The test oracle: naive attention in float64 that materialises the N x N score matrix.
// Backward recomputes everything from q, k, v and dout (it ignores out and lse), so it is the exact
// gradient of the forward, not of whatever a schedule saved.
#include <cmath>
#include <vector>

#include "cpu/convert.hpp"
#include "cpu/schedules.hpp"
#include "cpu/threads.hpp"
#include "flashdl/detail/block_mask.hpp"
#include "flashdl/detail/extras.hpp"
#include "flashdl/detail/mask.hpp"
#include "flashdl/detail/dropout.hpp"
#include "flashdl/detail/philox.hpp"
#include "flashdl/detail/score_mod.hpp"

namespace flashdl::cpu {

namespace {

using detail::Mask;

struct Head {
  const Params& p;
  int64_t b, h;
  int64_t hk() const { return h / p.h_h_k_ratio; }
  double q(int64_t i, int64_t c) const {
    return load_as_double(p.q_ptr, p.dtype,
                          b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride + c);
  }
  double k(int64_t j, int64_t c) const {
    return load_as_double(p.k_ptr, p.dtype,
                          b * p.k_batch_stride + j * p.k_row_stride + hk() * p.k_head_stride + c);
  }
  double v(int64_t j, int64_t c) const {
    return load_as_double(p.v_ptr, p.dtype,
                          b * p.v_batch_stride + j * p.v_row_stride + hk() * p.v_head_stride + c);
  }
  double dout(int64_t i, int64_t c) const {
    return load_as_double(p.do_ptr, p.dtype,
                          b * p.do_batch_stride + i * p.do_row_stride + h * p.do_head_stride + c);
  }
  // Dropout multiplier of element (i, j): 0 or 1 / (1 - p).
  double keep_scale(int64_t i, int64_t j) const {
    if (p.p_dropout <= 0.0f) return 1.0;
    const bool keep = detail::dropout_keep(p.p_dropout, p.seed, p.offset,
                                           detail::dropout_bh(p, b, h), i, j);
    return keep ? 1.0 / (1.0 - static_cast<double>(p.p_dropout)) : 0.0;
  }
};

// P (row-normalised probabilities, 0 where masked) and the natural-log lse of each row, of the
// scores after the modifiers (softcap, ALiBi); with G non-null, also d score / d (scale q.k).
void softmax_rows(const Params& p, const Head& hd, std::vector<double>& P, std::vector<double>& lse,
                  std::vector<double>* G = nullptr) {
  const int64_t sq = p.seqlen_q, sk = p.seqlen_k, d = p.headdim;
  const Mask mask{sq, sk, p.window_left, p.window_right};
  const detail::BlockMask blocks = detail::block_mask_of(p, hd.b, hd.h);
  // In the exp2 domain the modifiers are ScoreMod's; the oracle divides log2(e) back out.
  const detail::ScoreMod<double> mod = detail::score_mod_of<double>(p, hd.b, hd.h);
  const detail::HeadExtras ex = detail::extras_of(p, hd.b, hd.h);
  P.assign(sq * sk, 0.0);
  if (G) G->assign(sq * sk, 0.0);
  lse.assign(sq, -INFINITY);
  std::vector<double> kd(sk * d);
  for (int64_t j = 0; j < sk; ++j)
    for (int64_t c = 0; c < d; ++c) kd[j * d + c] = hd.k(j, c);
  std::vector<double> qi(d);
  for (int64_t i = 0; i < sq; ++i) {
    for (int64_t c = 0; c < d; ++c) qi[c] = hd.q(i, c);
    double m = -INFINITY;
    double* row = P.data() + i * sk;
    for (int64_t j = 0; j < sk; ++j) {
      if (!mask.visible(i, j) || !blocks.visible(i, j) || !ex.kept(i, j)) {
        row[j] = -INFINITY;
        continue;
      }
      double s = 0;
      for (int64_t c = 0; c < d; ++c) s += qi[c] * kd[j * d + c];
      row[j] = (mod.score(s) + mod.bias(mask.diag(i), j)) * detail::kLn2;
      if (ex.bias != nullptr)
        row[j] += load_as_double(ex.bias, ex.bias_dtype, ex.bias_offset(i, j));
      if (G) (*G)[i * sk + j] = mod.grad(s);
      m = std::fmax(m, row[j]);
    }
    // The sink (natural log) joins the denominator with no value: a row that sees no key then
    // has P = 0 and lse = sink.
    const double sink = p.sinks_ptr ? static_cast<double>(p.sinks_ptr[hd.h * p.sinks_stride])
                                    : -INFINITY;
    if (m == -INFINITY && sink == -INFINITY) {  // no visible key: P = 0, lse = -inf
      for (int64_t j = 0; j < sk; ++j) row[j] = 0.0;
      continue;
    }
    m = std::fmax(m, sink);
    // Keys the row cannot see get exactly 0, never exp(-inf - m) / l: with an Inf or NaN score
    // among the visible ones m or l is Inf or NaN, and that would be NaN, which the backward
    // then carried into dk and dv of keys the row cannot see.
    double l = sink == -INFINITY ? 0.0 : std::exp(sink - m);
    for (int64_t j = 0; j < sk; ++j)
      if (row[j] != -INFINITY) l += (row[j] = std::exp(row[j] - m));
    for (int64_t j = 0; j < sk; ++j) row[j] = row[j] == -INFINITY ? 0.0 : row[j] / l;
    lse[i] = m + std::log(l);
  }
}

}  // namespace

void reference_forward(const Params& p, int threads) {
  parallel_for(p.batch * p.nheads, threads, [&](int64_t begin, int64_t end, int) {
    std::vector<double> P, lse, acc(p.headdim);
    for (int64_t bh = begin; bh < end; ++bh) {
      const Head hd{p, bh / p.nheads, bh % p.nheads};
      softmax_rows(p, hd, P, lse);
      for (int64_t i = 0; i < p.seqlen_q; ++i) {
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < p.seqlen_k; ++j) {
          const double w = P[i * p.seqlen_k + j] * hd.keep_scale(i, j);
          if (w == 0.0) continue;
          for (int64_t c = 0; c < p.headdim; ++c) acc[c] += w * hd.v(j, c);
        }
        const int64_t o = hd.b * p.o_batch_stride + i * p.o_row_stride + hd.h * p.o_head_stride;
        for (int64_t c = 0; c < p.headdim; ++c) store_from_double(p.o_ptr, p.dtype, o + c, acc[c]);
        p.lse_ptr[hd.b * p.lse_batch_stride + hd.h * p.lse_head_stride + i * p.lse_row_stride] =
            static_cast<float>(lse[i]);
      }
    }
  });
}

void reference_backward(const Params& p, int threads) {
  const int64_t sq = p.seqlen_q, sk = p.seqlen_k, d = p.headdim;
  // dBias: stored per element when the bias is as large as the problem, else summed in per-thread
  // compact partials added in thread order (as the fa1 and fa2 schedules do).
  const bool dbias_direct = p.bias_batch == p.batch && p.bias_heads == p.nheads &&
                            p.bias_rows == p.seqlen_q;
  std::vector<std::vector<double>> dbias_part(
      p.dbias_ptr != nullptr && !dbias_direct ? static_cast<size_t>(threads) : 0);
  // One task per (batch, kv head): dk and dv sum over the query heads of the group.
  parallel_for(p.batch * p.nheads_kv, threads, [&](int64_t begin, int64_t end, int thread) {
    double* dbias_acc = nullptr;
    if (!dbias_part.empty()) {
      dbias_part[thread].assign(static_cast<size_t>(p.bias_batch * p.bias_heads * p.bias_rows * sk),
                                0.0);
      dbias_acc = dbias_part[thread].data();
    }
    std::vector<double> P, lse, G, dP(sq * sk), dk(sk * d), dv(sk * d), dq(sq * d), dO(sq * d),
        D(sq);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / p.nheads_kv, hk = task % p.nheads_kv;
      std::fill(dk.begin(), dk.end(), 0.0);
      std::fill(dv.begin(), dv.end(), 0.0);
      for (int64_t h = hk * p.h_h_k_ratio; h < (hk + 1) * p.h_h_k_ratio; ++h) {
        const Head hd{p, b, h};
        softmax_rows(p, hd, P, lse, &G);
        for (int64_t i = 0; i < sq; ++i)
          for (int64_t c = 0; c < d; ++c) dO[i * d + c] = hd.dout(i, c);
        // dV = (P * Z)^T dO;  dP = (dO V^T) * Z;  D = rowsum(P * dP)
        for (int64_t i = 0; i < sq; ++i) {
          D[i] = 0;
          for (int64_t j = 0; j < sk; ++j) {
            const double pij = P[i * sk + j];
            if (pij == 0.0) {
              dP[i * sk + j] = 0;
              continue;
            }
            const double z = hd.keep_scale(i, j);
            double dpd = 0;
            for (int64_t c = 0; c < d; ++c) {
              const double vjc = hd.v(j, c);
              dv[j * d + c] += pij * z * dO[i * d + c];
              dpd += dO[i * d + c] * vjc;
            }
            dP[i * sk + j] = dpd * z;
            D[i] += pij * dP[i * sk + j];
          }
        }
        // dS = P * (dP - D) * G (G: the softcap's tanh derivative, else 1);
        // dQ = scale dS K;  dK = scale dS^T Q
        std::fill(dq.begin(), dq.end(), 0.0);
        for (int64_t i = 0; i < sq; ++i)
          for (int64_t j = 0; j < sk; ++j) {
            const double pij = P[i * sk + j];
            if (pij == 0.0) continue;
            const double dbias = pij * (dP[i * sk + j] - D[i]);  // d loss / d (bias + score)
            if (dbias_acc != nullptr)
              dbias_acc[detail::dbias_index(p, b, h, i) + j] += dbias;
            else if (p.dbias_ptr != nullptr)
              store_from_double(p.dbias_ptr, p.bias_dtype,
                                b * p.dbias_batch_stride + h * p.dbias_head_stride +
                                    i * p.dbias_row_stride + j * p.dbias_col_stride,
                                dbias);
            const double ds = dbias * G[i * sk + j] * p.scale_softmax;
            for (int64_t c = 0; c < d; ++c) {
              dq[i * d + c] += ds * hd.k(j, c);
              dk[j * d + c] += ds * hd.q(i, c);
            }
          }
        for (int64_t i = 0; i < sq; ++i) {
          const int64_t o = b * p.dq_batch_stride + i * p.dq_row_stride + h * p.dq_head_stride;
          for (int64_t c = 0; c < d; ++c)
            store_from_double(p.dq_ptr, p.dtype, o + c, dq[i * d + c]);
        }
      }
      for (int64_t j = 0; j < sk; ++j) {
        const int64_t ok = b * p.dk_batch_stride + j * p.dk_row_stride + hk * p.dk_head_stride;
        const int64_t ov = b * p.dv_batch_stride + j * p.dv_row_stride + hk * p.dv_head_stride;
        for (int64_t c = 0; c < d; ++c) {
          store_from_double(p.dk_ptr, p.dtype, ok + c, dk[j * d + c]);
          store_from_double(p.dv_ptr, p.dtype, ov + c, dv[j * d + c]);
        }
      }
    }
  });
  if (dbias_part.empty()) return;
  const int64_t rows = p.bias_batch * p.bias_heads * p.bias_rows;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t ii = r % p.bias_rows, hh = (r / p.bias_rows) % p.bias_heads,
                  bb = r / p.bias_rows / p.bias_heads;
    const int64_t o = bb * p.dbias_batch_stride + hh * p.dbias_head_stride +
                      ii * p.dbias_row_stride;
    for (int64_t j = 0; j < sk; ++j) {
      double acc = load_as_double(p.dbias_ptr, p.bias_dtype, o + j * p.dbias_col_stride);
      for (const auto& part : dbias_part)
        if (!part.empty()) acc += part[r * sk + j];
      store_from_double(p.dbias_ptr, p.bias_dtype, o + j * p.dbias_col_stride, acc);
    }
  }
}

}  // namespace flashdl::cpu
