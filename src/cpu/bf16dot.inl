// bfloat16 products on CPUs with AVX512_BF16 (compiled only into that copy, isa_avx512bf16.cpp):
// vdpbf16ps multiplies pairs of bfloat16 and adds both products into a float32 lane, twice the
// multiply-adds of a float32 FMA per instruction, with no widening of the operands.
//
// Operands are held as 32-bit words, each a pair of bfloat16 along the product's inner dimension
// (the lower half the even index): A rows of pairs, B rows of pairs by columns. The fa2 forward
// (fa2.inl) uses it for bfloat16 inputs: S = Q K^T on the caller's bfloat16 values (exact), and
// O += P V with P rounded to bfloat16 (round to nearest even), as GPU kernels do; l, the row sums,
// stay those of the float32 P. Accumulation is float32 throughout.

constexpr int kNRb = 32;  // C columns per micro-kernel tile: two vectors of 16 float32

// What micro_kernel_bf16 does with a finished C tile, row by row (c0: columns 0-15, c1: 16-31).
// StoreTile: C = (or +=) the tile, C[r] at C + r * ldc.
template <bool Accumulate>
struct StoreTile {
  float* C;
  int64_t ldc;
  void operator()(int r, __m512 c0, __m512 c1) const {
    float* row = C + r * ldc;
    if (Accumulate) {
      c0 = _mm512_add_ps(c0, _mm512_loadu_ps(row));
      c1 = _mm512_add_ps(c1, _mm512_loadu_ps(row + 16));
    }
    _mm512_storeu_ps(row, c0);
    _mm512_storeu_ps(row + 16, c1);
  }
};

// The tile's products against A[kMR x 2kp] B[2kp x 32] handed to `epi` (StoreTile, or the fa2
// forward's ExpTile): A row r is kp words at A + r * lda (TransA: word p of row r at
// A + p * lda + r), B row p (pair p) 32 words at B + p * ldb.
template <bool TransA, typename Epilogue>
inline void micro_kernel_bf16(int64_t kp, const uint32_t* __restrict A, int64_t lda,
                              const uint32_t* __restrict B, int64_t ldb, Epilogue&& epi) {
  __m512 c0[kMR], c1[kMR];
#pragma GCC unroll 6
  for (int r = 0; r < kMR; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(B + p * ldb);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(B + p * ldb + 16);
#pragma GCC unroll 6
    for (int r = 0; r < kMR; ++r) {
      const uint32_t w = TransA ? A[p * lda + r] : A[r * lda + p];
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
      c0[r] = _mm512_dpbf16_ps(c0[r], a, b0);
      c1[r] = _mm512_dpbf16_ps(c1[r], a, b1);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kMR; ++r) epi(r, c0[r], c1[r]);
}

// C[m x n] (+)= A[m x 2kp] B[2kp x n] in words as above; m % kMR == 0, n % 32 == 0.
template <bool TransA, bool Accumulate>
void gemm_bf16(int64_t m, int64_t n, int64_t kp, const uint32_t* A, int64_t lda, const uint32_t* B,
               int64_t ldb, float* C, int64_t ldc) {
  for (int64_t j = 0; j < n; j += kNRb)
    for (int64_t i = 0; i < m; i += kMR)
      micro_kernel_bf16<TransA>(kp, TransA ? A + i : A + i * lda, lda, B + j, ldb,
                                StoreTile<Accumulate>{C + i * ldc + j, ldc});
}

// A bfloat16 row of d values as ceil(d / 2) words of pairs (elements 2w, 2w + 1; the half past
// the end 0), zero-filled to n words: on a little-endian CPU the pairs are the row's own bytes.
inline void row_pairs(const uint16_t* row, int64_t d, uint32_t* dst, int64_t n) {
  std::memcpy(dst, row, static_cast<size_t>(d / 2) * 4);
  int64_t w = d / 2;
  if (d % 2) dst[w++] = row[d - 1];
  std::fill(dst + w, dst + n, 0u);
}

// P (float rows of ld, mp x np, np % 32 == 0) rounded to bfloat16 pairs along the keys: Pw row r
// has np / 2 words at Pw + r * ldw.
inline void round_pairs(const float* P, int64_t ld, int64_t mp, int64_t np, uint32_t* Pw,
                        int64_t ldw) {
  for (int64_t r = 0; r < mp; ++r)
    for (int64_t j = 0; j < np; j += 32) {
      const __m512 lo = _mm512_loadu_ps(P + r * ld + j), hi = _mm512_loadu_ps(P + r * ld + j + 16);
      _mm512_storeu_si512(Pw + r * ldw + j / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// Pairs of rows: dst[ip * ldd + c] = (X[2ip][c], X[2ip + 1][c]) rounded to bfloat16, for
// ip < pairs and c < n (n % 16 == 0); rows from `rows` on count as zeros.
inline void pair_rows(const float* X, int64_t ldx, int64_t rows, int64_t pairs, int64_t n,
                      uint32_t* dst, int64_t ldd) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19,
                                                           4,  20, 5,  21, 6,  22, 7,  23,
                                                           8,  24, 9,  25, 10, 26, 11, 27,
                                                           12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kInterleave);
  for (int64_t ip = 0; ip < pairs; ++ip) {
    const float* x0 = 2 * ip < rows ? X + 2 * ip * ldx : nullptr;
    const float* x1 = 2 * ip + 1 < rows ? X + (2 * ip + 1) * ldx : nullptr;
    for (int64_t c = 0; c < n; c += 16) {
      const __m512 a = x0 ? _mm512_loadu_ps(x0 + c) : _mm512_setzero_ps();
      const __m512 b = x1 ? _mm512_loadu_ps(x1 + c) : _mm512_setzero_ps();
      const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a's 16 values, then b's
      _mm512_storeu_si512(dst + ip * ldd + c, _mm512_permutexvar_epi16(idx, v));
    }
  }
}

// K^T-style pairs along the head dim of bfloat16 rows: dst[w * ld + j] = row j's elements 2w
// and 2w + 1 (low half first; an odd head dim's last element with 0), for w < ceil(d / 2) and
// j < ld; zeros past `rows` rows. A row's pairs are its own bytes (row_pairs), so blocks of W
// rows by W pairs are W x W transposes of 32-bit words in registers (transpose_lanes moves bits,
// whatever they mean as floats); pairs past the last whole block word by word. (A row copy per
// key and a store per pair were most of a pack.)
inline void pack_pairs_by_dim(const uint16_t* src, int64_t stride, int64_t rows, int64_t d,
                              uint32_t* dst, int64_t ld) {
  constexpr int64_t W = Simd<float>::W;
  std::fill(dst, dst + (d + 1) / 2 * ld, 0u);
  const int64_t whole = d / 2, wb = whole / W * W;  // pairs read as words; those in blocks
  for (int64_t j0 = 0; j0 < rows; j0 += W) {
    const int64_t nr = std::min(W, rows - j0);
    for (int64_t w0 = 0; w0 < wb; w0 += W) {
      vec_t<float> r[W];
      for (int64_t i = 0; i < W; ++i)
        r[i] = i < nr ? vload(reinterpret_cast<const float*>(src + (j0 + i) * stride + 2 * w0))
                      : vec_t<float>{};
      transpose_lanes<float>(r);
      for (int64_t c = 0; c < W; ++c)
        vstore(reinterpret_cast<float*>(dst + (w0 + c) * ld + j0), r[c]);
    }
  }
  for (int64_t j = 0; j < rows; ++j) {
    const uint16_t* row = src + j * stride;
    for (int64_t w = wb; w < whole; ++w) std::memcpy(dst + w * ld + j, row + 2 * w, 4);
    if (d % 2) dst[whole * ld + j] = row[d - 1];
  }
}

// Pairs of bfloat16 rows: dst[pr * ld + c] = (row 2 pr, row 2 pr + 1) at element c (low half
// first), for pr < pairs and c < ld; zeros past `rows` rows and d columns.
inline void pack_pairs_by_rows(const uint16_t* src, int64_t stride, int64_t rows, int64_t d,
                               int64_t pairs, uint32_t* dst, int64_t ld) {
  for (int64_t pr = 0; pr < pairs; ++pr) {
    uint32_t* row = dst + pr * ld;
    const int64_t j = 2 * pr;
    if (j + 1 < rows) {
      const uint16_t* v0 = src + j * stride;
      const uint16_t* v1 = v0 + stride;
      for (int64_t c = 0; c < d; ++c) row[c] = uint32_t{v0[c]} | (uint32_t{v1[c]} << 16);
    } else if (j < rows) {
      const uint16_t* v0 = src + j * stride;
      for (int64_t c = 0; c < d; ++c) row[c] = v0[c];
    } else {
      std::fill(row, row + d, 0u);
    }
    std::fill(row + d, row + ld, 0u);
  }
}

// The backward's products (BackwardProducts in blocks.inl) for bfloat16 inputs: S = Q K^T and
// dP = dO V^T on the inputs' own values (exact), dV += P^T dO, dK += dS^T Q and dQ += dS K with P
// and dS rounded to bfloat16, as GPU kernels do. keys() converts a key tile once, queries() the
// query rows of each step.
struct Bf16BackwardProducts {
  static constexpr bool kBf16Pairs = true;  // for redo_nonfinite_rows (blocks.inl)
  mutable Buffer<uint32_t> ktw, vtw, ki, qw, dow, qi, doi, a;
  int64_t kd = 0, dw = 0;

  // Keys [j0, j0 + cols) of (b, hk), packed from the caller's bfloat16 rows: K^T and V^T as pairs
  // along the head dim, K as pairs of keys (as the forward packs K^T and V; converting to float
  // K, K^T and V^T first and pairing those was a sixth of a 16 x 2,048 backward).
  void keys(const Params& p, const Geometry<float>& g, int64_t b, int64_t hk, int64_t j0,
            int64_t cols) {
    kd = (g.d + 1) / 2;
    dw = g.dp / 2;
    const auto* k = static_cast<const uint16_t*>(p.k_ptr) + k_offset(p, b, j0, hk);
    const auto* v = static_cast<const uint16_t*>(p.v_ptr) + v_offset(p, b, j0, hk);
    prefetch_rows(k, p.k_row_stride * 2, cols, g.d * 2);
    prefetch_rows(v, p.v_row_stride * 2, cols, g.d * 2);
    pack_pairs_by_dim(k, p.k_row_stride, cols, g.d, ktw.get(kd * g.Bcp), g.Bcp);
    pack_pairs_by_dim(v, p.v_row_stride, cols, g.d, vtw.get(kd * g.Bcp), g.Bcp);
    pack_pairs_by_rows(k, p.k_row_stride, cols, g.d, g.Bcp / 2, ki.get(g.Bcp / 2 * g.dp), g.dp);
  }
  // Q and dO, t.mp rows of dp (zeros past the tile's rows).
  void queries(const Geometry<float>& g, const TilePair& t, const float* Q, const float* dO) {
    kd = (g.d + 1) / 2;  // set here too: callers may convert queries before keys
    dw = g.dp / 2;
    round_pairs(Q, g.dp, t.mp, g.dp, qw.get(g.Brp * dw), dw);
    round_pairs(dO, g.dp, t.mp, g.dp, dow.get(g.Brp * dw), dw);
    pair_rows(Q, g.dp, t.mp, t.mp / 2, g.dp, qi.get(g.Brp / 2 * g.dp), g.dp);
    pair_rows(dO, g.dp, t.mp, t.mp / 2, g.dp, doi.get(g.Brp / 2 * g.dp), g.dp);
  }

  void scores(const Geometry<float>& g, const TilePair& t, float* S) const {
    gemm_bf16<false, false>(t.mp, t.np, kd, qw.data.data(), dw, ktw.data.data(), g.Bcp, S, g.Bcp);
  }
  void dp(const Geometry<float>& g, const TilePair& t, float* dP) const {
    gemm_bf16<false, false>(t.mp, t.np, kd, dow.data.data(), dw, vtw.data.data(), g.Bcp, dP, g.Bcp);
  }
  // X^T Y for X = P or dS (t.mp x nm, in rows of Bcp), Y = dO or Q as row pairs: C += ...
  void transposed(const Geometry<float>& g, const TilePair& t, const float* X, const uint32_t* Y,
                  float* C) const {
    const int64_t n16 = detail::round_up(t.nm, int64_t{16});
    uint32_t* xt = a.get(g.Brp / 2 * g.Bcp);
    pair_rows(X, g.Bcp, t.mp, t.mp / 2, n16, xt, g.Bcp);
    gemm_bf16<true, true>(t.nm, g.dp, t.mp / 2, xt, g.Bcp, Y, g.dp, C, g.dp);
  }
  void dv(const Geometry<float>& g, const TilePair& t, const float* Pd, float* dV) const {
    transposed(g, t, Pd, doi.data.data(), dV);
  }
  void dk(const Geometry<float>& g, const TilePair& t, const float* dS, float* dK) const {
    transposed(g, t, dS, qi.data.data(), dK);
  }
  void dq(const Geometry<float>& g, const TilePair& t, const float* dS, float* dQ) const {
    uint32_t* w = a.get(g.Brp * (g.Bcp / 2));
    round_pairs(dS, g.Bcp, t.mp, t.np, w, g.Bcp / 2);
    gemm_bf16<false, true>(t.mp, g.dp, t.np / 2, w, g.Bcp / 2, ki.data.data(), g.dp, dQ, g.dp);
  }
};

// The fa2 forward's products for bfloat16 inputs (see Products in fa2.inl for the interface).
// Q rows as pairs along the head dim (Brp x dw words, dw = dp / 2); per (b, kv head), tile by
// tile as PackedKV does, K^T as pairs along the head dim (kd = ceil(d / 2) rows of Bcp words) and
// V as pairs of keys (Bcp / 2 rows of dp words); zeros in every padding.
struct Bf16Products {
  static constexpr bool kBf16Pairs = true;  // for redo_nonfinite_rows (blocks.inl)
  // A (batch, kv head)'s packed K^T and V; `heads` places as PackedKV's (fa2.inl).
  struct Head {
    Buffer<uint32_t> ktw, vw;
    std::vector<char> packed;
    int64_t key = -1;
  };
  std::vector<Head> heads = std::vector<Head>(1);
  Head* cur = nullptr;
  Buffer<uint32_t> qw, pw;
  int64_t b = 0, hk = 0;
  const uint32_t* V = nullptr;
  // Q's first q_rows rows read in place from the caller's array (rows of q_ld words), the rest
  // from qw (see start()); q_rows = 0: all from qw.
  const uint32_t* q_in = nullptr;
  int64_t q_ld = 0, q_rows = 0;

  static int64_t dw(const Geometry<float>& g) { return g.dp / 2; }
  static int64_t kd(const Geometry<float>& g) { return (g.d + 1) / 2; }

  void slots(int64_t n) {
    if (static_cast<int64_t>(heads.size()) != n) heads.assign(static_cast<size_t>(n), Head{});
  }
  // PackedKV's (fa2.inl): a new call invalidates every packed head; memory over `bytes` goes back.
  void forget() {
    for (Head& h : heads) h.key = -1;
  }
  void release_if_over(int64_t bytes) {
    int64_t held = 0;
    for (const Head& h : heads)
      held += static_cast<int64_t>((h.ktw.data.capacity() + h.vw.data.capacity()) * 4);
    if (held > bytes) heads = std::vector<Head>(heads.size());
  }
  void start(const Params& p, const Geometry<float>& g, int64_t b_, int64_t h, int64_t hk_,
             int64_t i0, int64_t rows) {
    const int64_t k = b_ * p.nheads_kv + hk_;
    b = b_;
    hk = hk_;
    cur = &heads[static_cast<size_t>(hk_) % heads.size()];
    if (k != cur->key) {
      cur->key = k;
      cur->ktw.get(g.nkb * kd(g) * g.Bcp);
      cur->vw.get(g.nkb * (g.Bcp / 2) * g.dp);
      cur->packed.assign(static_cast<size_t>(g.nkb), 0);
    }
    uint32_t* Q = qw.get(g.Brp * dw(g));
    const auto* src = static_cast<const uint16_t*>(p.q_ptr) + q_offset(p, b_, i0, h);
    prefetch_rows(src, p.q_row_stride * 2, rows, g.d * 2);
    // With one key tile, S = Q K^T reads each query row once, as the conversion to pairs would:
    // the whole micro-kernel blocks of rows are read in place, their pairs being the rows' own
    // bytes (even head dim, rows 4-byte aligned), and only the last block's rows are copied with
    // their zero padding. A copy per row was a fifth of the 16,384 x 16 forward, memory-bound.
    // With more key tiles the rows are read once per tile, and in place, 1 KiB apart, they would
    // share a few L1 sets.
    const bool in_place = g.nkb == 1 && g.d % 2 == 0 && p.q_row_stride % 2 == 0 &&
                          reinterpret_cast<uintptr_t>(src) % 4 == 0;
    q_rows = in_place ? rows / kMR * kMR : 0;
    q_in = reinterpret_cast<const uint32_t*>(src);
    q_ld = p.q_row_stride / 2;
    for (int64_t r = q_rows; r < rows; ++r)
      row_pairs(src + r * p.q_row_stride, g.d, Q + (r - q_rows) * dw(g), dw(g));
    std::fill(Q + (rows - q_rows) * dw(g), Q + g.Brp * dw(g), 0u);
  }

  void pack(const Params& p, const Geometry<float>& g, int64_t kt) {
    const int64_t j0 = g.kt.start(kt), cols = g.kt.size(kt);
    uint32_t* Kt = cur->ktw.data.data() + kt * kd(g) * g.Bcp;
    uint32_t* Vp = cur->vw.data.data() + kt * (g.Bcp / 2) * g.dp;
    const auto* k = static_cast<const uint16_t*>(p.k_ptr) + k_offset(p, b, j0, hk);
    const auto* v = static_cast<const uint16_t*>(p.v_ptr) + v_offset(p, b, j0, hk);
    prefetch_rows(k, p.k_row_stride * 2, cols, g.d * 2);
    prefetch_rows(v, p.v_row_stride * 2, cols, g.d * 2);
    pack_pairs_by_dim(k, p.k_row_stride, cols, g.d, Kt, g.Bcp);
    pack_pairs_by_rows(v, p.v_row_stride, cols, g.d, g.Bcp / 2, Vp, g.dp);
    cur->packed[kt] = 1;
  }

  // Key tile kt's K^T pairs, packed on first use; V set to its value pairs.
  const uint32_t* key_tile(const Params& p, const Geometry<float>& g, int64_t kt) {
    if (!cur->packed[kt]) pack(p, g, kt);
    V = cur->vw.data.data() + kt * (g.Bcp / 2) * g.dp;
    return cur->ktw.data.data() + kt * kd(g) * g.Bcp;
  }

  void scores(const Params& p, const Geometry<float>& g, int64_t kt, const TilePair& t, float* S) {
    const uint32_t* Kt = key_tile(p, g, kt);
    if (q_rows > 0) gemm_bf16<false, false>(q_rows, t.np, kd(g), q_in, q_ld, Kt, g.Bcp, S, g.Bcp);
    if (t.mp > q_rows)
      gemm_bf16<false, false>(t.mp - q_rows, t.np, kd(g), qw.data.data(), dw(g), Kt, g.Bcp,
                              S + q_rows * g.Bcp, g.Bcp);
  }

  // The epilogue of scores_exp: a row's scores s to P = exp2(c s + log2(e) bias - ref[r]) as
  // bfloat16 pairs (round_pairs' layout and bits) at Pw + r * ldw, their float lanes added to
  // sums + 16 r (stored where `first`), and over[r] set where some exponent passes kStaleSlack or
  // is NaN. Bias: void (none), uint16_t (bfloat16) or float, 32 values of row r at
  // bias + r * bias_ld (rows from bias_rows on: the last one's, for padding rows).
  // kOwnMax (a row's first tile, no bias, the whole row in one block of 32 columns): ref[r] is
  // the row's own max (columns from `valid` on at -inf) times c, computed here and written to
  // own_ref[r].
  template <typename Bias, bool kOwnMax = false>
  struct ExpTile {
    __m512 vc;
    const float* ref;
    uint32_t* Pw;
    int64_t ldw;
    float* sums;
    uint8_t* over;
    bool first;
    const Bias* bias;
    int64_t bias_ld, bias_rows;
    float* own_ref;
    __mmask16 valid0, valid1;

    // c s - ref, then + log2(e) bias: a zero bias gives the plain tile's exponents bit for bit.
    __m512 exponent(int r, int half, __m512 s, __m512 vr) const {
      const __m512 t = _mm512_fmsub_ps(s, vc, vr);
      if constexpr (std::is_void_v<Bias>) {
        return t;
      } else {
        const Bias* x = bias + (r < bias_rows ? r : bias_rows - 1) * bias_ld + 16 * half;
        __m512 b;
        if constexpr (std::is_same_v<Bias, uint16_t>)
          b = (__m512)vload_bf16(x);  // blocks.inl
        else
          b = _mm512_loadu_ps(x);
        return _mm512_fmadd_ps(b, _mm512_set1_ps(static_cast<float>(detail::kLog2e)), t);
      }
    }
    void operator()(int r, __m512 s0, __m512 s1) const {
      __m512 vr;
      if constexpr (kOwnMax) {
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        s0 = _mm512_mask_mov_ps(ninf, valid0, s0);
        s1 = _mm512_mask_mov_ps(ninf, valid1, s1);
        const float m = hmax<float>(vmax<float>((vec_t<float>)s0, (vec_t<float>)s1)) * vc[0];
        own_ref[r] = m;
        vr = _mm512_set1_ps(detail::softmax_reference_point(m));
      } else {
        vr = _mm512_set1_ps(ref[r]);
      }
      const __m512 slack = _mm512_set1_ps(kStaleSlack);
      const __m512 t0 = exponent(r, 0, s0, vr), t1 = exponent(r, 1, s1, vr);
      over[r] |= (_mm512_cmp_ps_mask(t0, slack, _CMP_NLE_UQ) |
                  _mm512_cmp_ps_mask(t1, slack, _CMP_NLE_UQ)) != 0;
      const __m512 p0 = (__m512)vexp2((vec_t<float>)t0), p1 = (__m512)vexp2((vec_t<float>)t1);
      __m512 sum = _mm512_add_ps(p0, p1);
      if (!first) sum = _mm512_add_ps(sum, _mm512_loadu_ps(sums + 16 * r));
      _mm512_storeu_ps(sums + 16 * r, sum);
      _mm512_storeu_si512(Pw + r * ldw, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
  };
  // How far a tile's exponent may pass its row's reference (log2 domain) and still go through
  // scores_exp against it: P up to 2^8, as FlashAttention-4's conditional rescale allows.
  static constexpr float kStaleSlack = 8.0f;

  // Key tile kt's S = Q K^T straight to P = exp2(c S + log2(e) bias - ref[r]) in the pairs
  // accumulate_pairs reads, in the micro-kernel's epilogue: no S stored, no pass for the row max,
  // none for exp2 (ref[r]: the row's reference from earlier tiles, finite; padding rows' anything
  // finite). Bias (ExpTile's): the tile's t.rows x t.np values, row r at bias + r * bias_ld.
  // sums: 16 lanes a row of P's float sums; over[r]: whether row r's P is not to be used (an
  // exponent past its reference by more than kStaleSlack, or NaN), which the caller redoes.
  // own_ref non-null (no bias, t.np == 32: a row's first tile): each row's reference is its own
  // max over the tile's t.cols keys times c, written to own_ref (ExpTile's kOwnMax).
  template <typename Bias>
  void scores_exp(const Params& p, const Geometry<float>& g, int64_t kt, const TilePair& t, float c,
                  const float* ref, float* sums, uint8_t* over, const Bias* bias, int64_t bias_ld,
                  float* own_ref = nullptr) {
    const uint32_t* Kt = key_tile(p, g, kt);
    uint32_t* Pw = pw.get(g.Brp * (g.Bcp / 2));
    std::fill(over, over + t.mp, uint8_t{0});
    const __m512 vc = _mm512_set1_ps(c);
    // kOwnMax's columns that hold keys, in each of the block's two vectors
    const auto keys_in = [&](int64_t c0) {
      const int64_t n = std::clamp<int64_t>(t.cols - c0, 0, 16);
      return static_cast<__mmask16>((uint32_t{1} << n) - 1);
    };
    const __mmask16 valid0 = keys_in(0), valid1 = keys_in(16);
    for (int64_t j = 0; j < t.np; j += kNRb)
      for (int64_t i = 0; i < t.mp; i += kMR) {
        const bool in_place = i < q_rows;
        const uint32_t* A = in_place ? q_in + i * q_ld : qw.data.data() + (i - q_rows) * dw(g);
        const int64_t bi = std::min(i, t.rows - 1);  // a block of padding rows: the last row's
        const Bias* x = nullptr;
        if constexpr (!std::is_void_v<Bias>) x = bias + bi * bias_ld + j;
        if constexpr (std::is_void_v<Bias>) {
          if (own_ref != nullptr) {  // t.np == 32: one block of columns (j == 0)
            micro_kernel_bf16<false>(
                kd(g), A, in_place ? q_ld : dw(g), Kt, g.Bcp,
                ExpTile<void, true>{vc, nullptr, Pw + i * (g.Bcp / 2), g.Bcp / 2, sums + 16 * i,
                                    over + i, true, nullptr, 0, 0, own_ref + i, valid0, valid1});
            continue;
          }
        }
        micro_kernel_bf16<false>(kd(g), A, in_place ? q_ld : dw(g), Kt + j, g.Bcp,
                                 ExpTile<Bias>{vc, ref + i, Pw + i * (g.Bcp / 2) + j / 2, g.Bcp / 2,
                                               sums + 16 * i, over + i, j == 0, x, bias_ld,
                                               t.rows - bi, nullptr, 0, 0});
      }
  }

  void accumulate(const Geometry<float>& g, const TilePair& t, const float* P, float* O,
                  bool fresh) {
    round_pairs(P, g.Bcp, t.mp, t.np, pw.get(g.Brp * (g.Bcp / 2)), g.Bcp / 2);
    accumulate_pairs(g, t, t.mp, O, fresh);
  }

  // Row r of P = exp2(c * S row r - ref) over np scores (np % 32 == 0; c as row_exp2_lanes')
  // rounded straight to its bfloat16 pairs (round_pairs' layout and bits) for accumulate_pairs,
  // with no float P stored and read back between two passes; returns the lane sums of the float
  // P (row_exp2_lanes').
  vec_t<float> exp_pairs(const Geometry<float>& g, const float* S, int64_t r, int64_t np, float c,
                         float ref) {
    uint32_t* Pw = pw.get(g.Brp * (g.Bcp / 2)) + r * (g.Bcp / 2);
    const float* s = S + r * g.Bcp;
    const vec_t<float> vc = vset1(c), vr = vset1(ref);
    vec_t<float> acc = vec_t<float>{};
    for (int64_t j = 0; j < np; j += 32) {
      const vec_t<float> p0 = vexp2(vload(s + j) * vc - vr);
      const vec_t<float> p1 = vexp2(vload(s + j + 16) * vc - vr);
      acc += p0;
      acc += p1;
      _mm512_storeu_si512(Pw + j / 2, (__m512i)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0));
    }
    return acc;
  }
  // O += P V on the pairs exp_pairs wrote for rows [0, rows) (rows up to t.mp: zeros); fresh:
  // O = P V (O's earlier contents not read).
  void accumulate_pairs(const Geometry<float>& g, const TilePair& t, int64_t rows, float* O,
                        bool fresh = false) {
    uint32_t* Pw = pw.get(g.Brp * (g.Bcp / 2));
    for (int64_t r = rows; r < t.mp; ++r)
      std::fill(Pw + r * (g.Bcp / 2), Pw + r * (g.Bcp / 2) + t.np / 2, 0u);
    if (fresh)
      gemm_bf16<false, false>(t.mp, g.dp, t.np / 2, Pw, g.Bcp / 2, V, g.dp, O, g.dp);
    else
      gemm_bf16<false, true>(t.mp, g.dp, t.np / 2, Pw, g.Bcp / 2, V, g.dp, O, g.dp);
  }
};

// The KV-cache kernel's products on bfloat16 caches (KvRowsInPlace in kvcache.inl), read in
// place: S along the head dim on pairs (Q's words against the cache row's own bytes); O += P V on
// pairs of keys, two value rows interleaved by 16-bit units (vpunpck[lh]wd) against P rounded to
// bfloat16 pairs, as the fa2 forward rounds it. The interleave leaves O's columns in a fixed order
// within each 32 (finish_row restores it).
struct KvBf16 {
  static constexpr bool kNaturalO = false;  // O's columns permuted within 32 until finish_row
  using Elem = uint16_t;                    // a cache value
  using Word = uint32_t;                    // Q's and P's unit: a pair
  static constexpr int kElems = 32;         // cache values per vector
  static constexpr int kKeysPerStep = 2;    // keys per multiply-add of O += P V

  static int64_t words(int64_t dp) { return dp / 2; }
  static __m512i load_full(const uint16_t* p) { return _mm512_loadu_si512(p); }
  // Vector v of a row of d values; zeros past d (masked loads do not fault).
  static __m512i load(const uint16_t* row, int64_t v, int64_t d) {
    const int64_t left = d - kElems * v;
    if (left >= kElems) return load_full(row + kElems * v);
    if (left <= 0) return _mm512_setzero_si512();
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint32_t{1} << left) - 1),
                                    row + kElems * v);
  }
  static __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
  static void query(const void* q, int64_t d, uint32_t* dst, int64_t n) {
    row_pairs(static_cast<const uint16_t*>(q), d, dst, n);
  }
  // A vectors of key pairs for O's columns [c0, c0 + 16 A) (c0 % 64 == 0) of value rows
  // rows[0] and rows[1].
  // kWhole: every column is in the rows (no masked loads).
  template <int A, bool kWhole>
  static void values(const uint16_t* const* rows, int64_t c0, int64_t d, __m512i* w) {
    for (int u = 0; u < A / 2; ++u) {
      const int64_t v = c0 / kElems + u;
      const __m512i a = kWhole ? load_full(rows[0] + kElems * v) : load(rows[0], v, d);
      const __m512i b = kWhole ? load_full(rows[1] + kElems * v) : load(rows[1], v, d);
      w[2 * u] = _mm512_unpacklo_epi16(a, b);
      w[2 * u + 1] = _mm512_unpackhi_epi16(a, b);
    }
  }
  // P (rows of ld floats, zeros from n) as bfloat16 pairs of keys over [0, 2 * steps): rows of
  // *ldw words.
  static const uint32_t* weights(float* P, int64_t ld, int64_t rows, int64_t n, int64_t steps,
                                 Buffer<uint32_t>& buf, int64_t* ldw) {
    const int64_t n32 = detail::round_up(2 * steps, int64_t{32});
    for (int64_t r = 0; r < rows; ++r) std::fill(P + r * ld + n, P + r * ld + n32, 0.f);
    *ldw = ld / 2;
    uint32_t* w = buf.get(rows * *ldw);
    round_pairs(P, ld, rows, n32, w, *ldw);
    return w;
  }
  static __m512i weight(const uint32_t* P, int64_t step) {
    return _mm512_set1_epi32(static_cast<int>(P[step]));
  }
  // A row of O (dp % 32 == 0) back to column order: in each 32 columns, float 4L + t holds column
  // 8L + t and float 16 + 4L + t column 8L + 4 + t (L < 4, t < 4).
  static void finish_row(float* row, int64_t dp) {
    alignas(64) static constexpr int32_t kFrom[32] = {0,  1,  2,  3,  16, 17, 18, 19, 4,  5,  6,
                                                      7,  20, 21, 22, 23, 8,  9,  10, 11, 24, 25,
                                                      26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    const __m512i lo_idx = _mm512_load_si512(kFrom), hi_idx = _mm512_load_si512(kFrom + 16);
    for (int64_t c = 0; c < dp; c += 32) {
      const __m512 lo = _mm512_loadu_ps(row + c), hi = _mm512_loadu_ps(row + c + 16);
      _mm512_storeu_ps(row + c, _mm512_permutex2var_ps(lo, lo_idx, hi));
      _mm512_storeu_ps(row + c + 16, _mm512_permutex2var_ps(lo, hi_idx, hi));
    }
  }
};
