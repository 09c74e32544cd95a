// The block-sparse side of the CUDA tests: block masks in every layout the core accepts (rank 2,
// per (batch, head) planes, size-1 and stride-0 broadcasts, padded rows), the naive forward and
// backward "in the input precision" of the tolerance rule with such a mask, and the rows and keys
// the mask leaves without any score. Arrays are logical contiguous as in backward_oracle.hpp: q,
// out, dq (b, sq, h, d); k, v, dk, dv (b, sk, hk, d); lse (b, h, sq).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backward_oracle.hpp"
#include "cuda_harness.hpp"
#include "flashdl/tensor.hpp"

namespace cuda_test::block_sparse {

// shared: (nbq, nbk); full: (b, h, nbq, nbk); heads: (1, h, ...); batch: (b, 1, ...);
// stride0: (b, h, ...) with a head stride of 0 (what torch's expand gives); strided: (b, h, ...)
// stored head-major with rows of nbk + 3 (every stride differs from the contiguous one).
enum class MaskKind { shared, full, heads, batch, stride0, strided };

inline const char* mask_kind_name(MaskKind k) {
  switch (k) {
    case MaskKind::shared: return "(nbq,nbk)";
    case MaskKind::full: return "(b,h)";
    case MaskKind::heads: return "(1,h)";
    case MaskKind::batch: return "(b,1)";
    case MaskKind::stride0: return "(b,h)/head-stride-0";
    case MaskKind::strided: return "(b,h)/strided";
  }
  return "?";
}

// A block mask: its bytes in their layout, and the TensorView the library is given over them.
struct HostMask {
  int64_t bq = 1, bk = 1;
  int rank = 2;
  int64_t shape[4] = {}, strides[4] = {};
  std::vector<uint8_t> bytes;

  bool block(int64_t b, int64_t h, int64_t qb, int64_t kb) const {
    if (rank == 2) return bytes[size_t(qb * strides[0] + kb * strides[1])] != 0;
    const int64_t bi = shape[0] == 1 ? 0 : b, hi = shape[1] == 1 ? 0 : h;
    const int64_t off = bi * strides[0] + hi * strides[1] + qb * strides[2] + kb * strides[3];
    return bytes[size_t(off)] != 0;
  }
  bool visible(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return block(b, h, i / bq, j / bk);
  }
  flashdl::TensorView view(void* data, flashdl::Device device) const {
    flashdl::TensorView t;
    t.data = data;
    t.dtype = flashdl::DType::boolean;
    t.device = device;
    t.rank = rank;
    for (int i = 0; i < rank; ++i) {
      t.shape[i] = shape[i];
      t.strides[i] = strides[i];
    }
    return t;
  }
};

// The mask of `kind` over (sq, sk) in blocks of (bq, bk); flag(b, h, qb, kb) says whether a block
// is set (called with b or h = 0 where the layout broadcasts that dimension).
template <typename Flag>
HostMask make_mask(MaskKind kind, int64_t b, int64_t h, int64_t sq, int64_t sk, int64_t bq,
                   int64_t bk, Flag flag) {
  HostMask m;
  m.bq = bq;
  m.bk = bk;
  const int64_t nbq = (sq + bq - 1) / bq, nbk = (sk + bk - 1) / bk;
  const int64_t lb = kind == MaskKind::heads ? 1 : b;
  const int64_t lh = kind == MaskKind::batch ? 1 : h;
  if (kind == MaskKind::shared) {
    m.rank = 2;
    m.shape[0] = nbq, m.shape[1] = nbk;
    m.strides[0] = nbk, m.strides[1] = 1;
    m.bytes.assign(size_t(nbq * nbk), 0);
  } else {
    m.rank = 4;
    m.shape[0] = lb, m.shape[1] = lh, m.shape[2] = nbq, m.shape[3] = nbk;
    const int64_t row = kind == MaskKind::strided ? nbk + 3 : nbk, plane = nbq * row;
    m.strides[2] = row, m.strides[3] = 1;
    if (kind == MaskKind::strided) {
      m.strides[0] = plane, m.strides[1] = lb * plane;
    } else if (kind == MaskKind::stride0) {
      m.strides[0] = plane, m.strides[1] = 0;
    } else {
      m.strides[0] = lh * plane, m.strides[1] = plane;
    }
    const int64_t planes = kind == MaskKind::stride0 ? lb : lb * lh;
    m.bytes.assign(size_t(planes * plane), 0);
  }
  const bool head_broadcast = kind == MaskKind::stride0 || kind == MaskKind::batch;
  for (int64_t bi = 0; bi < (m.rank == 2 ? 1 : lb); ++bi)
    for (int64_t hi = 0; hi < (m.rank == 2 ? 1 : lh); ++hi)
      for (int64_t qb = 0; qb < nbq; ++qb)
        for (int64_t kb = 0; kb < nbk; ++kb) {
          const int64_t off = m.rank == 2
                                  ? qb * m.strides[0] + kb
                                  : bi * m.strides[0] + hi * m.strides[1] + qb * m.strides[2] + kb;
          m.bytes[size_t(off)] = flag(bi, head_broadcast ? 0 : hi, qb, kb) ? 1 : 0;
        }
  return m;
}

// Key j visible to query i of (batch b, head h): the window (causal) and the block mask.
struct Visibility {
  const Shape& s;
  const HostMask& m;
  bool operator()(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return s.visible(i, j) && m.visible(b, h, i, j);
  }
};

// backward_oracle.hpp's naive_lowp_backward with the mask, and the forward of cuda_harness.hpp's
// naive_lowp: float math from the 16-bit values, P rounded to `dt` before P V and P^T dO, dS
// rounded before dS K and dS^T Q, float accumulation, results rounded to `dt`. `out` is the
// saved output the backward reads (16-bit values); the forward's result goes to `fwd`. mods: the
// score modifiers (cuda_harness.hpp), or null.
inline Grads naive_lowp(const Shape& s, const Visibility& vis, const BwdInputs& in,
                        const std::vector<float>& out, flashdl::DType dt, std::vector<double>& fwd,
                        const ScoreMods* mods = nullptr) {
  const auto nq = size_t(s.b * s.sq * s.h * s.d), nk = size_t(s.b * s.sk * s.hk * s.d);
  std::vector<float> gq(nq, 0.0f), gk(nk, 0.0f), gv(nk, 0.0f), p(size_t(s.sk)), g(size_t(s.sk)),
      acc(size_t(s.d));
  fwd.assign(nq, 0.0);
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
          if (!vis(bi, hi, i, j)) continue;
          const float* kr = &in.k[size_t(((bi * s.sk + j) * s.hk + hk) * s.d)];
          float dot = 0.0f;
          for (int64_t c = 0; c < s.d; ++c) dot += qr[c] * kr[c];
          p[j] = mods ? mods->score(dot * scale, bi, hi, i + s.sk - s.sq - j) : dot * scale;
          g[j] = mods ? mods->grad(dot * scale) : 1.0f;
          m = std::fmax(m, p[j]);
        }
        if (m == -INFINITY) continue;  // empty row: out 0, no gradient anywhere
        float l = 0.0f, D = 0.0f;
        for (int64_t j = 0; j < s.sk; ++j) l += (p[j] = std::exp(p[j] - m));
        for (int64_t c = 0; c < s.d; ++c) D += dor[c] * orow[c];
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < s.sk; ++j) {
          if (!vis(bi, hi, i, j)) continue;
          const size_t ko = size_t(((bi * s.sk + j) * s.hk + hk) * s.d);
          const float *kr = &in.k[ko], *vr = &in.v[ko];
          const float pr = round_to(p[j] / l, dt);
          float dp = 0.0f;
          for (int64_t c = 0; c < s.d; ++c) dp += dor[c] * vr[c];
          const float ds = round_to(pr * (dp - D) * g[j], dt);
          for (int64_t c = 0; c < s.d; ++c) {
            acc[c] += pr * vr[c];
            gv[ko + c] += pr * dor[c];
            gk[ko + c] += ds * qr[c];
            gq[qo + c] += ds * kr[c];
          }
        }
        for (int64_t c = 0; c < s.d; ++c) fwd[qo + c] = round_to(acc[c], dt);
      }
    }
  auto finish = [&](const std::vector<float>& g, float factor) {
    std::vector<double> r(g.size());
    for (size_t i = 0; i < g.size(); ++i) r[i] = round_to(factor * g[i], dt);
    return r;
  };
  return Grads{finish(gq, scale), finish(gk, scale), finish(gv, 1.0f)};
}

// Where the results must be exactly zero: rows (b, h, i) that see no key (out, dq; lse -inf) and
// keys (b, hk, j) that no query of the kv head's group sees (dk, dv).
struct Dead {
  std::vector<char> rows, keys;
};

inline Dead dead_of(const Shape& s, const Visibility& vis) {
  Dead z{std::vector<char>(size_t(s.b * s.h * s.sq), 1),
         std::vector<char>(size_t(s.b * s.hk * s.sk), 1)};
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t h = 0; h < s.h; ++h)
      for (int64_t i = 0; i < s.sq; ++i)
        for (int64_t j = 0; j < s.sk; ++j)
          if (vis(b, h, i, j)) {
            z.rows[size_t((b * s.h + h) * s.sq + i)] = 0;
            z.keys[size_t((b * s.hk + h / (s.h / s.hk)) * s.sk + j)] = 0;
          }
  return z;
}

// Non-zero elements of a logical (b, n, heads, d) array in the flagged (b, head, n) rows.
inline int64_t nonzero_in(const std::vector<double>& x, int64_t b, int64_t n, int64_t heads,
                          int64_t d, const std::vector<char>& flagged) {
  int64_t count = 0;
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t hi = 0; hi < heads; ++hi) {
        if (!flagged[size_t((bi * heads + hi) * n + r)]) continue;
        const double* row = &x[size_t(((bi * n + r) * heads + hi) * d)];
        for (int64_t c = 0; c < d; ++c) count += row[c] != 0.0;
      }
  return count;
}

}  // namespace cuda_test::block_sparse
