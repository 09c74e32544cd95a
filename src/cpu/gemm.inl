// The one matrix-product micro-kernel every schedule uses: C (+)= op(A) * B on register tiles of
// kMR rows by NV vectors (NV = 2, or 1 for a last strip of one vector), A broadcast element by
// element, B and C row-major.
// Callers pad their buffers so m is a multiple of kMR and n a multiple of the vector width (zeros in
// the padding), which keeps a single kernel with no edge cases; n % kNR == W takes the one-vector
// strip at the end (a tile of 16 float keys on AVX-512 computes 16 columns, not 32).

constexpr int kMR = 6;

template <typename T>
constexpr int kNR = 2 * Simd<T>::W;

// TransA: A is stored k x m (element (r, p) at A[p * lda + r]); else m x k (A[r * lda + p]).
template <typename T, int NV, bool TransA, bool Accumulate>
inline void micro_kernel(int64_t k, const T* __restrict A, int64_t lda, const T* __restrict B,
                         int64_t ldb, T* __restrict C, int64_t ldc) {
  constexpr int W = Simd<T>::W;
  vec_t<T> c[NV][kMR];
#pragma GCC unroll 2
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 6
    for (int r = 0; r < kMR; ++r) c[v][r] = vec_t<T>{};
  for (int64_t p = 0; p < k; ++p) {
    vec_t<T> b[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) b[v] = vload(B + p * ldb + v * W);
#pragma GCC unroll 6
    for (int r = 0; r < kMR; ++r) {
      const vec_t<T> a = vset1(TransA ? A[p * lda + r] : A[r * lda + p]);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) c[v][r] += a * b[v];
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kMR; ++r) {
    T* row = C + r * ldc;
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      if (Accumulate)
        vstore(row + v * W, vload(row + v * W) + c[v][r]);
      else
        vstore(row + v * W, c[v][r]);
    }
  }
}

// C[m x n] (+)= op(A)[m x k] * B[k x n]; m % kMR == 0, n % W == 0 (W = Simd<T>::W).
template <typename T, bool TransA, bool Accumulate>
void gemm(int64_t m, int64_t n, int64_t k, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
          int64_t ldc) {
  constexpr int W = Simd<T>::W;
  int64_t j = 0;
  for (; j + kNR<T> <= n; j += kNR<T>)
    for (int64_t i = 0; i < m; i += kMR)
      micro_kernel<T, 2, TransA, Accumulate>(k, TransA ? A + i : A + i * lda, lda, B + j, ldb,
                                             C + i * ldc + j, ldc);
  if (j < n)  // n % kNR == W: one vector left
    for (int64_t i = 0; i < m; i += kMR)
      micro_kernel<T, 1, TransA, Accumulate>(k, TransA ? A + i : A + i * lda, lda, B + j, ldb,
                                             C + i * ldc + j, ldc);
  static_assert(kNR<T> == 2 * W, "the strips above are of two vectors and of one");
}
