// The block steps both schedules share: the padded geometry of a call, S = QK^T with the mask
// applied, dropout, and one (query block, key block) step of the backward pass (Algorithm 4,
// lines 11-20), so fa1 and fa2 differ only in loop order, parallelism and where O, l, m live.

using detail::Mask;

template <typename T>
struct Geometry {
  int64_t d, dp;       // head dim, and padded to the vector tile
  int64_t Br, Bc;      // logical block rows of Q and of K/V
  int64_t Brp, Bcp;    // padded to the micro-kernel tile
  int64_t nqb, nkb;    // number of Q and K/V blocks
  T c;                 // softmax scale * log2(e)
};

template <typename T>
Geometry<T> make_geometry(const Params& p, int64_t Br, int64_t Bc) {
  constexpr int64_t lcm = std::lcm(static_cast<int64_t>(kMR), static_cast<int64_t>(kNR<T>));
  Geometry<T> g;
  g.d = p.headdim;
  g.dp = detail::round_up(p.headdim, kNR<T>);
  g.Br = Br;
  g.Bc = Bc;
  g.Brp = detail::round_up(Br, kMR);
  g.Bcp = detail::round_up(Bc, lcm);
  g.nqb = detail::ceil_div(p.seqlen_q, Br);
  g.nkb = detail::ceil_div(p.seqlen_k, Bc);
  g.c = static_cast<T>(p.scale_softmax_log2);
  return g;
}

// Block order within a head. With a causal or window mask, blocks differ in work; visiting them
// as 0, n-1, 1, n-2, ... makes every contiguous run of pairs equally heavy, so static slices
// of the task range stay balanced.
inline int64_t block_order(int64_t index, int64_t n, bool zigzag) {
  if (!zigzag) return index;
  return (index % 2 == 0) ? index / 2 : n - 1 - index / 2;
}

inline Mask mask_of(const Params& p) {
  return Mask{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
}

inline bool mask_limits(const Params& p) { return p.window_left >= 0 || p.window_right >= 0; }

// S = Q K^T for Q rows [i0, i0 + rows) and keys [j0, j0 + cols), scaled to the exp2 domain, with
// invisible keys, padding rows and padding columns at -inf. Writes each row's max to row_max.
template <typename T>
void masked_scores(const Geometry<T>& g, const Mask& mask, const T* Q, const T* Kt, int64_t ldkt,
                   T* S, int64_t i0, int64_t rows, int64_t j0, int64_t cols, T* row_max) {
  gemm<T, false, false>(g.Brp, g.Bcp, g.d, Q, g.dp, Kt, ldkt, S, g.Bcp);
  const bool full =
      rows == g.Brp && cols == g.Bcp && mask.block_fully_visible(i0, i0 + rows, j0, j0 + cols);
  for (int64_t r = 0; r < g.Brp; ++r) {
    T* s = S + r * g.Bcp;
    if (full) {
      row_max[r] = row_scale_max(s, g.Bcp, g.c);
    } else if (r >= rows) {
      std::fill(s, s + g.Bcp, T(-INFINITY));
      row_max[r] = T(-INFINITY);
    } else {
      const int64_t lo = mask.col_begin(i0 + r) - j0;
      const int64_t hi = std::min(mask.col_end(i0 + r) - j0, cols);
      row_max[r] = row_scale_mask_max(s, g.Bcp, g.c, [&](int64_t j) { return j >= lo && j < hi; });
    }
  }
}

// Z: the dropout multipliers (0 or 1 / (1 - p)) of the block, from the counter-based generator.
template <typename T>
void dropout_multipliers(const Geometry<T>& g, const Params& p, int64_t b, int64_t h, int64_t i0,
                         int64_t rows, int64_t j0, int64_t cols, T* Z) {
  const T kept = T(1) / (T(1) - static_cast<T>(p.p_dropout));
  const uint64_t bh = static_cast<uint64_t>((b + p.dropout_batch_offset) * p.nheads + h);
  for (int64_t r = 0; r < g.Brp; ++r)
    for (int64_t j = 0; j < g.Bcp; ++j)
      Z[r * g.Bcp + j] = (r < rows && j < cols && detail::dropout_keep(p.p_dropout, p.seed, p.offset,
                                                                       bh, i0 + r, j0 + j))
                             ? kept
                             : T(0);
}

// P *= Z in place, for the rows and columns of the block that exist (l keeps the undropped sum).
template <typename T>
void apply_dropout(const Geometry<T>& g, const Params& p, int64_t b, int64_t h, int64_t i0,
                   int64_t rows, int64_t j0, int64_t cols, T* P) {
  const T kept = T(1) / (T(1) - static_cast<T>(p.p_dropout));
  const uint64_t bh = static_cast<uint64_t>((b + p.dropout_batch_offset) * p.nheads + h);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j)
      if (!detail::dropout_keep(p.p_dropout, p.seed, p.offset, bh, i0 + r, j0 + j))
        P[r * g.Bcp + j] = T(0);
      else
        P[r * g.Bcp + j] *= kept;
}

// Per-call working buffers of one thread for backward_block.
template <typename T>
struct BackwardScratch {
  Buffer<T> S, dS, Z, Pd, row_max;
};

// One step of Algorithm 4 for query block i (rows [i0, i0 + rows)) of head (b, h) and key block j
// (keys [j0, j0 + cols)):
//   P = exp2(scores - L2); dV += (P*Z)^T dO; dP = (dO V^T)*Z; dS = P*(dP - D);
//   dK += dS^T Q; dQ += dS K           (dK and dQ without the softmax scale; callers apply it)
// Q, dO, dQ are Brp x dp; L2 (lse in the exp2 domain) and D have Brp entries; K is Bcp x dp,
// Kt and Vt are d x Bcp; dK, dV are Bcp x dp.
template <typename T>
void backward_block(const Geometry<T>& g, const Params& p, const Mask& mask, int64_t b, int64_t h,
                    int64_t i0, int64_t rows, int64_t j0, int64_t cols, const T* Q, const T* dO,
                    const T* L2, const T* D, const T* K, const T* Kt, const T* Vt, T* dK, T* dV,
                    T* dQ, BackwardScratch<T>& scratch) {
  const int64_t n = g.Brp * g.Bcp;
  T* S = scratch.S.get(n);
  T* dS = scratch.dS.get(n);
  T* row_max = scratch.row_max.get(g.Brp);
  masked_scores(g, mask, Q, Kt, g.Bcp, S, i0, rows, j0, cols, row_max);
  for (int64_t r = 0; r < g.Brp; ++r)  // P = exp2(t - lse2); masked entries give exactly 0
    row_exp2_sum(S + r * g.Bcp, g.Bcp, detail::softmax_reference_point(L2[r]));

  const bool dropout = p.p_dropout > 0.0f;
  const T* Pd = S;
  T* Z = nullptr;
  if (dropout) {
    Z = scratch.Z.get(n);
    T* pd = scratch.Pd.get(n);
    dropout_multipliers(g, p, b, h, i0, rows, j0, cols, Z);
    for (int64_t e = 0; e < n; ++e) pd[e] = S[e] * Z[e];
    Pd = pd;
  }
  gemm<T, true, true>(g.Bcp, g.dp, g.Brp, Pd, g.Bcp, dO, g.dp, dV, g.dp);
  gemm<T, false, false>(g.Brp, g.Bcp, g.d, dO, g.dp, Vt, g.Bcp, dS, g.Bcp);
  constexpr int W = Simd<T>::W;
  for (int64_t r = 0; r < g.Brp; ++r) {
    const vec_t<T> vd = vset1(D[r]);
    for (int64_t j = r * g.Bcp; j < (r + 1) * g.Bcp; j += W) {
      const vec_t<T> dp = dropout ? vload(dS + j) * vload(Z + j) : vload(dS + j);
      vstore(dS + j, vload(S + j) * (dp - vd));
    }
  }
  gemm<T, true, true>(g.Bcp, g.dp, g.Brp, dS, g.Bcp, Q, g.dp, dK, g.dp);
  gemm<T, false, true>(g.Brp, g.dp, g.Bcp, dS, g.Bcp, K, g.dp, dQ, g.dp);
}

// Offsets of row i of head h in batch b, in elements.
inline int64_t q_offset(const Params& p, int64_t b, int64_t i, int64_t h) {
  return b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride;
}
inline int64_t k_offset(const Params& p, int64_t b, int64_t j, int64_t h) {
  return b * p.k_batch_stride + j * p.k_row_stride + h * p.k_head_stride;
}
inline int64_t v_offset(const Params& p, int64_t b, int64_t j, int64_t h) {
  return b * p.v_batch_stride + j * p.v_row_stride + h * p.v_head_stride;
}
inline int64_t o_offset(const Params& p, int64_t b, int64_t i, int64_t h) {
  return b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
}
inline int64_t do_offset(const Params& p, int64_t b, int64_t i, int64_t h) {
  return b * p.do_batch_stride + i * p.do_row_stride + h * p.do_head_stride;
}
inline float& lse_at(const Params& p, int64_t b, int64_t h, int64_t i) {
  return p.lse_ptr[b * p.lse_batch_stride + h * p.lse_head_stride + i * p.lse_row_stride];
}

// K (Bcp x dp), K^T and V^T (d x Bcp) of keys [j0, j0 + cols) of (b, hk).
template <typename T>
struct KeyBlock {
  Buffer<T> K, Kt, Vt, scratch;
  void load(const Params& p, const Geometry<T>& g, int64_t b, int64_t hk, int64_t j0, int64_t cols) {
    load_rows(element(p.k_ptr, p.dtype, k_offset(p, b, j0, hk)), p.dtype, p.k_row_stride, cols, g.d,
              K.get(g.Bcp * g.dp), g.dp, g.Bcp);
    load_rows_transposed(element(p.k_ptr, p.dtype, k_offset(p, b, j0, hk)), p.dtype,
                         p.k_row_stride, cols, g.d, Kt.get(g.d * g.Bcp), g.Bcp, scratch.get(g.dp));
    load_rows_transposed(element(p.v_ptr, p.dtype, v_offset(p, b, j0, hk)), p.dtype,
                         p.v_row_stride, cols, g.d, Vt.get(g.d * g.Bcp), g.Bcp, scratch.get(g.dp));
  }
};

template <typename T>
void store_key_grads(const Params& p, const Geometry<T>& g, int64_t b, int64_t hk, int64_t j0,
                     int64_t cols, const T* dK, const T* dV) {
  store_rows(dK, g.dp, cols, g.d, static_cast<T>(p.scale_softmax),
             element(p.dk_ptr, p.dtype, b * p.dk_batch_stride + j0 * p.dk_row_stride +
                                            hk * p.dk_head_stride),
             p.dtype, p.dk_row_stride);
  store_rows(dV, g.dp, cols, g.d, T(1),
             element(p.dv_ptr, p.dtype, b * p.dv_batch_stride + j0 * p.dv_row_stride +
                                            hk * p.dv_head_stride),
             p.dtype, p.dv_row_stride);
}
