// The backward's oracles for the CUDA tests: the float64 reference (the library's own
// Schedule::reference on float64 host arrays), the naive backward "in the input precision" of the
// tolerance rule, the rule itself, and the rows and keys the mask leaves without any score, whose
// gradients must be exactly zero. Arrays are logical contiguous: q, out, dout, dq (b, sq, h, d);
// k, v, dk, dv (b, sk, hk, d); lse (b, h, sq).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda_harness.hpp"
#include "flashdl/api.hpp"

namespace cuda_test {

// One problem's inputs, each value exact in float16 and bfloat16.
struct BwdInputs {
  std::vector<float> q, k, v, dout;
};

// The float64 reference: the forward's out and lse (the saved tensors) and, when asked, the
// gradients computed from that (unrounded) out.
struct BwdOracle {
  std::vector<double> out;
  std::vector<float> lse;
  std::vector<double> dq, dk, dv;
};

// `o` carries the mask (causal, window); the schedule is forced to the float64 reference.
inline BwdOracle reference_backward(const Shape& s, flashdl::Options o, const BwdInputs& in,
                                    bool with_grads) {
  using flashdl::DType;
  using flashdl::make_view;
  o.schedule = flashdl::Schedule::reference;
  const std::vector<double> q(in.q.begin(), in.q.end()), k(in.k.begin(), in.k.end()),
      v(in.v.begin(), in.v.end()), dout(in.dout.begin(), in.dout.end());
  const auto nq = size_t(s.b * s.sq * s.h * s.d), nk = size_t(s.b * s.sk * s.hk * s.d);
  BwdOracle r{std::vector<double>(nq), std::vector<float>(size_t(s.b * s.h * s.sq)), {}, {}, {}};
  // make_view takes a mutable pointer; the library never writes its inputs.
  auto in_view = [](const std::vector<double>& x, std::initializer_list<int64_t> shape) {
    return make_view(const_cast<double*>(x.data()), DType::float64, shape);
  };
  const auto qv = in_view(q, {s.b, s.sq, s.h, s.d}), kv = in_view(k, {s.b, s.sk, s.hk, s.d}),
             vv = in_view(v, {s.b, s.sk, s.hk, s.d});
  const auto lse = make_view(r.lse.data(), DType::float32, {s.b, s.h, s.sq});
  const auto out = make_view(r.out.data(), DType::float64, {s.b, s.sq, s.h, s.d});
  flashdl::forward(qv, kv, vv, out, lse, o);
  if (!with_grads) return r;
  r.dq.assign(nq, 0.0);
  r.dk.assign(nk, 0.0);
  r.dv.assign(nk, 0.0);
  flashdl::backward(in_view(dout, {s.b, s.sq, s.h, s.d}), qv, kv, vv, out, lse,
                    make_view(r.dq.data(), DType::float64, {s.b, s.sq, s.h, s.d}),
                    make_view(r.dk.data(), DType::float64, {s.b, s.sk, s.hk, s.d}),
                    make_view(r.dv.data(), DType::float64, {s.b, s.sk, s.hk, s.d}), o);
  return r;
}

struct Grads {
  std::vector<double> dq, dk, dv;
};

// The backward as a framework's half-precision attention computes it: float math from the 16-bit
// values; P (softmax in float) rounded to `dt` before dV = P^T dO; dP = dO V^T in float;
// dS = P (dP - D) with D = rowsum(dO out) (out as the caller saved it, 16-bit) rounded to `dt`
// before dK = scale dS^T Q and dQ = scale dS K; float accumulation (over the query heads of a
// group too), results rounded to `dt`. mods: the score modifiers (dS then carries the softcap's
// derivative before the rounding), or null.
inline Grads naive_lowp_backward(const Shape& s, const BwdInputs& in, const std::vector<float>& out,
                                 flashdl::DType dt, const ScoreMods* mods = nullptr) {
  const auto nq = size_t(s.b * s.sq * s.h * s.d), nk = size_t(s.b * s.sk * s.hk * s.d);
  std::vector<float> gq(nq, 0.0f), gk(nk, 0.0f), gv(nk, 0.0f), p(size_t(s.sk)), g(size_t(s.sk));
  const float scale = 1.0f / std::sqrt(float(s.d));
  for (int64_t bi = 0; bi < s.b; ++bi)
    for (int64_t hi = 0; hi < s.h; ++hi) {
      const int64_t hk = hi / (s.h / s.hk);
      for (int64_t i = 0; i < s.sq; ++i) {
        const size_t qo = size_t(((bi * s.sq + i) * s.h + hi) * s.d);
        const float *qr = &in.q[qo], *dor = &in.dout[qo], *orow = &out[qo];
        float m = -INFINITY;
        for (int64_t j = 0; j < s.sk; ++j) {
          p[j] = -INFINITY;
          if (!s.visible(i, j)) continue;
          const float* kr = &in.k[size_t(((bi * s.sk + j) * s.hk + hk) * s.d)];
          float dot = 0.0f;
          for (int64_t c = 0; c < s.d; ++c) dot += qr[c] * kr[c];
          p[j] = mods ? mods->score(dot * scale, bi, hi, i + s.sk - s.sq - j) : dot * scale;
          g[j] = mods ? mods->grad(dot * scale) : 1.0f;
          m = std::fmax(m, p[j]);
        }
        if (m == -INFINITY) continue;  // empty row: no gradient anywhere
        float l = 0.0f, D = 0.0f;
        for (int64_t j = 0; j < s.sk; ++j) l += (p[j] = std::exp(p[j] - m));
        for (int64_t c = 0; c < s.d; ++c) D += dor[c] * orow[c];
        float* dq = &gq[qo];
        for (int64_t j = 0; j < s.sk; ++j) {
          if (!s.visible(i, j)) continue;
          const size_t ko = size_t(((bi * s.sk + j) * s.hk + hk) * s.d);
          const float *kr = &in.k[ko], *vr = &in.v[ko];
          const float pr = round_to(p[j] / l, dt);
          float dp = 0.0f;
          for (int64_t c = 0; c < s.d; ++c) dp += dor[c] * vr[c];
          const float ds = round_to(pr * (dp - D) * g[j], dt);
          float *dk = &gk[ko], *dv = &gv[ko];
          for (int64_t c = 0; c < s.d; ++c) {
            dv[c] += pr * dor[c];
            dk[c] += ds * qr[c];
            dq[c] += ds * kr[c];
          }
        }
      }
    }
  auto finish = [&](const std::vector<float>& g, float factor) {
    std::vector<double> r(g.size());
    for (size_t i = 0; i < g.size(); ++i) r[i] = round_to(factor * g[i], dt);
    return r;
  };
  return Grads{finish(gq, scale), finish(gk, scale), finish(gv, 1.0f)};
}

// flash-attn's rule for gradients: max|got - ref| <= 3 max|lowp - ref| + eps, with eps 1e-3
// (float16) or 8e-3 (bfloat16) times max(1, max|ref|) since gradients are not of order one.
struct GradError {
  double err, tol;
  bool ok() const { return err <= tol; }
};

inline GradError grad_error(const std::vector<double>& got, const std::vector<double>& ref,
                            const std::vector<double>& lowp, flashdl::DType dt) {
  double ref_max = 1.0;
  for (double x : ref) ref_max = std::max(ref_max, std::fabs(x));
  const double eps = (dt == flashdl::DType::float16 ? 1e-3 : 8e-3) * ref_max;
  return GradError{max_abs_diff(got, ref), 3.0 * max_abs_diff(lowp, ref) + eps};
}

// Query rows with no visible key (their dq must be exactly 0) and keys that no query sees (their
// dk and dv must be exactly 0). With no block mask, visibility depends on (i, j) alone.
inline std::vector<char> empty_rows(const Shape& s) {
  std::vector<char> r(size_t(s.sq), 1);
  for (int64_t i = 0; i < s.sq; ++i)
    for (int64_t j = 0; j < s.sk && r[i]; ++j) r[i] = !s.visible(i, j);
  return r;
}

inline std::vector<char> unseen_keys(const Shape& s) {
  std::vector<char> r(size_t(s.sk), 1);
  for (int64_t j = 0; j < s.sk; ++j)
    for (int64_t i = 0; i < s.sq && r[j]; ++i) r[j] = !s.visible(i, j);
  return r;
}

// Elements of a logical (b, n, heads, d) array whose row (index along n) is flagged and whose
// value is not exactly zero.
inline int64_t nonzero_in_flagged(const std::vector<double>& x, int64_t heads, int64_t d,
                                  const std::vector<char>& flagged) {
  const int64_t n = int64_t(flagged.size());
  int64_t count = 0;
  for (size_t e = 0; e < x.size(); ++e)
    count += flagged[size_t((int64_t(e) / (heads * d)) % n)] && x[e] != 0.0;
  return count;
}

}  // namespace cuda_test
