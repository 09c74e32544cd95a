// Attention over a KV cache (contiguous or paged) on the CPU, built for decoding: a few query rows
// against many keys. A task is one (batch, key split, chunk of rows); its rows are the query rows
// of every head (grouped by kv head), and it walks its keys a tile at a time, reading the rows of
// a few keys for all kv heads together (contiguous in the usual (batch, seqlen, nheads_kv,
// headdim) layout); each key's and value's head row serves all query rows of its GQA group: S by
// dot products against the row, O += P V by multiply-adds into the rows -- no transposed packing,
// whose scatter would cost more than the arithmetic here. The products are a policy of the task
// loop: KvRowsInPlace reads the cache rows in place (AVX-512: float32, float16, and bfloat16 with
// AVX512_BF16), KvRowsWidened converts each row first (every other dtype and instruction set).
// Key splits (split-KV, "flash-decoding") give normalised partial (O, lse), merged exactly
// (detail::merge_weights) once every split is done.
//
// A task per (batch, kv head) read each key's head row alone: one 256-512 byte row per memory
// page with the heads interleaved, 3-4x slower than walking whole rows (measured,
// benchmarks/results/decode_cpu_*.md).

// Rows of one task; kv_rows_per_task() keeps Q, S and O of a task within L1 and L2.
inline int64_t kv_rows_per_task() { return 64; }
// Keys per tile: S holds rows x kv_tile_keys() scores.
inline int64_t kv_tile_keys() { return 64; }
// A split below this many keys costs more in merging and per-task setup than it saves (at 256,
// batch 1 with 1k keys ran 1.4x slower split four ways than whole, 2 threads; at 4k and 16k
// keys four splits beat two; benchmarks/results/decode_cpu_*.md).
inline int64_t kv_min_split_keys() { return 512; }

// Splits per sequence: the caller's num_splits, else as many as keep every thread busy (two
// tasks per thread) while each split keeps kv_min_split_keys() keys; never more than the longest
// sequence's key tiles.
inline int64_t kv_num_splits(const Params& p, int threads, int64_t row_chunks, int64_t max_keys) {
  const int64_t tiles = std::max<int64_t>(1, detail::ceil_div(max_keys, kv_tile_keys()));
  if (p.num_splits > 0) return std::min(p.num_splits, tiles);
  const int64_t tasks = p.batch * row_chunks;
  const int64_t want = detail::ceil_div(int64_t{2} * threads, std::max<int64_t>(tasks, 1));
  const int64_t most = std::max<int64_t>(1, max_keys / kv_min_split_keys());
  return std::max<int64_t>(1, std::min({want, most, tiles}));
}

// s[r * ld] = dot(Q row r, x) for rows [0, n) of Q (rows dp apart): each vector of x is loaded
// once for up to four rows (the rows of a GQA group share the key row).
template <typename T>
inline void rows_dot(const T* Q, int64_t n, const T* x, int64_t dp, T* s, int64_t ld) {
  constexpr int W = Simd<T>::W;
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) {
    vec_t<T> a0{}, a1{}, a2{}, a3{};
    const T* q = Q + r * dp;
    for (int64_t c = 0; c < dp; c += W) {
      const vec_t<T> xv = vload(x + c);
      a0 += vload(q + c) * xv;
      a1 += vload(q + dp + c) * xv;
      a2 += vload(q + 2 * dp + c) * xv;
      a3 += vload(q + 3 * dp + c) * xv;
    }
    s[r * ld] = hsum<T>(a0);
    s[(r + 1) * ld] = hsum<T>(a1);
    s[(r + 2) * ld] = hsum<T>(a2);
    s[(r + 3) * ld] = hsum<T>(a3);
  }
  for (; r < n; ++r) s[r * ld] = row_dot(Q + r * dp, x, dp);
}

// O row r += p[r * ld] * x for rows [0, n) of O (rows dp apart); rows with p 0 are skipped.
template <typename T>
inline void rows_axpy(T* O, int64_t n, const T* x, int64_t dp, const T* p, int64_t ld) {
  constexpr int W = Simd<T>::W;
  for (int64_t r = 0; r < n; ++r) {
    const T a = p[r * ld];
    if (a == T(0)) continue;
    const vec_t<T> va = vset1(a);
    T* o = O + r * dp;
    for (int64_t c = 0; c < dp; c += W) vstore(o + c, vload(o + c) + va * vload(x + c));
  }
}

// Whether a row's boolean mask keeps key j (counted from the sequence's first key, as the kernels
// count): the mask's column is j + cache_leftpad[b], the key's row in the sequence's cache.
struct KvKeep {
  const detail::HeadExtras* ex = nullptr;  // null or no mask: every key kept
  int64_t i = 0, pad = 0;
  bool operator()(int64_t j) const { return ex == nullptr || ex->kept(i, j + pad); }
};

// One key tile of a decode task: keys [t0, t0 + cols) of sequence b (n: cols rounded up to a
// vector), against the task's rows [0, rows), query rows r0.. of kv heads [hk_begin, hk_end).
struct KvTile {
  int64_t b, t0, cols, n, r0, rows, rows_per_kv, hk_begin, hk_end;
  // The task's rows of kv head hk: [first(hk), last(hk)).
  int64_t first(int64_t hk) const { return std::max(hk * rows_per_kv - r0, int64_t{0}); }
  int64_t last(int64_t hk) const { return std::min((hk + 1) * rows_per_kv - r0, rows); }
};

// A task's products on rows converted to T (every dtype): each key and value row of a kv head
// converted once, keys walked in order with their kv heads in turn (whole cache rows).
template <typename T>
struct KvRowsWidened {
  static constexpr bool kNaturalO = true;  // O's columns in order between products
  Buffer<T> qbuf, kbuf;
  T* Q;
  T* row;
  int64_t d, dp;

  KvRowsWidened(int64_t rows, int64_t d_, int64_t dp_) : d(d_), dp(dp_) {
    Q = qbuf.get(rows * dp);
    row = kbuf.get(dp);
  }
  void query(const Params& p, int64_t r, const void* q) {
    load_rows(q, p.dtype, p.q_row_stride, 1, d, Q + r * dp, dp, 1);
  }
  // S rows [0, t.rows) x keys [0, t.cols) (rows ld apart).
  void scores(const Params& p, const KvTile& t, T* S, int64_t ld) {
    for (int64_t j = 0; j < t.cols; ++j)
      for (int64_t hk = t.hk_begin; hk < t.hk_end; ++hk) {
        convert_row_in(element(p.k_ptr, p.dtype, detail::k_cache_offset(p, t.b, t.t0 + j, hk)),
                       p.dtype, d, row);
        std::fill(row + d, row + dp, T(0));
        const int64_t r = t.first(hk);
        rows_dot(Q + r * dp, t.last(hk) - r, row, dp, S + r * ld + j, ld);
      }
  }
  // O += P V, P in S's place (zeros from t.cols to t.n).
  void accumulate(const Params& p, const KvTile& t, T* P, int64_t ld, T* O) {
    for (int64_t j = 0; j < t.cols; ++j)
      for (int64_t hk = t.hk_begin; hk < t.hk_end; ++hk) {
        convert_row_in(element(p.v_ptr, p.dtype, detail::v_cache_offset(p, t.b, t.t0 + j, hk)),
                       p.dtype, d, row);
        std::fill(row + d, row + dp, T(0));
        const int64_t r = t.first(hk);
        rows_axpy(O + r * dp, t.last(hk) - r, row, dp, P + r * ld + j, ld);
      }
  }
  void finish_row(T*) const {}
};

#if FLASHDL_VEC_BYTES == 64
// Products on cache rows read in place, for float32 and float16 caches (KvF32, KvF16 below) and,
// with AVX512_BF16, bfloat16 ones (KvBf16, bf16dot.inl): nothing is converted into a buffer or
// copied per key. S takes query rows in pairs against 8 keys of a kv head at a time (a row left
// over: 16 keys), and sums the vectors of lane products together (kv_reduce8, kv_reduce16: about
// 3 instructions a sum, against 8 for separate horizontal sums); O += P V keeps 64 columns of up
// to 4 rows in registers over 16 keys of each kv head.

// Lane k of the result is the sum of the 16 lanes of v[4 * (k % 4) + k / 4]. The shuffles are
// the zero-masking forms with every lane kept (the same instructions): GCC 12 warns that the
// plain forms' undefined pass-through vector "may be used uninitialized".
inline __m512 kv_reduce16(const __m512* v) {
  constexpr __mmask16 all = 0xFFFF;
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes 0-1: v[2i] halved; 2-3: v[2i + 1]
    w[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(all, v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_maskz_shuffle_f32x4(all, v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // lane q: v[4i + q], 4 partial sums
    x[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(all, w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_maskz_shuffle_f32x4(all, w[2 * i], w[2 * i + 1], 0xDD));
  const __m512 y0 = _mm512_add_ps(_mm512_maskz_shuffle_ps(all, x[0], x[1], 0x44),
                                  _mm512_maskz_shuffle_ps(all, x[0], x[1], 0xEE));
  const __m512 y1 = _mm512_add_ps(_mm512_maskz_shuffle_ps(all, x[2], x[3], 0x44),
                                  _mm512_maskz_shuffle_ps(all, x[2], x[3], 0xEE));
  // element 4q + m: v[4m + q]
  return _mm512_add_ps(_mm512_maskz_shuffle_ps(all, y0, y1, 0x88),
                       _mm512_maskz_shuffle_ps(all, y0, y1, 0xDD));
}

// float32 caches: the interface KvBf16 (bf16dot.inl) documents, on one key per step (whose value
// row kv_accumulate_block loads itself: no values()).
struct KvF32 {
  using Elem = float;
  using Word = float;
  static constexpr bool kNaturalO = true;
  static constexpr int kElems = 16;
  static constexpr int kKeysPerStep = 1;

  static int64_t words(int64_t dp) { return dp; }
  static __m512i load_full(const float* p) { return _mm512_loadu_si512(p); }
  static __m512i load(const float* row, int64_t v, int64_t d) {
    const int64_t left = d - kElems * v;
    if (left >= kElems) return load_full(row + kElems * v);
    if (left <= 0) return _mm512_setzero_si512();
    return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << left) - 1), row + kElems * v);
  }
  static __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
  }
  static void query(const void* q, int64_t d, float* dst, int64_t n) {
    convert_row_in(q, DType::float32, d, dst);
    std::fill(dst + d, dst + n, 0.f);
  }
  static const float* weights(float* P, int64_t ld, int64_t, int64_t, int64_t, Buffer<float>&,
                              int64_t* ldw) {
    *ldw = ld;
    return P;
  }
  static __m512i weight(const float* P, int64_t step) {
    return _mm512_castps_si512(_mm512_set1_ps(P[step]));
  }
  static void finish_row(float*, int64_t) {}
};

// float16 caches: as float32, each vector widened exactly as it is loaded (F16C).
struct KvF16 : KvF32 {
  using Elem = uint16_t;
  // The masked conversion: GCC 12 warns that the unmasked one's undefined pass-through vector
  // "may be used uninitialized".
  static __m512i load_full(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castps_si512(_mm512_maskz_cvtph_ps(static_cast<__mmask16>(0xFFFF), h));
  }
  static __m512i load(const uint16_t* row, int64_t v, int64_t d) {
    const int64_t left = d - kElems * v;
    if (left >= kElems) return load_full(row + kElems * v);
    if (left <= 0) return _mm512_setzero_si512();
    const __mmask16 m = static_cast<__mmask16>((1u << left) - 1);
    const __m256i h = _mm256_maskz_loadu_epi16(m, row + kElems * v);
    return _mm512_castps_si512(_mm512_maskz_cvtph_ps(m, h));
  }
  static void query(const void* q, int64_t d, float* dst, int64_t n) {
    convert_row_in(q, DType::float16, d, dst);
    std::fill(dst + d, dst + n, 0.f);
  }
};

// Lane k < 8 of the result is the sum of the 16 lanes of v[k] (three levels as kv_reduce16's,
// a swap of neighbours and one permutation: 24 instructions for 8 sums); lanes 8-15 are not
// meaningful (kv_store8 writes the 8).
inline __m512 kv_reduce8(const __m512* v) {
  constexpr __mmask16 all = 0xFFFF;
  __m512 w[4], x[2];
  for (int i = 0; i < 4; ++i)  // 128-bit lanes 0-1: v[2i] halved; 2-3: v[2i + 1]
    w[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(all, v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_maskz_shuffle_f32x4(all, v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // lane q: v[4i + q], 4 partial sums
    x[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(all, w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_maskz_shuffle_f32x4(all, w[2 * i], w[2 * i + 1], 0xDD));
  // lane q: 2 partial sums of v[q], then 2 of v[4 + q]
  const __m512 y = _mm512_add_ps(_mm512_maskz_shuffle_ps(all, x[0], x[1], 0x44),
                                 _mm512_maskz_shuffle_ps(all, x[0], x[1], 0xEE));
  // element 4q: v[q]; element 4q + 2: v[4 + q]
  const __m512 z = _mm512_add_ps(y, _mm512_maskz_shuffle_ps(all, y, y, 0xB1));
  alignas(64) static constexpr int32_t kFrom[16] = {0, 4, 8, 12, 2, 6, 10, 14,
                                                    0, 0, 0, 0,  0, 0, 0,  0};
  return _mm512_maskz_permutexvar_ps(all, _mm512_load_si512(kFrom), z);
}

inline void kv_store8(float* dst, __m512 x) { _mm512_mask_storeu_ps(dst, 0x00FF, x); }

// s[r * ld + j] = dot(Q row r, keys[j]) for rows [0, n) and j < 16: Q row r at Q + r * ldq
// (zeros past d), each key a cache row of d values. Rows in pairs take 8 keys at a time, each
// key vector loaded once for both rows (8 key pointers stay in registers; 16 did not); a row
// left over takes all 16 keys at once.
template <typename K>
void kv_scores(const typename K::Word* Q, int64_t ldq, int64_t n,
               const typename K::Elem* const* keys, int64_t d, float* s, int64_t ld) {
  const int64_t full = d / K::kElems, nv = detail::ceil_div(d, int64_t{K::kElems});
  int64_t r = 0;
  for (; r + 2 <= n; r += 2) {
    const typename K::Word* q0 = Q + r * ldq;  // 16 words per vector
    const typename K::Word* q1 = q0 + ldq;
    for (int half = 0; half < 2; ++half) {
      const typename K::Elem* const* kp = keys + 8 * half;
      __m512 a0[8], a1[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
      for (int64_t v = 0; v < nv; ++v) {
        const __m512i x0 = _mm512_loadu_si512(q0 + 16 * v), x1 = _mm512_loadu_si512(q1 + 16 * v);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          const __m512i kv = v < full ? K::load_full(kp[i] + K::kElems * v) : K::load(kp[i], v, d);
          a0[i] = K::dot(a0[i], x0, kv);
          a1[i] = K::dot(a1[i], x1, kv);
        }
      }
      kv_store8(s + r * ld + 8 * half, kv_reduce8(a0));
      kv_store8(s + (r + 1) * ld + 8 * half, kv_reduce8(a1));
    }
  }
  if (r < n) {
    const typename K::Elem* kp[16];  // accumulator i: key 4 * (i % 4) + i / 4, as kv_reduce16 sums
    for (int i = 0; i < 16; ++i) kp[i] = keys[4 * (i % 4) + i / 4];
    const typename K::Word* q = Q + r * ldq;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t v = 0; v < full; ++v) {
      const __m512i qv = _mm512_loadu_si512(q + 16 * v);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = K::dot(acc[i], qv, K::load_full(kp[i] + K::kElems * v));
    }
    if (full < nv) {
      const __m512i qv = _mm512_loadu_si512(q + 16 * full);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = K::dot(acc[i], qv, K::load(kp[i], full, d));
    }
    _mm512_storeu_ps(s + r * ld, kv_reduce16(acc));
  }
}

// O rows [0, R) (ldo apart), columns [c0, c0 + 16 A) += P V over `steps` steps of keys: P row r
// at P + r * ldp (one word per step), the value rows of step t at vals[K::kKeysPerStep * t]
// (one row a step loaded here; KvBf16's pairs by its values()).
template <typename K, int R, int A>
void kv_accumulate_block(const typename K::Word* P, int64_t ldp,
                         const typename K::Elem* const* vals, int64_t steps, int64_t c0, int64_t d,
                         float* O, int64_t ldo) {
  __m512 acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < A; ++k) acc[r][k] = _mm512_loadu_ps(O + r * ldo + c0 + 16 * k);
  // Two loops: with the row's end inside the loop (a branch per load), the accumulators went
  // through the stack at every step.
  auto steps_loop = [&](auto whole) {
    constexpr bool kWhole = decltype(whole)::value;
    for (int64_t t = 0; t < steps; ++t) {
      __m512i w[A];
      if constexpr (K::kKeysPerStep == 1) {
        const typename K::Elem* row = vals[t];
        for (int u = 0; u < A; ++u)
          w[u] = kWhole ? K::load_full(row + c0 + K::kElems * u)
                        : K::load(row, c0 / K::kElems + u, d);
      } else {
        K::template values<A, kWhole>(vals + K::kKeysPerStep * t, c0, d, w);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i pr = K::weight(P + r * ldp, t);
        for (int k = 0; k < A; ++k) acc[r][k] = K::dot(acc[r][k], pr, w[k]);
      }
    }
  };
  if (c0 + 16 * A <= d)  // every column of the block is in the rows
    steps_loop(std::true_type{});
  else
    steps_loop(std::false_type{});
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < A; ++k) _mm512_storeu_ps(O + r * ldo + c0 + 16 * k, acc[r][k]);
}

// O rows [0, n) of dp columns (dp % 32 == 0) += P V, 64 columns of 4 rows at a time.
template <typename K>
void kv_accumulate(const typename K::Word* P, int64_t ldp, int64_t n,
                   const typename K::Elem* const* vals, int64_t steps, int64_t d, float* O,
                   int64_t ldo, int64_t dp) {
  for (int64_t c0 = 0; c0 < dp; c0 += 64) {
    const bool wide = c0 + 64 <= dp;
    auto rows = [&](auto R, int64_t r0) {
      constexpr int kR = decltype(R)::value;
      auto* block = wide ? &kv_accumulate_block<K, kR, 4> : &kv_accumulate_block<K, kR, 2>;
      block(P + r0 * ldp, ldp, vals, steps, c0, d, O + r0 * ldo, ldo);
    };
    int64_t r0 = 0;
    for (; r0 + 4 <= n; r0 += 4) rows(std::integral_constant<int, 4>{}, r0);
    for (; r0 + 2 <= n; r0 += 2) rows(std::integral_constant<int, 2>{}, r0);
    for (; r0 < n; ++r0) rows(std::integral_constant<int, 1>{}, r0);
  }
}

// A task's products on the cache rows in place (K: KvF32 or KvBf16).
template <typename K>
struct KvRowsInPlace {
  static constexpr bool kNaturalO = K::kNaturalO;
  using Elem = typename K::Elem;
  using Word = typename K::Word;
  static_assert(kNR<float> % 32 == 0, "O rows must hold whole 32-column groups");
  Buffer<Word> qbuf, pbuf;
  Buffer<Elem> zbuf;
  Buffer<const Elem*> ptrs;
  Word* Q;
  const Elem* zero_row;  // stands for the keys past a tile's end
  const Elem** rows_of;
  int64_t d, dp, ldq;

  KvRowsInPlace(int64_t rows, int64_t d_, int64_t dp_) : d(d_), dp(dp_), ldq(K::words(dp_)) {
    Q = qbuf.get(rows * ldq);
    zero_row = zbuf.get(dp);  // value-initialised: zeros
    rows_of = ptrs.get(kv_tile_keys());
  }
  void query(const Params&, int64_t r, const void* q) { K::query(q, d, Q + r * ldq, ldq); }
  // rows_of[j] = the cache row of key t.t0 + j0 + j, kv head hk, for j < count.
  const Elem* const* cache_rows(const Params& p, const KvTile& t, bool value, int64_t hk,
                                int64_t j0, int64_t count) {
    for (int64_t j = 0; j < count; ++j) {
      const int64_t key = t.t0 + j0 + j;
      rows_of[j] = j0 + j >= t.cols ? zero_row
                   : value
                       ? static_cast<const Elem*>(p.v_ptr) + detail::v_cache_offset(p, t.b, key, hk)
                       : static_cast<const Elem*>(p.k_ptr) +
                             detail::k_cache_offset(p, t.b, key, hk);
    }
    return rows_of;
  }
  void scores(const Params& p, const KvTile& t, float* S, int64_t ld) {
    for (int64_t j0 = 0; j0 < t.cols; j0 += 16)
      for (int64_t hk = t.hk_begin; hk < t.hk_end; ++hk) {
        const int64_t r = t.first(hk);
        kv_scores<K>(Q + r * ldq, ldq, t.last(hk) - r, cache_rows(p, t, false, hk, j0, 16), d,
                     S + r * ld + j0, ld);
      }
  }
  void accumulate(const Params& p, const KvTile& t, float* P, int64_t ld, float* O) {
    const int64_t steps = detail::ceil_div(t.cols, int64_t{K::kKeysPerStep});
    int64_t ldw = 0;
    const Word* W = K::weights(P, ld, t.rows, t.n, steps, pbuf, &ldw);
    constexpr int64_t kGroup = 16 / K::kKeysPerStep;  // steps of 16 keys: a group's rows of
                                                      // every kv head are read together
    for (int64_t g0 = 0; g0 < steps; g0 += kGroup)
      for (int64_t hk = t.hk_begin; hk < t.hk_end; ++hk) {
        const int64_t r = t.first(hk), count = std::min(kGroup, steps - g0);
        kv_accumulate<K>(W + r * ldw + g0, ldw, t.last(hk) - r,
                         cache_rows(p, t, true, hk, K::kKeysPerStep * g0, K::kKeysPerStep * count),
                         count, d, O + r * dp, dp, dp);
      }
  }
  // O row r += P V over the tile's keys [l, h) that `keep` keeps alone: the value rows of the
  // keys row r does not see are the zero row, selected here, so NaN or Inf in them cannot reach it as 0 * NaN would
  // through accumulate(). The same kernel on the same words as accumulate() gives row r, so the
  // result is accumulate()'s bits wherever the unseen values are finite (zeros' signs aside).
  void accumulate_seen(const Params& p, const KvTile& t, float* P, int64_t ld, int64_t r, int64_t l,
                       int64_t h, const KvKeep& keep, float* o) {
    const int64_t steps = detail::ceil_div(t.cols, int64_t{K::kKeysPerStep});
    const int64_t hk = (t.r0 + r) / t.rows_per_kv;
    int64_t ldw = 0;
    const Word* W = K::weights(P + r * ld, ld, 1, t.n, steps, pbuf, &ldw);
    constexpr int64_t kGroup = 16 / K::kKeysPerStep;
    for (int64_t g0 = 0; g0 < steps; g0 += kGroup) {
      const int64_t count = std::min(kGroup, steps - g0), j0 = K::kKeysPerStep * g0;
      cache_rows(p, t, true, hk, j0, K::kKeysPerStep * count);
      for (int64_t j = 0; j < K::kKeysPerStep * count; ++j)
        if (j0 + j < l || j0 + j >= h || !keep(t.t0 + j0 + j)) rows_of[j] = zero_row;
      kv_accumulate<K>(W + g0, ldw, 1, rows_of, count, d, o, dp, dp);
    }
  }
  void finish_row(float* o) const { K::finish_row(o, dp); }
};
#endif

// Rows r of a task (query (r0 + r) % sq of head (r0 + r) / sq) whose O came out non-finite from a
// tile of keys [t0, t0 + cols) they do not all see: O[r] = O0[r] + sum over the keys of
// [lo[r], hi[r]) in the tile that keep[r] keeps of P[r][j] * V[j], V read from the cache.
template <typename T>
void redo_cut_rows(const Params& p, int64_t b, int64_t sq, int64_t group, int64_t r0, int64_t rows,
                   int64_t t0, int64_t cols, const std::vector<int64_t>& lo,
                   const std::vector<int64_t>& hi, const std::vector<KvKeep>& keep, const T* P,
                   int64_t ld, const T* O0, T* O, int64_t dp, Buffer<T>& xrow) {
  const int64_t d = p.headdim;
  for (int64_t r = 0; r < rows; ++r) {
    T* o = O + r * dp;
    if (row_finite(o, d)) continue;
    T* x = xrow.get(dp);
    std::copy(O0 + r * dp, O0 + (r + 1) * dp, o);
    const int64_t hk = (r0 + r) / sq / group;
    for (int64_t j = std::max(lo[r], t0); j < std::min(hi[r], t0 + cols); ++j) {
      if (!keep[r](j)) continue;  // hidden by the boolean mask
      convert_row_in(element(p.v_ptr, p.dtype, detail::v_cache_offset(p, b, j, hk)), p.dtype, d, x);
      const T a = P[r * ld + (j - t0)];
      for (int64_t e = 0; e < d; ++e) o[e] += a * x[e];
    }
  }
}

template <typename T, typename Rows>
void kvcache_forward_impl(const Params& p, int threads) {
  const int64_t group = p.h_h_k_ratio, sq = p.seqlen_q, d = p.headdim;
  const int64_t dp = detail::round_up(d, kNR<T>);
  const int64_t Bt = kv_tile_keys();
  const int64_t rows_all = p.nheads * sq;  // row r: query r % sq of head r / sq
  const int64_t Rc = std::min(rows_all, kv_rows_per_task());
  const int64_t row_chunks = detail::ceil_div(rows_all, Rc);
  const int64_t rows_per_kv = group * sq;  // rows of kv head hk: [hk, hk + 1) * rows_per_kv
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.batch; ++b) max_keys = std::max<int64_t>(max_keys, p.seqused_k[b]);
  const int64_t S = kv_num_splits(p, threads, row_chunks, max_keys);
  const T c = static_cast<T>(p.scale_softmax_log2);
  constexpr int W = Simd<T>::W;

  // Partial results of split s of row r of batch b: normalised O (dp values) and lse.
  const bool split = S > 1;
  std::vector<T> o_part, lse_part;
  auto part = [&](int64_t b, int64_t s, int64_t r) { return (b * S + s) * rows_all + r; };
  if (split) {
    o_part.assign(static_cast<size_t>(p.batch * S * rows_all * dp), T(0));
    lse_part.assign(static_cast<size_t>(p.batch * S * rows_all), T(-INFINITY));
  }

  parallel_tasks(p.batch * S * row_chunks, threads, [&](Tasks& tasks, int) {
    Buffer<T> sbuf, obuf, o0buf, xrow;
    Rows products(Rc, d, dp);
    T* Sc = sbuf.get(Rc * Bt);
    T* O = obuf.get(Rc * dp);
    T* O0 = o0buf.get(Rc * dp);
    std::vector<detail::OnlineSoftmax<T>> sm(static_cast<size_t>(Rc));
    std::vector<detail::ScoreMod<T>> mod(static_cast<size_t>(Rc));
    std::vector<int64_t> lo(static_cast<size_t>(Rc)), hi(static_cast<size_t>(Rc)),
        diag(static_cast<size_t>(Rc));
    const bool modified = detail::has_score_mod(p);
    // A bias or boolean mask (detail/extras.hpp): row r's head's, read at (query i, key j +
    // cache_leftpad[b]); keep[r] selects the keys the mask keeps when a row is recomputed.
    const bool extras = detail::has_extras(p), masked = p.mask_ptr != nullptr;
    std::vector<detail::HeadExtras> ex(static_cast<size_t>(Rc));
    std::vector<KvKeep> keep(static_cast<size_t>(Rc));
    for (int64_t task = 0; tasks.next(task);) {
      const int64_t rc = task % row_chunks, rest = task / row_chunks;
      const int64_t s = rest % S, b = rest / S;
      const int64_t r0 = rc * Rc, rows = std::min(Rc, rows_all - r0);
      const int64_t hk_begin = r0 / rows_per_kv, hk_end = (r0 + rows - 1) / rows_per_kv + 1;
      const int64_t keys = p.seqused_k[b];
      const int64_t chunk = detail::round_up(detail::ceil_div(keys, S), Bt);
      const int64_t k0 = std::min(keys, s * chunk), k1 = std::min(keys, k0 + chunk);
      const Mask mask{sq, keys, p.window_left, p.window_right};
      const int64_t pad = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;

      // Row r is query i of head h: Q converted, its visible keys and modifiers.
      int64_t any_lo = k1, any_hi = k0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = (r0 + r) / sq, i = (r0 + r) % sq;
        products.query(p, r, element(p.q_ptr, p.dtype, q_offset(p, b, i, h)));
        lo[r] = std::max(mask.col_begin(i), k0);
        hi[r] = std::min(mask.col_end(i), k1);
        diag[r] = mask.diag(i);
        if (modified) mod[r] = detail::score_mod_of<T>(p, b, h);
        if (extras) ex[r] = detail::extras_of(p, b, h);
        keep[r] = KvKeep{masked ? &ex[r] : nullptr, i, pad};
        any_lo = std::min(any_lo, lo[r]);
        any_hi = std::max(any_hi, hi[r]);
      }
      std::fill(O, O + rows * dp, T(0));
      std::fill(sm.begin(), sm.end(), detail::OnlineSoftmax<T>{});

      // Only the keys some row sees (a window's) are read.
      for (int64_t t0 = any_lo; t0 < any_hi; t0 += Bt) {
        const int64_t cols = std::min(Bt, any_hi - t0), n = detail::round_up(cols, int64_t{W});
        const KvTile tile{b, t0, cols, n, r0, rows, rows_per_kv, hk_begin, hk_end};
        products.scores(p, tile, Sc, Bt);     // S = Q K^T
        for (int64_t r = 0; r < rows; ++r) {  // modifiers, mask, online softmax
          T* srow = Sc + r * Bt;
          std::fill(srow + cols, srow + n, T(0));
          const int64_t l = lo[r] - t0, h = std::min(hi[r] - t0, cols);
          T rmax = modified ? row_modified_range_max(srow, n, mod[r], diag[r] - t0, l, h,
                                                     static_cast<T*>(nullptr))
                            : row_scale_range_max(srow, n, c, l, h);
          if (extras)  // bias added, hidden keys -inf, over the keys the row sees
            rmax = apply_extras_row(srow, ex[r], (r0 + r) % sq, t0 + pad, std::max<int64_t>(l, 0),
                                    h);
          const T alpha = sm[r].rescale_factor(rmax);
          sm[r].accumulate(alpha, row_exp2_sum(srow, n, sm[r].reference()));
          if (alpha != T(1)) row_scale(O + r * dp, dp, alpha);
        }
        // A key some row of the tile cannot see has weight 0 for it, but 0 * NaN (or Inf) in
        // its value would still reach the row: rows that come out non-finite are recomputed
        // from the keys they see (blocks.inl: redo_nonfinite_rows). Products that keep O's
        // columns permuted until finish_row (bfloat16's) redo such a row with their own kernel,
        // the unseen keys' value rows selected away (accumulate_seen). The cost on finite
        // values: a copy of O and a scan of it on tiles that cut some row's keys (with one query
        // row, none do).
        bool cut = masked;  // (a boolean mask may hide keys inside [lo, hi))
        for (int64_t r = 0; r < rows && !cut; ++r) cut = lo[r] > t0 || hi[r] < t0 + cols;
        if (cut) std::copy(O, O + rows * dp, O0);
        products.accumulate(p, tile, Sc, Bt, O);  // O += P V
        if constexpr (Rows::kNaturalO) {
          if (cut)
            redo_cut_rows(p, b, sq, group, r0, rows, t0, cols, lo, hi, keep, Sc, Bt, O0, O, dp,
                          xrow);
        } else {
          for (int64_t r = 0; cut && r < rows; ++r) {
            T* o = O + r * dp;
            if (row_finite(o, dp)) continue;
            std::copy(O0 + r * dp, O0 + (r + 1) * dp, o);
            products.accumulate_seen(p, tile, Sc, Bt, r, lo[r] - t0, std::min(hi[r] - t0, cols),
                                     keep[r], o);
          }
        }
      }

      for (int64_t r = 0; r < rows; ++r) {
        const int64_t h = (r0 + r) / sq, i = (r0 + r) % sq;
        products.finish_row(O + r * dp);
        if (!split) {
          T o_scale = sm[r].inv_l(), lse = sm[r].lse();
          if (p.sinks_ptr != nullptr) {  // the sink joins the denominator (fa2.inl's epilogue)
            const auto f = detail::finalize_with_sink(sm[r].m, sm[r].l, detail::sink_of<T>(p, h));
            o_scale = f.o_scale;
            lse = f.lse;
          }
          convert_row_out(O + r * dp, o_scale, d, element(p.o_ptr, p.dtype, o_offset(p, b, i, h)),
                          p.dtype);
          lse_at(p, b, h, i) = static_cast<float>(lse);
        } else {
          const int64_t at = part(b, s, r0 + r);
          row_scale(O + r * dp, dp, sm[r].inv_l());
          std::copy(O + r * dp, O + (r + 1) * dp, o_part.begin() + at * dp);
          lse_part[static_cast<size_t>(at)] = sm[r].lse();
        }
      }
    }
  });
  if (!split) return;

  // Merge the splits of every row, in split order.
  parallel_for(p.batch * rows_all, threads, [&](int64_t begin, int64_t end, int) {
    Buffer<T> acc_buf;
    T* acc = acc_buf.get(dp);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task % rows_all, b = task / rows_all;
      const int64_t h = r / sq, i = r % sq;
      T lse = T(-INFINITY);
      std::fill(acc, acc + dp, T(0));
      for (int64_t s = 0; s < S; ++s) {
        const int64_t at = part(b, s, r);
        const detail::MergeWeights<T> w = detail::merge_weights(lse, lse_part[at]);
        row_axpby(acc, o_part.data() + at * dp, dp, w.wa, w.wb);
        lse = w.lse;
      }
      // The sink joins the merged row once, as a part with no value: out scales by the merged
      // keys' share of the denominator (a row that saw no key: out 0, lse the sink).
      T o_scale = T(1);
      if (p.sinks_ptr != nullptr) {
        const detail::MergeWeights<T> w =
            detail::merge_weights(lse, static_cast<T>(p.sinks_ptr[h * p.sinks_stride]));
        o_scale = w.wa;
        lse = w.lse;
      }
      convert_row_out(acc, o_scale, d, element(p.o_ptr, p.dtype, o_offset(p, b, i, h)), p.dtype);
      lse_at(p, b, h, i) = static_cast<float>(lse);
    }
  });
}

inline void kvcache_forward(const Params& p, int threads) {
  if (p.dtype == DType::float64)
    return kvcache_forward_impl<double, KvRowsWidened<double>>(p, threads);
#if FLASHDL_HAVE_BF16_DOT
  if (p.dtype == DType::bfloat16)
    return kvcache_forward_impl<float, KvRowsInPlace<KvBf16>>(p, threads);
#endif
#if FLASHDL_VEC_BYTES == 64
  if (p.dtype == DType::float32)
    return kvcache_forward_impl<float, KvRowsInPlace<KvF32>>(p, threads);
  if (p.dtype == DType::float16)
    return kvcache_forward_impl<float, KvRowsInPlace<KvF16>>(p, threads);
#endif
  kvcache_forward_impl<float, KvRowsWidened<float>>(p, threads);
}
