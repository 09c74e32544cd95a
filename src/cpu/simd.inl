// Portable SIMD on GCC/Clang vector extensions. Included inside an instruction-set namespace by
// kernels.inl; FLASHDL_VEC_BYTES (16, 32 or 64) is the vector width that set compiles for.

template <typename T>
struct Simd {
  typedef T vec __attribute__((vector_size(FLASHDL_VEC_BYTES)));
  static constexpr int W = FLASHDL_VEC_BYTES / static_cast<int>(sizeof(T));
};

template <typename T>
using vec_t = typename Simd<T>::vec;

template <typename T>
inline vec_t<T> vload(const T* p) {
  vec_t<T> v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

template <typename T>
inline void vstore(T* p, vec_t<T> v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

// A broadcast. Written as ones * x: `vec_t<T>{} + x` would add 0.0 first (an extra instruction,
// kept for signed zeros), while multiplying by 1 folds away and leaves one broadcast.
template <typename T>
inline vec_t<T> vset1(T x) {
  return (vec_t<T>{} + T(1)) * x;
}

template <typename T>
inline vec_t<T> vmax(vec_t<T> a, vec_t<T> b) {
  return a > b ? a : b;
}

// Horizontal reductions in log2(W) steps: the vector's upper half folded onto its lower half
// until two lanes remain. (A lane-by-lane loop is a chain of W - 1 dependent operations: the
// compiler may not reorder it, and in a short row's softmax that chain was the largest part of
// mask_scores.)
template <typename T, int N>
struct Lanes {
  typedef T vec __attribute__((vector_size(N * sizeof(T))));
};

// Lanes [Off, Off + N / 2) of v as a half-width vector (a register extract, where a memcpy of the
// halves sent v through the stack, with a store-forwarding stall, every row).
template <typename T, int N, int Off, size_t... I>
inline typename Lanes<T, N / 2>::vec half_lanes(typename Lanes<T, N>::vec v,
                                                std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, (Off + static_cast<int>(I))...);
}

// (Two functions, not one taking the operation: a lambda's call operator is compiled without
// the file's instruction-set pragma, and vectors would cross it with another call ABI.)
template <typename T, int N>
inline T fold_max(typename Lanes<T, N>::vec v) {
  if constexpr (N == 2) {
    return v[0] > v[1] ? v[0] : v[1];
  } else {
    const auto lo = half_lanes<T, N, 0>(v, std::make_index_sequence<N / 2>{});
    const auto hi = half_lanes<T, N, N / 2>(v, std::make_index_sequence<N / 2>{});
    return fold_max<T, N / 2>(lo > hi ? lo : hi);
  }
}

template <typename T, int N>
inline T fold_sum(typename Lanes<T, N>::vec v) {
  if constexpr (N == 2) {
    return v[0] + v[1];
  } else {
    const auto lo = half_lanes<T, N, 0>(v, std::make_index_sequence<N / 2>{});
    const auto hi = half_lanes<T, N, N / 2>(v, std::make_index_sequence<N / 2>{});
    return fold_sum<T, N / 2>(lo + hi);
  }
}

template <typename T>
inline T hmax(vec_t<T> v) {
  return fold_max<T, Simd<T>::W>(v);
}

template <typename T>
inline T hsum(vec_t<T> v) {
  return fold_sum<T, Simd<T>::W>(v);
}

// A W x W transpose in registers: log2(W) stages; the stage of block size B swaps, in each pair of
// rows (i, i + B) with i & B == 0, the B-column blocks off the diagonal of their 2B x 2B block
// (row i's columns c with c & B against row i + B's columns c - B). Each stage is W two-source
// shuffles, where a scalar transpose is W * W loads and stores (a 16 x 16 tile's S^T -> S and
// Q -> Q^T were a sixth of a 16 x 16 forward).
template <typename T, int B, size_t... C>
inline void transpose_stage(vec_t<T>* r, std::index_sequence<C...>) {
  constexpr int W = Simd<T>::W;
  for (int i = 0; i < W; ++i) {
    if (i & B) continue;
    const vec_t<T> a = r[i], b = r[i + B];
    r[i] = __builtin_shufflevector(
        a, b, ((C & B) ? W + static_cast<int>(C) - B : static_cast<int>(C))...);
    r[i + B] = __builtin_shufflevector(
        a, b, ((C & B) ? W + static_cast<int>(C) : static_cast<int>(C) + B)...);
  }
}

template <typename T, int B = Simd<T>::W / 2>
inline void transpose_lanes(vec_t<T>* r) {
  transpose_stage<T, B>(r, std::make_index_sequence<Simd<T>::W>{});
  if constexpr (B > 1) transpose_lanes<T, B / 2>(r);
}

// dst[c * ldd + i] = src[i * lds + c] for i < W, c < W, where src rows [nr, W) read as zero: W
// full columns of nr <= W source rows, written as W full rows of W.
template <typename T>
inline void transpose_block(const T* src, int64_t lds, int64_t nr, T* dst, int64_t ldd) {
  constexpr int W = Simd<T>::W;
  vec_t<T> r[W];
  for (int i = 0; i < W; ++i) r[i] = i < nr ? vload(src + i * lds) : vec_t<T>{};
  transpose_lanes<T>(r);
  for (int c = 0; c < W; ++c) vstore(dst + c * ldd, r[c]);
}

// 2^x for float vectors: round-to-nearest split x = n + f, |f| <= 1/2, 2^f by a degree-5
// polynomial (a relative minimax fit on [-1/2, 1/2]; in float32 with FMA the result is within
// 1.7e-7 of 2^x), then times 2^n. Inputs below -126 (masked scores are -inf) give exactly 0; NaN
// stays NaN. With AVX-512 the split is one vroundscaleps and 2^n with the zeroing one masked
// vscalefps; otherwise the magic-number rounding and the exponent
// bits, with x clamped to [-126, 127].
inline vec_t<float> exp2_poly(vec_t<float> f) {
  vec_t<float> poly = vset1(1.326463499e-3f);
  poly = poly * f + 9.671484574e-3f;
  poly = poly * f + 5.550733713e-2f;
  poly = poly * f + 2.402224253e-1f;
  poly = poly * f + 6.931469778e-1f;
  return poly * f + 1.0f;
}
inline vec_t<float> vexp2(vec_t<float> x) {
#if FLASHDL_VEC_BYTES == 64  // the avx512 copies (isa_avx512*.cpp)
  const __m512 xv = (__m512)x;
  const __mmask16 keep = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
  // (The maskz form with every lane set: GCC 12's plain form reads _mm512_undefined_ps, which
  // -Wmaybe-uninitialized reports.)
  const __m512 n = _mm512_maskz_roundscale_ps(static_cast<__mmask16>(0xFFFF), xv,
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vec_t<float> poly = exp2_poly(x - (vec_t<float>)n);
  return (vec_t<float>)_mm512_maskz_scalef_ps(keep, (__m512)poly, n);
#else
  typedef int32_t ivec __attribute__((vector_size(FLASHDL_VEC_BYTES)));
  const vec_t<float> lo = vset1(-126.0f), hi = vset1(127.0f);
  vec_t<float> xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const vec_t<float> magic = vset1(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vec_t<float> t = xc + magic;
  const vec_t<float> n = t - magic;
  const ivec e = ((ivec)t - 0x4B400000 + 127) << 23;
  const vec_t<float> r = exp2_poly(xc - n) * (vec_t<float>)e;
  const ivec keep = ~(x < lo);
  return (vec_t<float>)((ivec)r & keep);
#endif
}

// float64 is the gradient-checking path: exactness over speed.
inline vec_t<double> vexp2(vec_t<double> x) {
  vec_t<double> r;
  for (int i = 0; i < Simd<double>::W; ++i) r[i] = std::exp2(x[i]);
  return r;
}

// tanh for float vectors: a 13/6 odd rational minimax fit on [-7.905, 7.905] (Eigen's fast tanh
// coefficients; max error 3.9e-7, measured against float64 over [-9, 9]), the input clamped there.
inline vec_t<float> vtanh(vec_t<float> x) {
  const vec_t<float> lim = vset1(7.90531110763549805f);
  vec_t<float> xc = x > lim ? lim : x;
  xc = xc < -lim ? -lim : xc;
  const vec_t<float> x2 = xc * xc;
  vec_t<float> p = vset1(-2.76076847742355e-16f);
  p = p * x2 + 2.00018790482477e-13f;
  p = p * x2 + -8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  vec_t<float> q = vset1(1.19825839466702e-06f);
  q = q * x2 + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  return xc * p / q;
}

inline vec_t<double> vtanh(vec_t<double> x) {
  vec_t<double> r = x;
  for (int i = 0; i < Simd<double>::W; ++i) r[i] = std::tanh(x[i]);
  return r;
}

// ---- row operations over n elements, n a multiple of the vector width ----------------------------

// t = s * c in place; returns max(t).
template <typename T>
inline T row_scale_max(T* s, int64_t n, T c) {
  constexpr int W = Simd<T>::W;
  vec_t<T> m = vset1<T>(-INFINITY);
  const vec_t<T> vc = vset1(c);
  for (int64_t j = 0; j < n; j += W) {
    const vec_t<T> t = vload(s + j) * vc;
    vstore(s + j, t);
    m = vmax<T>(m, t);
  }
  return hmax<T>(m);
}

// max(s), s unchanged: with c > 0, max(s) * c is row_scale_max's result bit for bit (rounding is
// monotonic), for callers that fold the scale into exp2 (row_exp2_lanes' c).
template <typename T>
inline T row_max_of(const T* s, int64_t n) {
  constexpr int W = Simd<T>::W;
  vec_t<T> m = vset1<T>(-INFINITY);
  for (int64_t j = 0; j < n; j += W) m = vmax<T>(m, vload(s + j));
  return hmax<T>(m);
}

// Same, with the keys outside [lo, hi) set to -inf (a row's visible range within the tile).
// Kept out of line: inlined into mask_scores (as GCC chose after unrelated changes to the
// backward in the same file), its horizontal max came out as scalar shuffles and mask_scores
// went from 2% to 11% of a causal 16 x 16 forward (cpu_tuning.md section 48).
template <typename T>
__attribute__((noinline)) T row_scale_range_max(T* s, int64_t n, T c, int64_t lo, int64_t hi) {
  constexpr int W = Simd<T>::W;
  using I = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  typedef I ivec __attribute__((vector_size(FLASHDL_VEC_BYTES)));
  ivec col;
  for (int i = 0; i < W; ++i) col[i] = static_cast<I>(i);
  const I l = static_cast<I>(std::clamp<int64_t>(lo, 0, n));
  const I h = static_cast<I>(std::clamp<int64_t>(hi, 0, n));
  const vec_t<T> vc = vset1(c), ninf = vset1<T>(-INFINITY);
  vec_t<T> m = ninf;
  for (int64_t j = 0; j < n; j += W, col += static_cast<I>(W)) {
    const vec_t<T> t = (col >= l) & (col < h) ? vload(s + j) * vc : ninf;
    vstore(s + j, t);
    m = vmax<T>(m, t);
  }
  return hmax<T>(m);
}

// With score modifiers (detail::ScoreMod): t = mod.score(s) + mod.bias(diag, j) in place for the
// keys of [lo, hi), -inf elsewhere, where dist0 = diag - (the key of column 0); returns max(t).
// grad (null: not wanted) receives d score / d (scale q.k) = 1 - tanh^2 with a cap, else 1.
template <typename T>
inline T row_modified_range_max(T* s, int64_t n, const detail::ScoreMod<T>& mod, int64_t dist0,
                                int64_t lo, int64_t hi, T* grad) {
  constexpr int W = Simd<T>::W;
  using I = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  typedef I ivec __attribute__((vector_size(FLASHDL_VEC_BYTES)));
  ivec col;
  for (int i = 0; i < W; ++i) col[i] = static_cast<I>(i);
  const I l = static_cast<I>(std::clamp<int64_t>(lo, 0, n));
  const I h = static_cast<I>(std::clamp<int64_t>(hi, 0, n));
  const vec_t<T> ninf = vset1<T>(-INFINITY), one = vset1<T>(1);
  const vec_t<T> qk_scale = vset1(mod.qk_scale), cap = vset1(mod.cap), slope = vset1(mod.slope);
  // Distances |diag - j| as T, exact while below 2^24 (float): dist0 - column.
  vec_t<T> dist = vset1(static_cast<T>(dist0)) - __builtin_convertvector(col, vec_t<T>);
  const vec_t<T> step = vset1(static_cast<T>(W));
  vec_t<T> m = ninf;
  for (int64_t j = 0; j < n; j += W, col += static_cast<I>(W), dist -= step) {
    vec_t<T> t = vload(s + j) * qk_scale;
    if (mod.capped()) {
      const vec_t<T> th = vtanh(t);
      t = cap * th;
      if (grad) vstore(grad + j, one - th * th);
    } else if (grad) {
      vstore(grad + j, one);
    }
    if (mod.biased()) t -= slope * (dist < 0 ? -dist : dist);
    t = (col >= l) & (col < h) ? t : ninf;
    vstore(s + j, t);
    m = vmax<T>(m, t);
  }
  return hmax<T>(m);
}

// p = exp2(c * t - ref) in place (one FMA; c = 1 where t is already scaled); returns sum(p) lane
// by lane (a caller that keeps a running sum adds the lanes once at the end: a horizontal sum per
// row and tile was 7.7% of the bfloat16 forward's time at head dim 64).
template <typename T>
inline vec_t<T> row_exp2_lanes(T* s, int64_t n, T c, T ref) {
  constexpr int W = Simd<T>::W;
  vec_t<T> acc = vec_t<T>{};
  const vec_t<T> vc = vset1(c), vr = vset1(ref);
  for (int64_t j = 0; j < n; j += W) {
    const vec_t<T> p = vexp2(vload(s + j) * vc - vr);
    vstore(s + j, p);
    acc += p;
  }
  return acc;
}

// p = exp2(t - ref) in place; returns sum(p).
template <typename T>
inline T row_exp2_sum(T* s, int64_t n, T ref) {
  return hsum<T>(row_exp2_lanes(s, n, T(1), ref));
}

// y *= a
template <typename T>
inline void row_scale(T* y, int64_t n, T a) {
  constexpr int W = Simd<T>::W;
  const vec_t<T> va = vset1(a);
  for (int64_t j = 0; j < n; j += W) vstore(y + j, vload(y + j) * va);
}

// y = a * y + b * x
template <typename T>
inline void row_axpby(T* y, const T* x, int64_t n, T a, T b) {
  constexpr int W = Simd<T>::W;
  const vec_t<T> va = vset1(a), vb = vset1(b);
  for (int64_t j = 0; j < n; j += W) vstore(y + j, vload(y + j) * va + vload(x + j) * vb);
}

// sum(x * y)
template <typename T>
inline T row_dot(const T* x, const T* y, int64_t n) {
  constexpr int W = Simd<T>::W;
  vec_t<T> acc = vec_t<T>{};
  for (int64_t j = 0; j < n; j += W) acc += vload(x + j) * vload(y + j);
  return hsum<T>(acc);
}

// Whether x[0..n) are all finite: x * 0 is 0 for a finite x and NaN for NaN or +-Inf, so the sum
// of the products is 0 iff every x is finite (in any order: one vector of lanes at a time, where a
// scalar chain of n dependent adds was a sixth of a causal 16 x 16 forward).
template <typename T>
inline bool row_finite(const T* x, int64_t n) {
  constexpr int W = Simd<T>::W;
  const vec_t<T> zero = vec_t<T>{};
  vec_t<T> acc = zero;
  int64_t e = 0;
  for (; e + W <= n; e += W) acc += vload(x + e) * zero;
  T sum = hsum<T>(acc);
  for (; e < n; ++e) sum += x[e] * T(0);
  return sum == T(0);
}
