// The tests' own naive attention, written from DESIGN.md alone (it shares no code with the library
// except the Philox dropout decision, which test_math checks by known answers). Templated on the
// compute type T: T = double is the float64 oracle; T = float with the results rounded to the
// storage dtype is "the same naive algorithm in the input precision" of the tolerance rule.
// Arrays are logical row-major: q/out/dout (b, sq, h, d), k/v (b, sk, hk, d), lse (b, h, sq).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "arrays.hpp"
#include "flashdl/detail/philox.hpp"

namespace flashdl_test {

struct Problem {
  int64_t b = 1, sq = 1, sk = 1, h = 1, hk = 1, d = 1;
  double scale = 1.0;
  int64_t left = -1, right = -1;  // resolved window: causal is right = 0; -1 unbounded
  float dropout = 0.0f;
  uint64_t seed = 0, offset = 0;

  // Block-sparse mask (block_q = 0: dense): flags (mb, mh, nbq, nbk) row-major, 0 a zero block;
  // mb is 1 or b and mh 1 or h (query heads), a size of 1 broadcasting.
  int64_t block_q = 0, block_k = 0;
  int64_t mb = 1, mh = 1, nbq = 0, nbk = 0;
  std::vector<uint8_t> blocks;

  // DESIGN.md: in the window iff i + sk - sq - left <= j <= i + sk - sq + right (-1 = unbounded).
  bool in_window(int64_t i, int64_t j) const {
    const int64_t c = i + sk - sq;
    return (left < 0 || j >= c - left) && (right < 0 || j <= c + right);
  }
  bool block_set(int64_t bi, int64_t hi, int64_t qb, int64_t kb) const {
    if (block_q <= 0) return true;
    const int64_t plane = (mb == 1 ? 0 : bi) * mh + (mh == 1 ? 0 : hi);
    return blocks[static_cast<size_t>((plane * nbq + qb) * nbk + kb)] != 0;
  }
  // Key j is visible to query i of (batch bi, query head hi): the window AND the block mask.
  bool visible(int64_t bi, int64_t hi, int64_t i, int64_t j) const {
    return in_window(i, j) && (block_q <= 0 || block_set(bi, hi, i / block_q, j / block_k));
  }
  double keep(int64_t bi, int64_t hi, int64_t i, int64_t j) const {
    if (dropout <= 0.0f) return 1.0;
    const bool kept = flashdl::detail::dropout_keep(dropout, seed, offset,
                                                    static_cast<uint64_t>(bi * h + hi), i, j);
    return kept ? 1.0 / (1.0 - static_cast<double>(dropout)) : 0.0;
  }
  int64_t qi(int64_t bi, int64_t i, int64_t hi) const { return ((bi * sq + i) * h + hi) * d; }
  int64_t ki(int64_t bi, int64_t j, int64_t hki) const { return ((bi * sk + j) * hk + hki) * d; }
  int64_t kv_head(int64_t hi) const { return hi / (h / hk); }
};

template <typename T>
struct Naive {
  const Problem& p;
  const std::vector<double>& q;
  const std::vector<double>& k;
  const std::vector<double>& v;

  // Scaled scores of row i for (bi, hi) into S (-inf where masked); returns the row max.
  T scores_row(int64_t bi, int64_t hi, int64_t i, std::vector<T>& S) const {
    S.assign(static_cast<size_t>(p.sk), T(-INFINITY));
    const double* qr = &q[p.qi(bi, i, hi)];
    T m = -INFINITY;
    for (int64_t j = 0; j < p.sk; ++j) {
      if (!p.visible(bi, hi, i, j)) continue;
      const double* kr = &k[p.ki(bi, j, p.kv_head(hi))];
      T s = 0;
      for (int64_t c = 0; c < p.d; ++c) s += static_cast<T>(qr[c]) * static_cast<T>(kr[c]);
      S[j] = s * static_cast<T>(p.scale);
      if (S[j] > m) m = S[j];
    }
    return m;
  }

  // Row i of the softmax for (bi, hi): P[j] (0 where masked); returns lse (-inf when empty).
  T softmax_row(int64_t bi, int64_t hi, int64_t i, std::vector<T>& P) const {
    const T m = scores_row(bi, hi, i, P);
    if (m == T(-INFINITY)) {
      P.assign(static_cast<size_t>(p.sk), T(0));
      return T(-INFINITY);
    }
    T l = 0;
    for (int64_t j = 0; j < p.sk; ++j) l += (P[j] = std::exp(P[j] - m));
    for (int64_t j = 0; j < p.sk; ++j) P[j] /= l;
    return m + std::log(l);
  }

  // The backward's P: recomputed from the scores and lse, lse first rounded to `lse_dt` (the
  // library keeps lse in float32, so a float32 lse is part of any dtype's backward).
  void backward_row(int64_t bi, int64_t hi, int64_t i, DType lse_dt, std::vector<T>& P) const {
    const T lse = static_cast<T>(round_to(static_cast<double>(softmax_row(bi, hi, i, P)), lse_dt));
    if (lse == T(-INFINITY)) return;
    scores_row(bi, hi, i, P);
    for (int64_t j = 0; j < p.sk; ++j) P[j] = std::exp(P[j] - lse);
  }

  // max over keys of the attention mass sum_{i, heads of the group} P_ij Z_ij (float64).
  double max_key_mass() const {
    std::vector<double> mass(static_cast<size_t>(p.b * p.hk * p.sk), 0.0);
    std::vector<T> P;
    for (int64_t bi = 0; bi < p.b; ++bi)
      for (int64_t hi = 0; hi < p.h; ++hi)
        for (int64_t i = 0; i < p.sq; ++i) {
          softmax_row(bi, hi, i, P);
          for (int64_t j = 0; j < p.sk; ++j)
            mass[(bi * p.hk + p.kv_head(hi)) * p.sk + j] += P[j] * p.keep(bi, hi, i, j);
        }
    double m = 0;
    for (double x : mass) m = std::max(m, x);
    return m;
  }

  // out rounded to `dt`; lse in T (the library stores float32).
  void forward(DType dt, std::vector<double>& out, std::vector<double>& lse) const {
    out.assign(static_cast<size_t>(p.b * p.sq * p.h * p.d), 0.0);
    lse.assign(static_cast<size_t>(p.b * p.h * p.sq), 0.0);
    std::vector<T> P, acc(static_cast<size_t>(p.d));
    for (int64_t bi = 0; bi < p.b; ++bi)
      for (int64_t hi = 0; hi < p.h; ++hi)
        for (int64_t i = 0; i < p.sq; ++i) {
          lse[(bi * p.h + hi) * p.sq + i] = static_cast<double>(softmax_row(bi, hi, i, P));
          std::fill(acc.begin(), acc.end(), T(0));
          for (int64_t j = 0; j < p.sk; ++j) {
            const T w = P[j] * static_cast<T>(p.keep(bi, hi, i, j));
            if (w == T(0)) continue;
            const double* vr = &v[p.ki(bi, j, p.kv_head(hi))];
            for (int64_t c = 0; c < p.d; ++c) acc[c] += w * static_cast<T>(vr[c]);
          }
          for (int64_t c = 0; c < p.d; ++c)
            out[p.qi(bi, i, hi) + c] = round_to(static_cast<double>(acc[c]), dt);
        }
  }

  // Gradients of sum(out * dout), with D = rowsum(dout * out) from the given out and P from lse
  // (as the FlashAttention backward does); results rounded to `dt`.
  void backward(const std::vector<double>& dout, const std::vector<double>& out, DType dt,
                DType lse_dt, std::vector<double>& dq, std::vector<double>& dk,
                std::vector<double>& dv) const {
    const auto nq = static_cast<size_t>(p.b * p.sq * p.h * p.d);
    const auto nk = static_cast<size_t>(p.b * p.sk * p.hk * p.d);
    std::vector<T> gq(nq, T(0)), gk(nk, T(0)), gv(nk, T(0)), P, dS(static_cast<size_t>(p.sk));
    const T scale = static_cast<T>(p.scale);
    for (int64_t bi = 0; bi < p.b; ++bi)
      for (int64_t hi = 0; hi < p.h; ++hi) {
        const int64_t hki = p.kv_head(hi);
        for (int64_t i = 0; i < p.sq; ++i) {
          backward_row(bi, hi, i, lse_dt, P);
          const double* dO = &dout[p.qi(bi, i, hi)];
          const double* O = &out[p.qi(bi, i, hi)];
          T D = 0;
          for (int64_t c = 0; c < p.d; ++c) D += static_cast<T>(dO[c]) * static_cast<T>(O[c]);
          for (int64_t j = 0; j < p.sk; ++j) {
            dS[j] = 0;
            if (P[j] == T(0)) continue;
            const T z = static_cast<T>(p.keep(bi, hi, i, j));
            const double* vr = &v[p.ki(bi, j, hki)];
            T* gvr = &gv[p.ki(bi, j, hki)];
            T dp = 0;
            for (int64_t c = 0; c < p.d; ++c) {
              dp += static_cast<T>(dO[c]) * static_cast<T>(vr[c]);
              gvr[c] += P[j] * z * static_cast<T>(dO[c]);
            }
            dS[j] = P[j] * (dp * z - D);
          }
          T* gqr = &gq[p.qi(bi, i, hi)];
          const double* qr = &q[p.qi(bi, i, hi)];
          for (int64_t j = 0; j < p.sk; ++j) {
            if (dS[j] == T(0)) continue;
            const double* kr = &k[p.ki(bi, j, hki)];
            T* gkr = &gk[p.ki(bi, j, hki)];
            for (int64_t c = 0; c < p.d; ++c) {
              gqr[c] += scale * dS[j] * static_cast<T>(kr[c]);
              gkr[c] += scale * dS[j] * static_cast<T>(qr[c]);
            }
          }
        }
      }
    auto finish = [dt](const std::vector<T>& g, std::vector<double>& o) {
      o.resize(g.size());
      for (size_t i = 0; i < g.size(); ++i) o[i] = round_to(static_cast<double>(g[i]), dt);
    };
    finish(gq, dq);
    finish(gk, dk);
    finish(gv, dv);
  }
};

}  // namespace flashdl_test
