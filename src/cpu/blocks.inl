// The block steps both schedules share: the padded geometry of a call, S = QK^T with the mask
// applied, dropout, and one (query block, key block) step of the backward pass (Algorithm 4,
// lines 11-20), so fa1 and fa2 differ only in loop order, parallelism and where O, l, m live.

using detail::BlockMask;
using detail::Mask;

template <typename T>
struct Geometry {
  int64_t d, dp;             // head dim, and padded to the vector tile
  int64_t Br, Bc;            // longest tile of Q rows and of K/V rows
  int64_t Brp, Bcp;          // padded to the micro-kernel tile: the size of every tile buffer
  int64_t nqb, nkb;          // number of Q and K/V tiles
  detail::AxisTiles qt, kt;  // where each tile starts and how long it is
  T c;                       // softmax scale * log2(e)
};

// Keys are a product's column dimension (a multiple of kNR) everywhere, and in the backward's dK
// and dV products also its row dimension (a multiple of kMR): a key tile buffer holds both.
// Kept a multiple of kNR too, so every row of a key-tile buffer starts vector-aligned.
template <typename T>
int64_t padded_keys(int64_t keys) {
  const int64_t as_rows = detail::round_up(keys, int64_t{kMR});
  return detail::round_up(std::max(detail::round_up(keys, kNR<T>), as_rows), kNR<T>);
}

// The key tile for keys cut into segments (a block mask's blocks): a block becomes key tiles of
// about equal size, each a multiple of `align` -- round(block / tile) of them where the tile may
// grow (a block of 128 keys with 96-key tiles is one tile of 128, not 96 + 32), else
// ceil(block / tile) and never longer than `tile` (fa1's tiles are its on-chip budget).
// Query rows are not split this way: a query tile longer than 48 rows leaves L1 (64-row tiles
// cost 26% here, benchmarks/results/cpu_tuning.md), and a short last tile costs little.
inline int64_t block_key_tile(int64_t block, int64_t tile, int64_t align, bool may_grow) {
  const int64_t pieces = may_grow ? std::max<int64_t>(1, (block + tile / 2) / tile)
                                  : detail::ceil_div(block, tile);
  const int64_t t = std::min(block, detail::round_up(detail::ceil_div(block, pieces), align));
  return may_grow ? t : std::min(t, tile);
}

// Tiles of Br query rows and Bc keys. With a block mask both axes are cut at the mask's block
// edges too (detail::AxisTiles), so each tile pair lies in one mask block and is skipped or
// computed whole; key tiles then split each block evenly (block_key_tile), growing past Bc only
// where key_tiles_may_grow.
template <typename T>
Geometry<T> make_geometry(const Params& p, int64_t Br, int64_t Bc, bool key_tiles_may_grow) {
  Geometry<T> g;
  if (p.block_mask_ptr != nullptr) {
    g.qt = detail::make_axis_tiles(p.seqlen_q, p.block_q, Br);
    g.kt = detail::make_axis_tiles(p.seqlen_k, p.block_k,
                                   block_key_tile(p.block_k, Bc, kNR<T>, key_tiles_may_grow));
  } else {
    g.qt = detail::make_axis_tiles(p.seqlen_q, 0, Br);
    g.kt = detail::make_axis_tiles(p.seqlen_k, 0, Bc);
  }
  g.d = p.headdim;
  g.dp = detail::round_up(p.headdim, kNR<T>);
  g.Br = g.qt.tile;
  g.Bc = g.kt.tile;
  g.Brp = detail::round_up(g.Br, kMR);
  g.Bcp = padded_keys<T>(g.Bc);
  g.nqb = g.qt.count();
  g.nkb = g.kt.count();
  g.c = static_cast<T>(p.scale_softmax_log2);
  return g;
}

// One (query tile, key tile) pair: rows [i0, i0 + rows) and keys [j0, j0 + cols), computed at the
// micro-kernel's padded sizes: mp rows (a multiple of kMR), np keys where keys are a product's
// column dimension (a multiple of col_align: kNR, or the vector width where every product on the
// tile takes gemm's one-vector strip) and nm where they are its row dimension (the backward's
// dK, dV; a multiple of kMR). A short tile (the last of a sequence or of a mask block) is computed
// at its own padded size, not at the full tile's.
struct TilePair {
  int64_t i0, rows, mp;
  int64_t j0, cols, np, nm;
};

template <typename T>
TilePair tile_pair(const Geometry<T>& g, int64_t qt, int64_t kt, int64_t col_align = kNR<T>) {
  TilePair t;
  t.i0 = g.qt.start(qt);
  t.rows = g.qt.size(qt);
  t.mp = detail::round_up(t.rows, kMR);
  t.j0 = g.kt.start(kt);
  t.cols = g.kt.size(kt);
  t.np = detail::round_up(t.cols, col_align);
  t.nm = detail::round_up(t.cols, kMR);
  return t;
}

// Per-head buffers of query rows (the backward's Q, dO, lse, D and dQ) give every tile its own Brp
// rows: tile qt starts at row tile_row(g, qt), and its padding rows are zeros that belong to no
// other tile. (Padding read from the next tile's rows would carry that tile's values, NaN
// included, into 0 * x products.)
template <typename T>
int64_t tile_row(const Geometry<T>& g, int64_t qt) {
  return qt * g.Brp;
}
template <typename T>
int64_t padded_rows(const Geometry<T>& g) {
  return g.nqb * g.Brp;
}

// Block order within a head. With a causal, window or block mask, blocks differ in work; visiting
// them as 0, n-1, 1, n-2, ... makes every contiguous run of pairs equally heavy for banded masks,
// so static slices of the task range stay balanced.
inline int64_t block_order(int64_t index, int64_t n, bool zigzag) {
  if (!zigzag) return index;
  return (index % 2 == 0) ? index / 2 : n - 1 - index / 2;
}

inline Mask mask_of(const Params& p) {
  return Mask{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
}

inline bool uneven_work(const Params& p) {
  return p.window_left >= 0 || p.window_right >= 0 || p.block_mask_ptr != nullptr;
}

// Does tile pair (qt, kt) lie in a non-zero block of bm? Always, when bm is dense. Pairs that do not
// are skipped before anything is loaded for them.
template <typename T>
bool pair_in_mask(const Geometry<T>& g, const BlockMask& bm, int64_t qt, int64_t kt) {
  return bm.block(g.qt.segment_of(qt), g.kt.segment_of(kt));
}

// The score modifiers of head (b, h) (detail/score_mod.hpp), or null for plain attention, which
// keeps the unmodified path.
template <typename T>
struct HeadMods {
  detail::ScoreMod<T> mod;
  bool on;
  detail::HeadExtras ex;  // the bias and mask of (b, h) (detail/extras.hpp)
  HeadMods(const Params& p, int64_t b, int64_t h)
      : mod(detail::score_mod_of<T>(p, b, h)),
        on(detail::has_score_mod(p)),
        ex(detail::extras_of(p, b, h)) {}
  const detail::ScoreMod<T>* get() const { return on ? &mod : nullptr; }
  const detail::HeadExtras* extras() const { return ex.any() ? &ex : nullptr; }
};

// Whether the boolean mask keeps every element of the tile pair: mask_scores then leaves the
// mask out for it (a padding or block mask is all True on most tiles).
inline bool mask_tile_full(const detail::HeadExtras* ex, int64_t i0, int64_t rows, int64_t j0,
                           int64_t cols) {
  for (int64_t i = i0; i < i0 + rows; ++i) {
    const uint8_t* k = ex->keep + i * ex->mask_row + j0 * ex->mask_col;
    uint8_t all = 1;
    if (ex->mask_col == 1) {
      for (int64_t j = 0; j < cols; ++j) all &= k[j] != 0;
    } else {
      for (int64_t j = 0; j < cols; ++j) all &= k[j * ex->mask_col] != 0;
    }
    if (!all) return false;
  }
  return true;
}

// Whether the boolean mask hides every element of the tile pair (its rows and keys that exist):
// such pairs are skipped before anything is loaded, as zero blocks of a block mask are.
inline bool mask_tile_empty(const detail::HeadExtras* ex, int64_t i0, int64_t rows, int64_t j0,
                            int64_t cols) {
  if (ex == nullptr || ex->keep == nullptr) return false;
  for (int64_t i = i0; i < i0 + rows; ++i) {
    const uint8_t* k = ex->keep + i * ex->mask_row + j0 * ex->mask_col;
    uint8_t any = 0;
    for (int64_t j = 0; j < cols; ++j) any |= k[j * ex->mask_col];
    if (any) return false;
  }
  return true;
}

// The extras a tile pair needs: ex itself where the mask hides some score of the tile; where it
// keeps every one, the bias alone (in bias_only), or null without a bias, so that the tile takes
// the plain path (scale folded into exp2, the stale-reference tiles) bit for bit as with no mask.
inline const detail::HeadExtras* tile_extras(const detail::HeadExtras* ex, const TilePair& t,
                                             detail::HeadExtras& bias_only) {
  if (ex == nullptr || ex->keep == nullptr || !mask_tile_full(ex, t.i0, t.rows, t.j0, t.cols))
    return ex;
  if (ex->bias == nullptr) return nullptr;
  bias_only = *ex;
  bias_only.keep = nullptr;
  return &bias_only;
}

// Row i's bias over keys [j0 + a, j0 + e) added to s[a, e) (exp2 domain: times log2 e), and keys
// the mask hides set to -inf; returns the max of s[0, n), given -inf outside [a, e) already.
// s[j] = keep[j] ? s[j] + x[j] * c : -inf for j in [0, n) (x null: no bias; keep null: every key
// kept, else contiguous bytes), returning the max of the results: one pass, vectors then a tail.
// W bfloat16 values widened to a float vector (bfloat16 is the top half of a float32).
inline vec_t<float> vload_bf16(const uint16_t* b) {
  constexpr int W = Simd<float>::W;
  typedef uint16_t hvec __attribute__((vector_size(W * 2)));
  typedef uint32_t uvec __attribute__((vector_size(W * 4)));
  hvec h;
  __builtin_memcpy(&h, b, sizeof h);
  const uvec u = __builtin_convertvector(h, uvec) << 16;
  vec_t<float> f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// B: T, or uint16_t for a bfloat16 bias read in place (T float: the top half of a float32).
template <typename T, typename B>
inline T extras_row_fused(T* __restrict s, const B* __restrict x, T c,
                          const uint8_t* __restrict keep, int64_t n) {
  constexpr int W = Simd<T>::W;
  using I = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  typedef I ivec __attribute__((vector_size(FLASHDL_VEC_BYTES)));
  typedef uint8_t bvec __attribute__((vector_size(W)));
  auto value = [](B b) -> T {
    if constexpr (std::is_same_v<B, T>)
      return b;
    else
      return static_cast<T>(bf16_to_float(b));
  };
  auto vvalue = [](const B* b) -> vec_t<T> {
    if constexpr (std::is_same_v<B, T>)
      return vload(b);
    else
      return vload_bf16(b);
  };
  const vec_t<T> vc = vset1(c), ninf = vset1<T>(-INFINITY);
  vec_t<T> vm = ninf;
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    vec_t<T> y = vload(s + j);
    if (x != nullptr) y += vvalue(x + j) * vc;
    if (keep != nullptr) {
      bvec kb;
      __builtin_memcpy(&kb, keep + j, sizeof kb);
      y = __builtin_convertvector(kb, ivec) != 0 ? y : ninf;
    }
    vstore(s + j, y);
    vm = vmax<T>(vm, y);
  }
  T m = hmax<T>(vm);
  for (; j < n; ++j) {
    T y = s[j];
    if (x != nullptr) y += value(x[j]) * c;
    if (keep != nullptr && !keep[j]) y = T(-INFINITY);
    s[j] = y;
    m = y > m ? y : m;
  }
  return m;
}

// Row i's bias over keys [j0 + a, j0 + e) added to s[a, e) (exp2 domain: times log2 e), and keys
// the mask hides set to -inf; returns the max of s[0, n), given -inf outside [a, e) already.
template <typename T>
T apply_extras_row(T* s, const detail::HeadExtras& ex, int64_t i, int64_t j0, int64_t a,
                   int64_t e) {
  if (a >= e) return T(-INFINITY);
  const int64_t n = e - a;
  const T* x = nullptr;
  const uint8_t* keep = nullptr;
  if (ex.keep != nullptr) {
    keep = ex.keep + i * ex.mask_row + (j0 + a) * ex.mask_col;
    if (ex.mask_col != 1) {  // a strided mask row, gathered
      static thread_local std::vector<uint8_t> krow;
      krow.resize(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) krow[j] = keep[j * ex.mask_col];
      keep = krow.data();
    }
  }
  if (ex.bias != nullptr) {
    const int64_t off = ex.bias_offset(i, j0 + a);
    if constexpr (std::is_same_v<T, float>) {
      if (ex.bias_col == 1 && ex.bias_dtype == DType::bfloat16)  // read in place, widened
        return extras_row_fused(s + a,
                                static_cast<const uint16_t*>(element(ex.bias, ex.bias_dtype, off)),
                                static_cast<T>(detail::kLog2e), keep, n);
    }
    if (ex.bias_col == 1 && ((std::is_same_v<T, float> && ex.bias_dtype == DType::float32) ||
                             (std::is_same_v<T, double> && ex.bias_dtype == DType::float64))) {
      x = static_cast<const T*>(element(ex.bias, ex.bias_dtype, off));  // read in place
    } else {
      static thread_local std::vector<T> row;
      row.resize(static_cast<size_t>(n));
      if (ex.bias_col == 1) {
        convert_row_in(element(ex.bias, ex.bias_dtype, off), ex.bias_dtype, n, row.data());
      } else {
        for (int64_t j = 0; j < n; ++j)
          row[j] = static_cast<T>(load_as_double(ex.bias, ex.bias_dtype, off + j * ex.bias_col));
      }
      x = row.data();
    }
  }
  return extras_row_fused(s + a, x, static_cast<T>(detail::kLog2e), keep, n);
}

// The bias rows of a tile pair, prefetched before its score product so that the loads of
// apply_extras_row find them in cache: each row of a tile is a short run in its own page (a
// (1, 8, 2048, 2048) bias: 128-256 bytes every 4-8 KiB), which the hardware prefetcher does not
// follow, and unprefetched the bias load took 88% of apply_extras_row's samples (bfloat16
// backward, perf). With dbias non-null (stored directly), its rows are prefetched for writing.
inline void prefetch_extras_tile(const detail::HeadExtras* ex, const Params& p, int64_t b,
                                 int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                                 bool dbias) {
  if (ex == nullptr || ex->bias == nullptr || ex->bias_col != 1) return;
  const int64_t es = ex->bias_dtype == DType::float64   ? 8
                     : ex->bias_dtype == DType::float32 ? 4
                                                        : 2;
  prefetch_rows(static_cast<const char*>(ex->bias) + ex->bias_offset(i0, j0) * es,
                ex->bias_row * es, rows, cols * es);
  if (!dbias || p.dbias_ptr == nullptr || p.dbias_col_stride != 1) return;
  prefetch_rows<true>(
      static_cast<const char*>(p.dbias_ptr) +
          (b * p.dbias_batch_stride + h * p.dbias_head_stride + i0 * p.dbias_row_stride + j0) * es,
      p.dbias_row_stride * es, rows, cols * es);
}

// S (the tile pair's Q K^T, unscaled) scaled to the exp2 domain, with invisible keys, padding rows
// and padding columns at -inf. Writes each row's max to row_max (mp entries). With score modifiers
// (mod non-null) they are applied before the mask, and grad (non-null: the backward) receives
// d score / d (scale q.k) for every element of the mp x np tile (0 in padding rows).
// With a bias or mask (ex non-null) they follow the modifiers (apply_extras_row).
// Returns whether the boolean mask hides some element of the tile pair (its rows and keys that
// exist): such pairs need the callers' care for NaN and Inf at hidden keys (pair_masked).
template <typename T>
bool mask_scores(const Geometry<T>& g, const Mask& mask, T* S, const TilePair& t, T* row_max,
                 const detail::ScoreMod<T>* mod = nullptr, T* grad = nullptr,
                 const detail::HeadExtras* ex = nullptr) {
  detail::HeadExtras kept_all;
  const bool hidden = ex != nullptr && ex->keep != nullptr &&
                      !mask_tile_full(ex, t.i0, t.rows, t.j0, t.cols);
  if (ex != nullptr && ex->keep != nullptr && !hidden) {
    kept_all = *ex;
    kept_all.keep = nullptr;
    ex = kept_all.bias != nullptr ? &kept_all : nullptr;  // without a bias: the plain path
  }
  if (mod != nullptr) {
    for (int64_t r = 0; r < t.mp; ++r) {
      T* s = S + r * g.Bcp;
      T* gr = grad ? grad + r * g.Bcp : nullptr;
      if (r >= t.rows) {
        std::fill(s, s + t.np, T(-INFINITY));
        if (gr) std::fill(gr, gr + t.np, T(0));
        row_max[r] = T(-INFINITY);
        continue;
      }
      const int64_t i = t.i0 + r;
      const int64_t lo = mask.col_begin(i) - t.j0;
      const int64_t hi = std::min(mask.col_end(i) - t.j0, t.cols);
      row_max[r] = row_modified_range_max(s, t.np, *mod, mask.diag(i) - t.j0, lo, hi, gr);
      if (ex != nullptr)
        row_max[r] = apply_extras_row(s, *ex, i, t.j0, std::max<int64_t>(lo, 0), hi);
    }
    return hidden;
  }
  // Every key of every real row visible, no padding column (padding rows are filled below):
  // one scaled max per row without the window's bounds.
  const bool full = t.cols == t.np &&
                    mask.block_fully_visible(t.i0, t.i0 + t.rows, t.j0, t.j0 + t.cols);
  for (int64_t r = 0; r < t.mp; ++r) {
    T* s = S + r * g.Bcp;
    if (r >= t.rows) {
      std::fill(s, s + t.np, T(-INFINITY));
      row_max[r] = T(-INFINITY);
      continue;
    }
    const int64_t lo = mask.col_begin(t.i0 + r) - t.j0;
    const int64_t hi = std::min(mask.col_end(t.i0 + r) - t.j0, t.cols);
    row_max[r] = full ? row_scale_max(s, t.np, g.c) : row_scale_range_max(s, t.np, g.c, lo, hi);
    if (ex != nullptr)
      row_max[r] = apply_extras_row(s, *ex, t.i0 + r, t.j0, std::max<int64_t>(lo, 0), hi);
  }
  return hidden;
}

// Whether mask_scores' work on a tile pair would be the scale and the row max alone (no score
// modifiers, no bias or mask, every key of every real row visible, no padding column): then a
// caller may leave S unscaled, take each row's max as row_max_of(s) * g.c (row_scale_max's
// value bit for bit, as g.c > 0) and fold the scale into exp2's FMA (row_exp2_lanes' c), one
// pass over S and a store per vector fewer. Padding rows stay as the
// products left them: such callers zero P's padding rows before O += P V, as after mask_scores.
template <typename T>
bool scale_in_exp2(const Geometry<T>& g, const Mask& mask, const TilePair& t,
                   const detail::ScoreMod<T>* mod, const detail::HeadExtras* ex) {
  return mod == nullptr && ex == nullptr && g.c > T(0) && t.cols == t.np &&
         mask.block_fully_visible(t.i0, t.i0 + t.rows, t.j0, t.j0 + t.cols);
}

// S = Q K^T for the tile pair, then mask_scores (whose result it returns).
template <typename T>
bool masked_scores(const Geometry<T>& g, const Mask& mask, const T* Q, const T* Kt, int64_t ldkt,
                   T* S, const TilePair& t, T* row_max, const detail::ScoreMod<T>* mod = nullptr,
                   T* grad = nullptr, const detail::HeadExtras* ex = nullptr) {
  gemm<T, false, false>(t.mp, t.np, g.d, Q, g.dp, Kt, ldkt, S, g.Bcp);
  return mask_scores(g, mask, S, t, row_max, mod, grad, ex);
}

// Z: the dropout multipliers (0 or 1 / (1 - p)) of the tile pair, from the counter-based
// generator; 0 in the padding. The element loop has no other condition so that the compiler
// vectorises the Philox rounds across columns (as in apply_dropout); with the bounds checks folded
// into it, it stayed scalar and cost 5x as much.
template <typename T>
void dropout_multipliers(const Geometry<T>& g, const Params& p, int64_t b, int64_t h,
                         const TilePair& t, T* Z) {
  const T kept = T(1) / (T(1) - static_cast<T>(p.p_dropout));
  const float drop = p.p_dropout;
  const uint64_t seed = p.seed, offset = p.offset;
  const uint64_t bh = detail::dropout_bh(p, b, h);
  for (int64_t r = 0; r < t.mp; ++r) {
    T* z = Z + r * g.Bcp;
    const int64_t n = r < t.rows ? t.cols : 0;
    const uint64_t row = static_cast<uint64_t>(t.i0 + r), j0 = static_cast<uint64_t>(t.j0);
    for (int64_t j = 0; j < n; ++j)
      z[j] = detail::dropout_keep(drop, seed, offset, bh, row, j0 + j) ? kept : T(0);
    std::fill(z + n, z + t.np, T(0));
  }
}

// P *= Z in place, for the rows and columns of the tile pair that exist (l keeps the undropped sum).
template <typename T>
void apply_dropout(const Geometry<T>& g, const Params& p, int64_t b, int64_t h, const TilePair& t,
                   T* P) {
  const T kept = T(1) / (T(1) - static_cast<T>(p.p_dropout));
  const float drop = p.p_dropout;
  const uint64_t seed = p.seed, offset = p.offset;
  const uint64_t bh = detail::dropout_bh(p, b, h);
  for (int64_t r = 0; r < t.rows; ++r) {
    T* pr = P + r * g.Bcp;
    const uint64_t row = static_cast<uint64_t>(t.i0 + r), j0 = static_cast<uint64_t>(t.j0);
    for (int64_t j = 0; j < t.cols; ++j)
      pr[j] *= detail::dropout_keep(drop, seed, offset, bh, row, j0 + j) ? kept : T(0);
  }
}

// The DType whose elements are T (products in T read such inputs in place).
template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, double> ? DType::float64 : DType::float32;
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

// Whether some row of the tile pair cannot see some of its keys (a causal, window or sequence
// edge inside it, or, hidden: mask_scores's result, the boolean mask). Only such pairs can carry
// a key a row cannot see into that row's products.
inline bool pair_masked(const Mask& mask, const TilePair& t, bool hidden) {
  return hidden || !mask.block_fully_visible(t.i0, t.i0 + t.rows, t.j0, t.j0 + t.cols);
}

// Keys a row cannot see never reach it: in a masked tile pair their weight is exactly 0, but a
// product of the whole tile still adds 0 * x for them, NaN when x (a key or value of the caller,
// read as it is) is NaN or Inf. After such a product C (rows of ld g.dp) is checked, and each row
// that came out non-finite is recomputed from its value before the product (C0; null: zero) and
// the keys it sees alone: C[r] = C0[r] + (sum over visible j of A[r][j] * X[j]), X read from the
// caller's array (src: the tile's first key, row_stride apart), the sum formed first from zero
// in key order and added last, as gemm's micro-kernel does, so that a row comes out bitwise as
// the product gives it on the same data with finite values at the keys it cannot see (whose
// terms are +-0 there). pairs (the bfloat16 products of bf16dot.inl): A rounded to bfloat16 and
// each pair of keys summed odd key first, as vdpbf16ps does. Rows that are finite keep the
// product as it was, so the unmasked bulk and masked pairs of finite data pay only the check.
// keep (non-null where the boolean mask hides some element of the pair: mask_scores): keys it
// hides are left out of the sum as well. A pair the boolean mask alone makes masked costs the
// copy of C0 (rows x d) and this check (rows x d), against the product's rows x cols x d.
template <typename T>
void redo_nonfinite_rows(const Geometry<T>& g, const Mask& mask, const TilePair& t, const T* A,
                         const T* C0, T* C, const void* src, DType dt, int64_t row_stride,
                         Buffer<T>& xrow, const detail::HeadExtras* keep = nullptr,
                         bool pairs = false) {
  T* x = nullptr;
  T* sum_row = nullptr;
  for (int64_t r = 0; r < t.rows; ++r) {
    T* c = C + r * g.dp;
    if (row_finite(c, g.d)) continue;
    if (x == nullptr) {
      x = xrow.get(2 * g.dp);
      sum_row = x + g.dp;
    }
    std::fill(sum_row, sum_row + g.dp, T(0));
    const int64_t i = t.i0 + r;
    const int64_t lo = std::max<int64_t>(mask.col_begin(i) - t.j0, 0);
    const int64_t hi = std::min(mask.col_end(i) - t.j0, t.cols);
    auto add = [&](int64_t j) {
      if (j < lo || j >= hi || (keep != nullptr && !keep->kept(i, t.j0 + j))) return;
      T a = A[r * g.Bcp + j];
      if constexpr (std::is_same_v<T, float>)
        if (pairs) a = bf16_to_float(float_to_bf16(a));
      convert_row_in(element(src, dt, j * row_stride), dt, g.d, x);
      for (int64_t e = 0; e < g.d; ++e) sum_row[e] += a * x[e];
    };
    if (pairs) {
      for (int64_t j = lo & ~int64_t{1}; j < hi; j += 2) {
        add(j + 1);
        add(j);
      }
    } else {
      for (int64_t j = lo; j < hi; ++j) add(j);
    }
    if (C0 != nullptr)
      for (int64_t e = 0; e < g.dp; ++e) c[e] = C0[r * g.dp + e] + sum_row[e];
    else
      std::copy(sum_row, sum_row + g.dp, c);
  }
}

// Whether Prod (a set of products: BackwardProducts, Products in fa2.inl, the bfloat16 ones of
// bf16dot.inl) multiplies on bfloat16 pairs (its kBf16Pairs), for redo_nonfinite_rows.
template <typename P, typename = void>
struct PairProducts : std::false_type {};
template <typename P>
struct PairProducts<P, std::void_t<decltype(P::kBf16Pairs)>> : std::bool_constant<P::kBf16Pairs> {};

// Per-call working buffers of one thread for backward_block; dbias: the thread's dBias partial
// (DBiasPartials, DBiasKeyTiles), null where dBias is stored directly or not wanted.
template <typename T>
struct BackwardScratch {
  Buffer<T> S, dS, Z, Pd, G, row_max, dQ0, xrow;
  T* dbias = nullptr;
  // The partial's layout: dBias row r (detail::dbias_row), key j at dbias[r * dbias_ld + j -
  // dbias_col0]; a whole-width partial (DBiasPartials) has ld seqlen_k and col0 0, a key tile's
  // (DBiasKeyTiles) ld Bcp and col0 its first key.
  int64_t dbias_ld = 0, dbias_col0 = 0;
};

// dBias of a backward: where the bias is as large as the problem (no broadcast axis), every
// score's gradient is its own element, computed in exactly one tile pair: stored straight into
// dbias. Otherwise each thread sums into its own compact (bias_batch, bias_heads, bias_rows,
// seqlen_k) partial, and finish() adds the partials into dbias in thread order (bitwise
// reproducible for a given thread count; no (batch, nheads, seqlen_q, seqlen_k) temporary).
template <typename T>
struct DBiasPartials {
  bool on = false, direct = false;
  int64_t elems = 0;
  std::vector<std::vector<T>> part;

  DBiasPartials(const Params& p, int threads) {
    on = p.dbias_ptr != nullptr;
    direct = on && p.bias_batch == p.batch && p.bias_heads == p.nheads && p.bias_rows == p.seqlen_q;
    if (on && !direct) {
      elems = p.bias_batch * p.bias_heads * p.bias_rows * p.seqlen_k;
      part.resize(static_cast<size_t>(threads));
    }
  }
  // Points thread t's scratch at its partial (allocated by the thread that fills it), or at
  // nothing where dBias is stored directly.
  void attach(int t, const Params& p, BackwardScratch<T>& scratch) {
    scratch.dbias = nullptr;
    if (!on || direct) return;
    part[t].assign(static_cast<size_t>(elems), T(0));
    scratch.dbias = part[t].data();
    scratch.dbias_ld = p.seqlen_k;
    scratch.dbias_col0 = 0;
  }
  void finish(const Params& p, int threads) {
    if (!on || direct) return;
    const int64_t rows = p.bias_batch * p.bias_heads * p.bias_rows;
    parallel_for(rows, threads, [&](int64_t begin, int64_t end, int) {
      std::vector<T> acc(static_cast<size_t>(p.seqlen_k));
      for (int64_t r = begin; r < end; ++r) {
        std::fill(acc.begin(), acc.end(), T(0));
        for (const auto& pt : part)
          if (!pt.empty())
            for (int64_t j = 0; j < p.seqlen_k; ++j) acc[j] += pt[r * p.seqlen_k + j];
        const int64_t ii = r % p.bias_rows, hh = (r / p.bias_rows) % p.bias_heads,
                      bb = r / p.bias_rows / p.bias_heads;
        const int64_t o = bb * p.dbias_batch_stride + hh * p.dbias_head_stride +
                          ii * p.dbias_row_stride;
        for (int64_t j = 0; j < p.seqlen_k; ++j) {
          const int64_t at = o + j * p.dbias_col_stride;
          // Added: varlen sequences add into the same elements one after another.
          store_from_double(p.dbias_ptr, p.bias_dtype, at,
                            load_as_double(p.dbias_ptr, p.bias_dtype, at) +
                                static_cast<double>(acc[j]));
        }
      }
    });
  }
};

// Adds rows [0, rows) x keys [j0, j0 + cols) of a dBias partial (row r at acc + r * ld) into
// dbias, whose row r is detail::dbias_row's (added: varlen sequences add into the same elements
// one after another, and dbias starts at zero).
template <typename T>
void add_dbias_block(const Params& p, const T* acc, int64_t ld, int64_t rows, int64_t j0,
                     int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t ii = r % p.bias_rows, hh = (r / p.bias_rows) % p.bias_heads,
                  bb = r / p.bias_rows / p.bias_heads;
    const int64_t o = bb * p.dbias_batch_stride + hh * p.dbias_head_stride +
                      ii * p.dbias_row_stride;
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t at = o + (j0 + j) * p.dbias_col_stride;
      store_from_double(p.dbias_ptr, p.bias_dtype, at,
                        load_as_double(p.dbias_ptr, p.bias_dtype, at) +
                            static_cast<double>(acc[r * ld + j]));
    }
  }
}

// dBias of a broadcast bias with key tiles as the unit of work (fa2_backward_by_keys, tasks in
// key-tile-major order): a thread sums the columns of its current key tile, every dBias row, into a
// float buffer of rows x Bcp in task order and adds it into dbias when it moves to its next key
// tile. A thread's first and last key tiles may be shared with its neighbours' slices: those
// buffers are kept, and finish() sums them over the threads in thread order before adding (bitwise
// reproducible for a given thread count). Extra memory: three rows x Bcp buffers a thread, rows =
// bias_batch * bias_heads * bias_rows -- O(seqlen), where DBiasPartials holds a whole dBias a
// thread (128 MiB for a (1, 1, 4096, 4096) float32 bias on 2 threads).
template <typename T>
struct DBiasKeyTiles {
  struct Slice {
    int64_t first = -1, last = -1, cur = -1;        // key tile indices (task order)
    int64_t first_kt = 0, last_kt = 0, cur_kt = 0;  // and the key tiles they name
    std::vector<T> head, tail, buf;
  };
  int64_t rows = 0, ld = 0;
  std::vector<Slice> slices;

  DBiasKeyTiles(const Params& p, const Geometry<T>& g, int threads)
      : rows(p.bias_batch * p.bias_heads * p.bias_rows),
        ld(g.Bcp),
        slices(static_cast<size_t>(threads)) {}

  // Thread t's slice runs key tile indices first..last.
  void open(int t, int64_t first, int64_t last) {
    slices[t].first = first;
    slices[t].last = last;
    slices[t].cur = -1;
  }
  // Before a task of thread t on key tile kt (index `index` in task order): points the scratch
  // at that tile's buffer, retiring the previous tile's when the tile changes.
  void task(int t, int64_t index, int64_t kt, const Params& p, const Geometry<T>& g,
            BackwardScratch<T>& scratch) {
    Slice& s = slices[t];
    if (index != s.cur) {
      retire(s, p, g);
      s.cur = index;
      s.cur_kt = kt;
      s.buf.assign(static_cast<size_t>(rows * ld), T(0));
    }
    scratch.dbias = s.buf.data();
    scratch.dbias_ld = ld;
    scratch.dbias_col0 = g.kt.start(kt);
  }
  // After thread t's last task.
  void close(int t, const Params& p, const Geometry<T>& g) { retire(slices[t], p, g); }

  // The boundary tiles, summed over the threads in thread order, then added into dbias.
  void finish(const Params& p, const Geometry<T>& g) {
    std::vector<T> acc;
    std::vector<char> done(slices.size() * 2, 0);
    for (size_t a = 0; a < slices.size(); ++a)
      for (int end = 0; end < 2; ++end) {
        if (done[2 * a + end]) continue;
        const Slice& s = slices[a];
        const std::vector<T>& part = end ? s.tail : s.head;
        if (part.empty()) continue;
        const int64_t index = end ? s.last : s.first, kt = end ? s.last_kt : s.first_kt;
        acc.assign(part.size(), T(0));
        for (size_t c = a; c < slices.size(); ++c)  // every piece of this tile, in thread order
          for (int e = 0; e < 2; ++e) {
            const Slice& o = slices[c];
            const std::vector<T>& q = e ? o.tail : o.head;
            if (q.empty() || (e ? o.last : o.first) != index) continue;
            for (size_t x = 0; x < q.size(); ++x) acc[x] += q[x];
            done[2 * c + e] = 1;
          }
        add_dbias_block(p, acc.data(), ld, rows, g.kt.start(kt), g.kt.size(kt));
      }
  }

 private:
  void retire(Slice& s, const Params& p, const Geometry<T>& g) {
    if (s.cur < 0) return;
    if (s.cur == s.first) {
      s.head.swap(s.buf);
      s.first_kt = s.cur_kt;
    } else if (s.cur == s.last) {
      s.tail.swap(s.buf);
      s.last_kt = s.cur_kt;
    } else {  // a tile inside the slice: this thread's alone
      add_dbias_block(p, s.buf.data(), ld, rows, g.kt.start(s.cur_kt), g.kt.size(s.cur_kt));
    }
    s.cur = -1;
  }
};

// d[j] = bfloat16(P[j] != 0 ? dS[j] : 0) for j < n, rounded as float_to_bf16 (to nearest even,
// NaN kept a quiet NaN): vectors, then a scalar tail.
inline void store_dbias_row_bf16(const float* __restrict P, const float* __restrict dS, int64_t n,
                                 uint16_t* __restrict d) {
  constexpr int W = Simd<float>::W;
  typedef uint32_t uvec __attribute__((vector_size(W * 4)));
  typedef uint16_t hvec __attribute__((vector_size(W * 2)));
  const vec_t<float> zero = vset1(0.0f);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const vec_t<float> f = vload(P + j) != zero ? vload(dS + j) : zero;
    uvec u;
    __builtin_memcpy(&u, &f, sizeof u);
    const uvec rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uvec nan = (u >> 16) | 0x40u;
    const uvec r = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
    const hvec h = __builtin_convertvector(r, hvec);
    __builtin_memcpy(d + j, &h, sizeof h);
  }
  for (; j < n; ++j) d[j] = float_to_bf16(P[j] != 0.0f ? dS[j] : 0.0f);
}

// dBias of the tile pair: dS = P * (dP - D) (before the softcap's derivative and the scale) of
// its rows and keys; entries with P = 0 (hidden keys) add nothing, even where dP is not finite.
template <typename T>
void accumulate_dbias(const Geometry<T>& g, const Params& p, int64_t b, int64_t h,
                      const TilePair& t, const T* P, const T* dS, T* partial, int64_t ld,
                      int64_t col0) {
  for (int64_t r = 0; r < t.rows; ++r) {
    const int64_t i = t.i0 + r;
    const T* pr = P + r * g.Bcp;
    const T* ds = dS + r * g.Bcp;
    if (partial != nullptr) {
      T* acc = partial + detail::dbias_row(p, b, h, i) * ld + (t.j0 - col0);
      for (int64_t j = 0; j < t.cols; ++j) acc[j] += pr[j] != T(0) ? ds[j] : T(0);
      continue;
    }
    const int64_t o = b * p.dbias_batch_stride + h * p.dbias_head_stride + i * p.dbias_row_stride;
    if constexpr (std::is_same_v<T, float>) {
      // float32 and bfloat16 rows stored in one pass (the select and conversion vectorised).
      if (p.dbias_col_stride == 1 && p.bias_dtype == DType::float32) {
        float* d = static_cast<float*>(p.dbias_ptr) + o + t.j0;
        for (int64_t j = 0; j < t.cols; ++j) d[j] = pr[j] != 0.0f ? ds[j] : 0.0f;
        continue;
      }
      if (p.dbias_col_stride == 1 && p.bias_dtype == DType::bfloat16) {
        store_dbias_row_bf16(pr, ds, t.cols, static_cast<uint16_t*>(p.dbias_ptr) + o + t.j0);
        continue;
      }
    }
    if (p.dbias_col_stride == 1) {  // a row at a time, converted as out is
      static thread_local std::vector<T> row;
      row.resize(static_cast<size_t>(t.cols));
      for (int64_t j = 0; j < t.cols; ++j) row[j] = pr[j] != T(0) ? ds[j] : T(0);
      convert_row_out(row.data(), T(1), t.cols, element(p.dbias_ptr, p.bias_dtype, o + t.j0),
                      p.bias_dtype);
      continue;
    }
    for (int64_t j = 0; j < t.cols; ++j)
      store_from_double(p.dbias_ptr, p.bias_dtype, o + (t.j0 + j) * p.dbias_col_stride,
                        pr[j] != T(0) ? static_cast<double>(ds[j]) : 0.0);
  }
}

// The backward's five products in T, on the tiles as converted: Q and dO (t.mp rows of dp), K
// (Bcp x dp), K^T and V^T (d x Bcp). dK, dQ without the softmax scale (callers apply it).
template <typename T>
struct BackwardProducts {
  const T *Q, *dO, *K, *Kt, *Vt;
  void scores(const Geometry<T>& g, const TilePair& t, T* S) const {  // S = Q K^T
    gemm<T, false, false>(t.mp, t.np, g.d, Q, g.dp, Kt, g.Bcp, S, g.Bcp);
  }
  void dv(const Geometry<T>& g, const TilePair& t, const T* Pd, T* dV) const {  // dV += Pd^T dO
    gemm<T, true, true>(t.nm, g.dp, t.mp, Pd, g.Bcp, dO, g.dp, dV, g.dp);
  }
  void dp(const Geometry<T>& g, const TilePair& t, T* dP) const {  // dP = dO V^T
    gemm<T, false, false>(t.mp, t.np, g.d, dO, g.dp, Vt, g.Bcp, dP, g.Bcp);
  }
  void dk(const Geometry<T>& g, const TilePair& t, const T* dS, T* dK) const {  // dK += dS^T Q
    gemm<T, true, true>(t.nm, g.dp, t.mp, dS, g.Bcp, Q, g.dp, dK, g.dp);
  }
  void dq(const Geometry<T>& g, const TilePair& t, const T* dS, T* dQ) const {  // dQ += dS K
    gemm<T, false, true>(t.mp, g.dp, t.np, dS, g.Bcp, K, g.dp, dQ, g.dp);
  }
};

// S (t.rows x t.np, ld) = the transpose of ST (keys x query rows, ldst): whole blocks of W
// query rows in registers (t.np is a whole number of vectors: a block's columns past t.cols, from
// its zero rows, stay in the tile's padding), the rest by element; columns [t.cols, t.np) zero.
template <typename T>
void transpose_scores(const T* ST, int64_t ldst, const TilePair& t, T* S, int64_t ld) {
  constexpr int64_t W = Simd<T>::W;
  const int64_t rw = t.rows / W * W;
  for (int64_t r0 = 0; r0 < rw; r0 += W)
    for (int64_t j0 = 0; j0 < t.cols; j0 += W)
      transpose_block(ST + j0 * ldst + r0, ldst, std::min(W, t.cols - j0), S + r0 * ld + j0, ld);
  for (int64_t r = 0; r < t.rows; ++r) {
    T* s = S + r * ld;
    if (r >= rw)
      for (int64_t j = 0; j < t.cols; ++j) s[j] = ST[j * ldst + r];
    std::fill(s + t.cols, s + t.np, T(0));
  }
}

// The backward's products where a head has few query rows (scores_by_keys in fa2.inl): S and dP
// as the transposes of S^T = K Q^T and dP^T = V dO^T, on the key tile's K and V rows as loaded
// (KeyBlock::load_rows_only) and Q^T, dO^T transposed once per query tile (qn columns), instead
// of K^T and V^T packed for every key tile: with 16 query rows over 2,048 keys those two
// transposes were a fifth of the backward. Every score and dP entry is the same sum in the same
// order (bitwise the same backward). ST: Bcp x qn scratch.
// S^T and dP^T take K's and V's rows [0, m0) (m0 = t.cols rounded down to kMR) at K and V, and
// the last partial strip's rows [m0, t.nm) at K_tail and V_tail (dp apart): a row of a
// micro-kernel's result is its own A row's products, so the two calls give the one call's sums,
// and K and V can be the caller's rows in place with only the rows past m0 copied
// (KeyBlock::load_rows_only).
template <typename T>
struct BackwardProductsByKeys {
  const T *Q, *dO, *Qt, *dOt, *K, *V, *K_tail, *V_tail;
  int64_t ldk, ldv, qn;  // K's and V's row strides, Q^T's and dO^T's columns
  T* ST;
  void transposed(const Geometry<T>& g, const TilePair& t, const T* A, int64_t lda, const T* A_tail,
                  const T* Bt, T* X) const {
    const int64_t m0 = t.cols / kMR * kMR;
    gemm<T, false, false>(m0, qn, g.d, A, lda, Bt, qn, ST, qn);
    gemm<T, false, false>(t.nm - m0, qn, g.d, A_tail, g.dp, Bt, qn, ST + m0 * qn, qn);
    transpose_scores(ST, qn, t, X, g.Bcp);
    std::fill(X + t.rows * g.Bcp, X + t.mp * g.Bcp, T(0));  // as Q's (dO's) zero padding rows give
  }
  void scores(const Geometry<T>& g, const TilePair& t, T* S) const {
    transposed(g, t, K, ldk, K_tail, Qt, S);
  }
  void dp(const Geometry<T>& g, const TilePair& t, T* dP) const {
    transposed(g, t, V, ldv, V_tail, dOt, dP);
  }
  void dv(const Geometry<T>& g, const TilePair& t, const T* Pd, T* dV) const {
    BackwardProducts<T>{Q, dO, K, nullptr, nullptr}.dv(g, t, Pd, dV);
  }
  void dk(const Geometry<T>& g, const TilePair& t, const T* dS, T* dK) const {
    BackwardProducts<T>{Q, dO, K, nullptr, nullptr}.dk(g, t, dS, dK);
  }
  void dq(const Geometry<T>& g, const TilePair& t, const T* dS, T* dQ) const {  // dQ += dS K
    gemm<T, false, true>(t.mp, g.dp, t.np, dS, g.Bcp, K, ldk, dQ, g.dp);
  }
};

// One step of Algorithm 4 for the tile pair t (query rows of head (b, h), keys of its kv head):
//   P = exp2(scores - L2); dV += (P*Z)^T dO; dP = (dO V^T)*Z; dS = P*(dP - D);
//   dK += dS^T Q; dQ += dS K           (dK and dQ without the softmax scale; callers apply it)
// with the products of `prod` (BackwardProducts, or bfloat16 ones: bf16dot.inl).
// With a softcap, dS is also multiplied by the cap's derivative G (mask_scores).
// L2 (lse in the exp2 domain) and D hold t.mp entries; dK, dV are Bcp x dp, dQ t.mp x dp.
template <typename T, typename Prod>
void backward_block(const Geometry<T>& g, const Params& p, const Mask& mask, int64_t b, int64_t h,
                    const TilePair& t, const T* L2, const T* D, const Prod& prod, T* dK, T* dV,
                    T* dQ, BackwardScratch<T>& scratch) {
  const int64_t n = g.Brp * g.Bcp;
  T* S = scratch.S.get(n);
  T* dS = scratch.dS.get(n);
  T* row_max = scratch.row_max.get(g.Brp);
  const HeadMods<T> mods(p, b, h);
  T* G = mods.on && mods.mod.capped() ? scratch.G.get(n) : nullptr;
  // dBias stored directly (no partial): its rows are written at the end of this step.
  prefetch_extras_tile(mods.extras(), p, b, h, t.i0, t.rows, t.j0, t.cols,
                       scratch.dbias == nullptr);
  prod.scores(g, t, S);
  const bool hidden = mask_scores(g, mask, S, t, row_max, mods.get(), G, mods.extras());
  // P = exp2(t - lse2); masked entries give exactly 0. lse comes as float32: where |lse2| is
  // huge (|softmax_scale * q.k| near 1e30) its rounding alone exceeds exp2's range, and a lse2
  // rounded below the row's largest score made P = inf and the gradients NaN. P <= 1 holds
  // exactly with the tile's row max as a floor (lse2 >= every score of the row): one max a row.
  // A NaN lse2 (a row that sees a NaN or Inf key; with sinks the forward gives NaN there) takes
  // the floor too: exp2(-inf - NaN) would be NaN at the keys the row cannot see, and P^T dO
  // carried it into dv of keys that only other rows see.
  for (int64_t r = 0; r < t.mp; ++r)
    row_exp2_sum(S + r * g.Bcp, t.np,
                 detail::softmax_reference_point(L2[r] >= row_max[r] ? L2[r] : row_max[r]));

  const bool dropout = p.p_dropout > 0.0f;
  T* Pd = S;
  T* Z = nullptr;
  if (dropout) {
    Z = scratch.Z.get(n);
    T* pd = scratch.Pd.get(n);
    dropout_multipliers(g, p, b, h, t, Z);
    for (int64_t r = 0; r < t.mp; ++r)
      for (int64_t j = r * g.Bcp; j < r * g.Bcp + t.np; ++j) pd[j] = S[j] * Z[j];
    Pd = pd;
  }
  // The dK, dV products read nm >= cols key columns of P and dS: those past np are zero.
  auto zero_tail = [&](T* X) {
    for (int64_t r = 0; t.nm > t.np && r < t.mp; ++r)
      std::fill(X + r * g.Bcp + t.np, X + r * g.Bcp + t.nm, T(0));
  };
  zero_tail(Pd);
  prod.dv(g, t, Pd, dV);
  prod.dp(g, t, dS);
  constexpr int W = Simd<T>::W;
  for (int64_t r = 0; r < t.mp; ++r) {
    const vec_t<T> vd = vset1(D[r]);
    for (int64_t j = r * g.Bcp; j < r * g.Bcp + t.np; j += W) {
      const vec_t<T> dp = dropout ? vload(dS + j) * vload(Z + j) : vload(dS + j);
      vstore(dS + j, vload(S + j) * (dp - vd));
    }
  }
  if (p.dbias_ptr != nullptr)
    accumulate_dbias(g, p, b, h, t, S, dS, scratch.dbias, scratch.dbias_ld, scratch.dbias_col0);
  if (G != nullptr)
    for (int64_t r = 0; r < t.mp; ++r)
      for (int64_t j = r * g.Bcp; j < r * g.Bcp + t.np; j += W)
        vstore(dS + j, vload(dS + j) * vload(G + j));
  const bool masked = pair_masked(mask, t, hidden);
  const detail::HeadExtras* keep = hidden ? mods.extras() : nullptr;
  if (masked) {
    // dS of keys a row cannot see is 0 * (dP - D): NaN where dP read a NaN or Inf value there.
    for (int64_t r = 0; r < t.mp; ++r) {
      T* ds = dS + r * g.Bcp;
      const int64_t i = t.i0 + r;
      const int64_t lo = r < t.rows ? std::max<int64_t>(mask.col_begin(i) - t.j0, 0) : t.np;
      const int64_t hi = r < t.rows ? std::min(mask.col_end(i) - t.j0, t.cols) : t.np;
      if (hi <= lo) {
        std::fill(ds, ds + t.np, T(0));  // the row sees no key of the tile
        continue;
      }
      std::fill(ds, ds + lo, T(0));
      std::fill(ds + hi, ds + t.np, T(0));
      if (keep == nullptr) continue;
      // Keys the boolean mask hides (a select, never 0 * x: rows x cols bytes of the mask read
      // again, only in pairs where it hides something).
      const uint8_t* k = keep->keep + i * keep->mask_row + t.j0 * keep->mask_col;
      for (int64_t j = lo; j < hi; ++j) ds[j] = k[j * keep->mask_col] != 0 ? ds[j] : T(0);
    }
  }
  zero_tail(dS);
  prod.dk(g, t, dS, dK);
  if (!masked) return prod.dq(g, t, dS, dQ);
  T* dQ0 = scratch.dQ0.get(t.mp * g.dp);
  std::copy(dQ, dQ + t.rows * g.dp, dQ0);
  prod.dq(g, t, dS, dQ);
  redo_nonfinite_rows(g, mask, t, dS, dQ0, dQ,
                      element(p.k_ptr, p.dtype, k_offset(p, b, t.j0, h / p.h_h_k_ratio)), p.dtype,
                      p.k_row_stride, scratch.xrow, keep, PairProducts<Prod>::value);
}

// The same step with the products in T on Q, dO (t.mp rows of dp), K (Bcp x dp), Kt, Vt (d x Bcp).
template <typename T>
void backward_block(const Geometry<T>& g, const Params& p, const Mask& mask, int64_t b, int64_t h,
                    const TilePair& t, const T* Q, const T* dO, const T* L2, const T* D, const T* K,
                    const T* Kt, const T* Vt, T* dK, T* dV, T* dQ, BackwardScratch<T>& scratch) {
  backward_block(g, p, mask, b, h, t, L2, D, BackwardProducts<T>{Q, dO, K, Kt, Vt}, dK, dV, dQ,
                 scratch);
}

// K (Bcp x dp), K^T and V^T (d x Bcp) of keys [j0, j0 + cols) of (b, hk), zero-padded to `pad`
// keys (-1: Bcp). The products read np keys of each (a whole number of vectors): a short tile
// (16 keys of a 96-key Bcp) padded to Bcp spent most of its load writing zeros.
template <typename T>
struct KeyBlock {
  Buffer<T> K, Kt, Vt, V, scratch;
  void load(const Params& p, const Geometry<T>& g, int64_t b, int64_t hk, int64_t j0, int64_t cols,
            int64_t pad = -1) {
    if (pad < 0) pad = g.Bcp;
    const void* k = element(p.k_ptr, p.dtype, k_offset(p, b, j0, hk));
    const void* v = element(p.v_ptr, p.dtype, v_offset(p, b, j0, hk));
    prefetch_elements(k, p.dtype, p.k_row_stride, cols, g.d);
    prefetch_elements(v, p.dtype, p.v_row_stride, cols, g.d);
    load_rows(k, p.dtype, p.k_row_stride, cols, g.d, K.get(g.Bcp * g.dp), g.dp, pad);
    load_rows_transposed(k, p.dtype, p.k_row_stride, cols, g.d, Kt.get(g.d * g.Bcp), g.Bcp,
                         scratch.get(kTransposeRows * g.dp), pad);
    load_rows_transposed(v, p.dtype, p.v_row_stride, cols, g.d, Vt.get(g.d * g.Bcp), g.Bcp,
                         scratch.get(kTransposeRows * g.dp), pad);
  }
  // K and V alone for BackwardProductsByKeys: rows [0, cols) at k_rows and v_rows (k_ld and v_ld
  // apart), and the S^T and dP^T products' last partial strip, rows [m0, nm) (m0 and nm: cols
  // rounded down and up to kMR; zero past cols), at k_tail and v_tail (dp apart). The caller's
  // rows are read in place where they are T already, hold whole vectors (d == dp: dQ's product
  // reads dp columns) and need no zero rows for dQ's product (np == cols: it reads np keys), only
  // the tail's cols - m0 rows copied (a 16-key tile's 16 rows of K and of V were copied because
  // the products read 18: cpu_tuning.md section 49); else all converted into K and V (Bcp x dp,
  // zero-padded to max(np, nm) rows), the tails pointing into them.
  const T *k_rows = nullptr, *v_rows = nullptr, *k_tail = nullptr, *v_tail = nullptr;
  int64_t k_ld = 0, v_ld = 0;
  void load_rows_only(const Params& p, const Geometry<T>& g, int64_t b, int64_t hk, int64_t j0,
                      int64_t cols, int64_t np) {
    const void* k = element(p.k_ptr, p.dtype, k_offset(p, b, j0, hk));
    const void* v = element(p.v_ptr, p.dtype, v_offset(p, b, j0, hk));
    prefetch_elements(k, p.dtype, p.k_row_stride, cols, g.d);
    prefetch_elements(v, p.dtype, p.v_row_stride, cols, g.d);
    const int64_t m0 = cols / kMR * kMR, nm = detail::round_up(cols, kMR);
    if (p.dtype == dtype_of<T>() && np == cols && g.d == g.dp) {
      k_rows = static_cast<const T*>(k);
      v_rows = static_cast<const T*>(v);
      k_ld = p.k_row_stride;
      v_ld = p.v_row_stride;
      load_rows(element(k, p.dtype, m0 * p.k_row_stride), p.dtype, p.k_row_stride, cols - m0, g.d,
                K.get(kMR * g.dp), g.dp, nm - m0);
      load_rows(element(v, p.dtype, m0 * p.v_row_stride), p.dtype, p.v_row_stride, cols - m0, g.d,
                V.get(kMR * g.dp), g.dp, nm - m0);
      k_tail = K.data.data();
      v_tail = V.data.data();
      return;
    }
    const int64_t pad = std::max(np, nm);
    load_rows(k, p.dtype, p.k_row_stride, cols, g.d, K.get(g.Bcp * g.dp), g.dp, pad);
    load_rows(v, p.dtype, p.v_row_stride, cols, g.d, V.get(g.Bcp * g.dp), g.dp, pad);
    k_rows = K.data.data();
    v_rows = V.data.data();
    k_ld = v_ld = g.dp;
    k_tail = k_rows + m0 * g.dp;
    v_tail = v_rows + m0 * g.dp;
  }
};

template <typename T>
void store_key_grads(const Params& p, const Geometry<T>& g, int64_t b, int64_t hk, int64_t j0,
                     int64_t cols, const T* dK, const T* dV) {
  void* dk = element(p.dk_ptr, p.dtype,
                     b * p.dk_batch_stride + j0 * p.dk_row_stride + hk * p.dk_head_stride);
  void* dv = element(p.dv_ptr, p.dtype,
                     b * p.dv_batch_stride + j0 * p.dv_row_stride + hk * p.dv_head_stride);
  prefetch_elements<true>(dk, p.dtype, p.dk_row_stride, cols, g.d);
  prefetch_elements<true>(dv, p.dtype, p.dv_row_stride, cols, g.d);
  store_rows(dK, g.dp, cols, g.d, static_cast<T>(p.scale_softmax), dk, p.dtype, p.dk_row_stride);
  store_rows(dV, g.dp, cols, g.d, T(1), dv, p.dtype, p.dv_row_stride);
}
