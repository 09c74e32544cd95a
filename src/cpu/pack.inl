// Moving rows between the caller's arrays (any storage dtype, any row stride) and the float or
// double working buffers of the schedules. Padding is always written as zeros.

// dst[0..n) = src[0..n) converted from dtype dt.
template <typename T>
inline void convert_row_in(const void* src, DType dt, int64_t n, T* dst) {
  switch (dt) {
    case DType::float32: {
      const float* s = static_cast<const float*>(src);
      for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<T>(s[c]);
      return;
    }
    case DType::float64: {
      const double* s = static_cast<const double*>(src);
      for (int64_t c = 0; c < n; ++c) dst[c] = static_cast<T>(s[c]);
      return;
    }
    case DType::bfloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      int64_t c = 0;
      if constexpr (std::is_same_v<T, float>) {
        // A vector at a time: bfloat16 is the top half of a float32.
        constexpr int W = Simd<float>::W;
        typedef uint16_t hvec __attribute__((vector_size(W * 2)));
        typedef uint32_t uvec __attribute__((vector_size(W * 4)));
        for (; c + W <= n; c += W) {
          hvec h;
          __builtin_memcpy(&h, s + c, sizeof h);
          const uvec u = __builtin_convertvector(h, uvec) << 16;
          __builtin_memcpy(dst + c, &u, sizeof u);
        }
      }
      for (; c < n; ++c) dst[c] = static_cast<T>(bf16_to_float(s[c]));
      return;
    }
    case DType::float16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      int64_t c = 0;
#if FLASHDL_HAVE_F16C
      if constexpr (std::is_same_v<T, float>) {
        for (; c + 8 <= n; c += 8)
          _mm256_storeu_ps(dst + c, _mm256_cvtph_ps(
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + c))));
      }
#endif
      for (; c < n; ++c) dst[c] = static_cast<T>(fp16_to_float(s[c]));
      return;
    }
    default: return;
  }
}

// dst[0..n) (dtype dt) = src[0..n) * a.
template <typename T>
inline void convert_row_out(const T* src, T a, int64_t n, void* dst, DType dt) {
  switch (dt) {
    case DType::float32: {
      float* d = static_cast<float*>(dst);
      for (int64_t c = 0; c < n; ++c) d[c] = static_cast<float>(src[c] * a);
      return;
    }
    case DType::float64: {
      double* d = static_cast<double*>(dst);
      for (int64_t c = 0; c < n; ++c) d[c] = static_cast<double>(src[c] * a);
      return;
    }
    case DType::bfloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t c = 0; c < n; ++c) d[c] = float_to_bf16(static_cast<float>(src[c] * a));
      return;
    }
    case DType::float16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      int64_t c = 0;
#if FLASHDL_HAVE_F16C
      if constexpr (std::is_same_v<T, float>) {
        const __m256 va = _mm256_set1_ps(a);
        for (; c + 8 <= n; c += 8)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(d + c),
                           _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(src + c), va),
                                           _MM_FROUND_TO_NEAREST_INT));
      }
#endif
      for (; c < n; ++c) d[c] = float_to_fp16(static_cast<float>(src[c] * a));
      return;
    }
    default: return;
  }
}

inline const void* element(const void* base, DType dt, int64_t offset) {
  return static_cast<const char*>(base) + offset * static_cast<int64_t>(dtype_size(dt));
}
inline void* element(void* base, DType dt, int64_t offset) {
  return static_cast<char*>(base) + offset * static_cast<int64_t>(dtype_size(dt));
}

// The cache lines of rows [0, rows) of a strided array (row r: `bytes` bytes at base + r *
// stride bytes), prefetched (for writing with Write), all before the rows are used: the rows of
// one head are short runs far apart (a (batch, seqlen, nheads, headdim) array: headdim elements
// every nheads * headdim), which the hardware prefetcher does not follow, and read one after
// another each row's copy waited for its load.
template <bool Write = false>
inline void prefetch_rows(const void* base, int64_t stride, int64_t rows, int64_t bytes) {
  constexpr int64_t kLine = 64;
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = static_cast<const char*>(base) + r * stride;
    for (int64_t o = 0; o < bytes; o += kLine) __builtin_prefetch(row + o, Write ? 1 : 0, 3);
    __builtin_prefetch(row + bytes - 1, Write ? 1 : 0, 3);
  }
}

// prefetch_rows over rows counted in elements of dt, as load_rows and store_rows take them:
// `rows` rows of `cols` elements, row_stride elements apart.
template <bool Write = false>
inline void prefetch_elements(const void* base, DType dt, int64_t row_stride, int64_t rows,
                              int64_t cols) {
  const auto es = static_cast<int64_t>(dtype_size(dt));
  prefetch_rows<Write>(base, row_stride * es, rows, cols * es);
}

// Rows [0, rows) of a strided source into dst (ld columns, `cols` used), zero-filling columns
// [cols, ld) and rows [rows, rows_pad).
template <typename T>
void load_rows(const void* src, DType dt, int64_t row_stride, int64_t rows, int64_t cols, T* dst,
               int64_t ld, int64_t rows_pad) {
  for (int64_t r = 0; r < rows; ++r) {
    convert_row_in(element(src, dt, r * row_stride), dt, cols, dst + r * ld);
    std::fill(dst + r * ld + cols, dst + (r + 1) * ld, T(0));
  }
  std::fill(dst + rows * ld, dst + rows_pad * ld, T(0));
}

// Rows load_rows_transposed converts at a time; its scratch holds this many rows of `cols`.
constexpr int64_t kTransposeRows = 16;

// The transpose: dst[c * ld + r] = src row r, column c, for c < cols; zeros for r in [rows, pad)
// (pad -1: ld). kTransposeRows rows are converted into scratch, then transposed in W x W register
// blocks (transpose_block), each store a vector of one destination row. (A store per row and
// column made this the forward's top cost over a few query rows.)
template <typename T>
void load_rows_transposed(const void* src, DType dt, int64_t row_stride, int64_t rows, int64_t cols,
                          T* dst, int64_t ld, T* scratch, int64_t pad = -1) {
  constexpr int64_t W = Simd<T>::W;
  static_assert(kTransposeRows % W == 0, "whole register blocks of rows");
  if (pad < 0) pad = ld;
  for (int64_t c = 0; c < cols; ++c) std::fill(dst + c * ld + rows, dst + c * ld + pad, T(0));
  for (int64_t r0 = 0; r0 < rows; r0 += kTransposeRows) {
    const int64_t n = std::min(kTransposeRows, rows - r0);
    for (int64_t i = 0; i < n; ++i)
      convert_row_in(element(src, dt, (r0 + i) * row_stride), dt, cols, scratch + i * cols);
    // Register blocks of W rows by W columns where a destination row has room for all W (its
    // entries past `rows` are zero padding, which the block's zero rows rewrite); the rest by
    // element.
    const int64_t cw = cols / W * W;
    int64_t covered = 0;  // rows [0, covered) of the chunk, columns [0, cw): done by blocks
    for (; covered < n && r0 + covered + W <= ld; covered += W)
      for (int64_t c = 0; c < cw; c += W)
        transpose_block(scratch + covered * cols + c, cols, std::min(W, n - covered),
                        dst + c * ld + r0 + covered, ld);
    covered = std::min(covered, n);
    for (int64_t c = 0; c < cols; ++c) {
      T* out = dst + c * ld + r0;
      for (int64_t i = c < cw ? covered : 0; i < n; ++i) out[i] = scratch[i * cols + c];
    }
  }
}

// Rows of a working buffer, times a, into a strided destination of dtype dt.
template <typename T>
void store_rows(const T* src, int64_t ld, int64_t rows, int64_t cols, T a, void* dst, DType dt,
                int64_t row_stride) {
  for (int64_t r = 0; r < rows; ++r)
    convert_row_out(src + r * ld, a, cols, element(dst, dt, r * row_stride), dt);
}

// An allocator whose value-less construct leaves a trivial T uninitialised.
template <typename T>
struct NoZeroAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = NoZeroAllocator<U>;
  };
  template <typename U>
  void construct(U* p) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};

// A working buffer that lives as long as the thread's share of a call; zero-filled as it grows
// (with the default allocator).
template <typename T, typename Alloc = std::allocator<T>>
struct Buffer {
  std::vector<T, Alloc> data;
  T* get(int64_t n) {
    if (static_cast<int64_t>(data.size()) < n) data.resize(static_cast<size_t>(n));
    return data.data();
  }
};

// Buffer for contents its user writes before reading (the fa2 forward's tiles): not zero-filled
// as it grows (a tiny call's buffers cost more to zero than to compute).
template <typename T>
using RawBuffer = Buffer<T, NoZeroAllocator<T>>;
