// The one matrix-product micro-kernel every schedule uses: C (+)= op(A) * B on register tiles of
// kMR rows by NR = 2 vectors, A broadcast element by element, B and C row-major.
// Callers pad their buffers so m is a multiple of kMR and n a multiple of NR (zeros in the padding),
// which keeps a single kernel with no edge cases.

constexpr int kMR = 6;

template <typename T>
constexpr int kNR = 2 * Simd<T>::W;

// TransA: A is stored k x m (element (r, p) at A[p * lda + r]); else m x k (A[r * lda + p]).
template <typename T, bool TransA, bool Accumulate>
inline void micro_kernel(int64_t k, const T* __restrict A, int64_t lda, const T* __restrict B,
                         int64_t ldb, T* __restrict C, int64_t ldc) {
  constexpr int W = Simd<T>::W;
  vec_t<T> c0[kMR], c1[kMR];
#pragma GCC unroll 6
  for (int r = 0; r < kMR; ++r) c0[r] = c1[r] = vec_t<T>{};
  for (int64_t p = 0; p < k; ++p) {
    const vec_t<T> b0 = vload(B + p * ldb);
    const vec_t<T> b1 = vload(B + p * ldb + W);
#pragma GCC unroll 6
    for (int r = 0; r < kMR; ++r) {
      const vec_t<T> a = vset1(TransA ? A[p * lda + r] : A[r * lda + p]);
      c0[r] += a * b0;
      c1[r] += a * b1;
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kMR; ++r) {
    T* row = C + r * ldc;
    if (Accumulate) {
      vstore(row, vload(row) + c0[r]);
      vstore(row + W, vload(row + W) + c1[r]);
    } else {
      vstore(row, c0[r]);
      vstore(row + W, c1[r]);
    }
  }
}

// C[m x n] (+)= op(A)[m x k] * B[k x n]; m % kMR == 0, n % kNR<T> == 0.
template <typename T, bool TransA, bool Accumulate>
void gemm(int64_t m, int64_t n, int64_t k, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
          int64_t ldc) {
  for (int64_t j = 0; j < n; j += kNR<T>)
    for (int64_t i = 0; i < m; i += kMR)
      micro_kernel<T, TransA, Accumulate>(k, TransA ? A + i : A + i * lda, lda, B + j, ldb,
                                          C + i * ldc + j, ldc);
}
