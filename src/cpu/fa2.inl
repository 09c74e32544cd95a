// The FlashAttention-2 schedule on the CPU.
// Forward: a task is one Q block of one head; the inner loop walks its visible K/V blocks keeping
// an unnormalised accumulator, normalised once at the end; lse is saved.
// Backward: a task is one K/V block of one kv head; dK and dV stay in the thread's buffers, dQ is
// accumulated in per-thread partial sums over the thread's static slice and reduced in thread
// order, so results are bitwise reproducible for a given thread count. Where query tiles
// outnumber key tiles several times, the loops swap (backward_by_queries, below).

// Br x Bc = 48 x 96 was fastest of seven shapes measured on a 2-core AVX2 machine, forward and
// backward (benchmarks/results/cpu_tuning.md); both are multiples of the micro-kernel tile.
inline int64_t fa2_block_rows() { return 48; }
inline int64_t fa2_block_cols() { return 96; }

// The forward's query tile: fa2_block_rows(), or kLongKeyRows where a head's packed K and V
// (key_bytes a key, both) outgrow a core's L2 (1 MiB on the machine measured): every query tile
// then streams them from L3 or memory once, and three times the rows make a third of those
// passes. Measured with 2 threads: 2,048 x 16,384 float32 d 128 +12%,
// d 64 +12%, bfloat16 d 128 +9%; at 2,048 x 2,048, where they fit, the tile shapes were within
// the noise of each other. Only where the longer tiles still give every thread several tasks,
// and not with a block mask (its blocks set the query tiles).
inline int64_t fa2_forward_block_rows(const Params& p, int64_t key_bytes, int threads) {
  constexpr int64_t kL2 = int64_t{1} << 20, kLongKeyRows = 144;
  if (p.block_mask_ptr != nullptr || p.seqlen_k * key_bytes <= kL2) return fa2_block_rows();
  const int64_t tasks = p.batch * p.nheads * detail::ceil_div(p.seqlen_q, kLongKeyRows);
  return tasks >= 4 * static_cast<int64_t>(threads) ? kLongKeyRows : fa2_block_rows();
}

// K^T and V of one (batch, kv head), tile by tile: tile kt of K^T is d x Bcp at kt * d * Bcp, tile
// kt of V is Bcp x dp at kt * Bcp * dp, each zero-padded. Contiguous tiles keep the micro-kernel's
// B operand in a few pages (a whole-sequence K^T row stride thrashed L1 sets). A tile is packed
// the first time a query tile of this thread needs it, so tiles that only zero blocks of a block
// mask (or no row of a window) cover are never loaded. Heads are kept in `slots` places (one, or
// every kv head where the forward walks the heads of a query tile in turn, heads_together).
template <typename T>
struct PackedKV {
  struct Head {
    RawBuffer<T> Kt, V;        // every tile written whole, padding included, when packed
    std::vector<char> packed;  // per tile: bit 0 K^T, bit 1 V
    int64_t key = -1;
  };
  std::vector<Head> heads = std::vector<Head>(1);
  RawBuffer<T> scratch;
  Head* cur = nullptr;
  int64_t b = 0, hk = 0;

  void slots(int64_t n) {
    if (static_cast<int64_t>(heads.size()) != n) heads.assign(static_cast<size_t>(n), Head{});
  }
  // A new call: nothing packed for an earlier one is valid (same (b, kv head), other data).
  void forget() {
    for (Head& h : heads) h.key = -1;
  }
  // Gives the packed tiles' memory back when it exceeds `bytes` (kept for the next call else).
  void release_if_over(int64_t bytes) {
    int64_t held = 0;
    for (const Head& h : heads)
      held += static_cast<int64_t>((h.Kt.data.capacity() + h.V.data.capacity()) * sizeof(T));
    if (held > bytes) heads = std::vector<Head>(heads.size());
  }
  void select(const Params& p, const Geometry<T>& g, int64_t b_, int64_t hk_) {
    const int64_t k = b_ * p.nheads_kv + hk_;
    b = b_;
    hk = hk_;
    cur = &heads[static_cast<size_t>(hk_) % heads.size()];
    if (k == cur->key) return;
    cur->key = k;
    cur->Kt.get(g.nkb * g.d * g.Bcp);
    cur->V.get(g.nkb * g.Bcp * g.dp);
    cur->packed.assign(static_cast<size_t>(g.nkb), 0);
  }

  // Tile kt of the selected head as (K^T, V), packed on first use.
  std::pair<const T*, const T*> tile(const Params& p, const Geometry<T>& g, int64_t kt) {
    std::vector<char>& packed = cur->packed;
    T* kt_ptr = cur->Kt.data.data() + kt * g.d * g.Bcp;
    if (!(packed[kt] & 1)) {
      const int64_t j0 = g.kt.start(kt), cols = g.kt.size(kt);
      load_rows_transposed(element(p.k_ptr, p.dtype, k_offset(p, b, j0, hk)), p.dtype,
                           p.k_row_stride, cols, g.d, kt_ptr, g.Bcp,
                           scratch.get(kTransposeRows * g.dp));
      packed[kt] |= 1;
    }
    return {kt_ptr, value_tile(p, g, kt)};
  }
  // Tile kt of V alone (Bcp x dp), packed on first use.
  const T* value_tile(const Params& p, const Geometry<T>& g, int64_t kt) {
    std::vector<char>& packed = cur->packed;
    T* v_ptr = cur->V.data.data() + kt * g.Bcp * g.dp;
    if (!(packed[kt] & 2)) {
      const int64_t j0 = g.kt.start(kt), cols = g.kt.size(kt);
      load_rows(element(p.v_ptr, p.dtype, v_offset(p, b, j0, hk)), p.dtype, p.v_row_stride, cols,
                g.d, v_ptr, g.dp, g.Bcp);
      packed[kt] |= 2;
    }
    return v_ptr;
  }
};

// Whether the fa2 forward's products in T compute a tile's scores as S^T = K Q^T (K rows as they
// are, Q^T as the packed operand) and transpose S, instead of S = Q K^T on a packed K^T. The
// transposition then costs seqlen_q x seqlen_k elements of S per head instead of seqlen_k x d of
// K (once per head and thread, for all its query tiles): fewer where a head has fewer query rows
// than about half the head dim.
inline bool scores_by_keys(const Params& p) { return 2 * p.seqlen_q <= p.headdim; }

// The forward's two products in T: S = Q K^T and O += P V on the tiles converted to T (every
// dtype's path; bfloat16 has a faster one where the CPU multiplies bfloat16 pairs, bf16dot.inl).
template <typename T>
struct Products {
  PackedKV<T> kv;
  RawBuffer<T> qbuf, qtbuf, stbuf, kbuf;  // each written whole before it is read
  const T* V = nullptr;
  bool by_keys = false;  // scores_by_keys
  int64_t qn = 0;        // columns of Q^T (the query rows, padded to a vector)

  void slots(int64_t n) { kv.slots(n); }
  void forget() { kv.forget(); }
  void release_if_over(int64_t bytes) { kv.release_if_over(bytes); }

  // Query rows [i0, i0 + rows) of head h, and K/V of (b, hk), for the tiles that follow.
  void start(const Params& p, const Geometry<T>& g, int64_t b, int64_t h, int64_t hk, int64_t i0,
             int64_t rows) {
    kv.select(p, g, b, hk);
    const void* q = element(p.q_ptr, p.dtype, q_offset(p, b, i0, h));
    by_keys = scores_by_keys(p);
    if (!by_keys) {
      load_rows(q, p.dtype, p.q_row_stride, rows, g.d, qbuf.get(g.Brp * g.dp), g.dp, g.Brp);
      return;
    }
    // Q^T straight from the caller's rows (a scalar transpose of a converted Q was a sixth of a
    // 16 x 16 forward).
    qn = detail::round_up(rows, static_cast<int64_t>(Simd<T>::W));
    load_rows_transposed(q, p.dtype, p.q_row_stride, rows, g.d, qtbuf.get(g.d * qn), qn,
                         kv.scratch.get(kTransposeRows * g.dp));
  }
  // S = Q K^T (unscaled) for key tile kt.
  void scores(const Params& p, const Geometry<T>& g, int64_t kt, const TilePair& t, T* S) {
    if (by_keys) return scores_transposed(p, g, kt, t, S);
    const auto [Kt, Vt] = kv.tile(p, g, kt);
    V = Vt;
    gemm<T, false, false>(t.mp, t.np, g.d, qbuf.data.data(), g.dp, Kt, g.Bcp, S, g.Bcp);
  }
  // The same as S^T = K Q^T on the key rows (read in place where they are already T and the tile
  // is a whole number of micro-kernel rows; else converted, no transpose), then S = (S^T)^T for
  // the tile's rows, zeros in its padding columns.
  void scores_transposed(const Params& p, const Geometry<T>& g, int64_t kt, const TilePair& t,
                         T* S) {
    V = kv.value_tile(p, g, kt);
    const int64_t m = detail::round_up(t.cols, static_cast<int64_t>(kMR));
    const void* k = element(p.k_ptr, p.dtype, k_offset(p, kv.b, t.j0, kv.hk));
    const T* K = static_cast<const T*>(k);
    int64_t ldk = p.k_row_stride;
    if (p.dtype != dtype_of<T>() || m != t.cols) {
      T* buf = kbuf.get(g.Bcp * g.dp);
      load_rows(k, p.dtype, p.k_row_stride, t.cols, g.d, buf, g.dp, m);
      K = buf;
      ldk = g.dp;
    }
    T* ST = stbuf.get(g.Bcp * qn);
    gemm<T, false, false>(m, qn, g.d, K, ldk, qtbuf.data.data(), qn, ST, qn);
    transpose_scores(ST, qn, t, S, g.Bcp);
  }
  // O += P V for the key tile of the last scores() call; fresh: O = P V (O not read).
  void accumulate(const Geometry<T>& g, const TilePair& t, const T* P, T* O, bool fresh) {
    if (fresh)
      gemm<T, false, false>(t.mp, g.dp, t.np, P, g.Bcp, V, g.dp, O, g.dp);
    else
      gemm<T, false, true>(t.mp, g.dp, t.np, P, g.Bcp, V, g.dp, O, g.dp);
  }
};

// Whether the forward walks the heads of one query tile in turn (tasks ordered batch, query
// tile, head) rather than the query tiles of one head (batch, head, query tile): where every kv
// head's packed K and V fit a thread's cache together (a few key tiles) and a head has several
// query tiles. A head's query rows are d values in every nheads * d of a (batch, seqlen, nheads,
// headdim) array; walking one head down a long sequence reads a short run every row stride, and
// with seqlen_q = 16,384 over 16 keys that made the forward 4.6x slower than 8x the work of
// 2,048 queries). Across the heads of a tile the rows are read whole.
template <typename T>
bool heads_together(const Params& p, const Geometry<T>& g) {
  constexpr int64_t kBudget = int64_t{2} << 20;  // bytes of packed K and V, every kv head
  const int64_t per_head = g.nkb * (g.d * g.Bcp + g.Bcp * g.dp) * static_cast<int64_t>(sizeof(T));
  return g.nqb > 1 && p.nheads > 1 && per_head * p.nheads_kv <= kBudget;
}

// The forward's tile buffers, one set per thread, kept from call to call: their sizes are one tile
// pair's (rows x keys and rows x headdim: the tile table's, or with a block mask up to one mask
// block's width of keys), not the sequences', so what a thread keeps is bounded, and a stream of
// small calls stops allocating them (a tiny call's mallocs and frees were a tenth of its time).
// One forward at a time per thread: a call's tasks do not nest (a varlen batch runs its
// sequences one after another on each thread, each a call of its own).
template <typename T>
struct ForwardTiles {
  // S, O, O0, row_max and the lane sums are written before they are read (O and the lanes
  // filled per task): no zero-filling as they grow.
  RawBuffer<T> s, o, o0, row_max, lanes;
  std::vector<detail::OnlineSoftmax<T>> sm;
  // stale_reference_tile's: each row's P lane sums, its own max, and whether it is redone.
  RawBuffer<T> tile_lanes, tile_max;
  std::vector<uint8_t> over;
};
template <typename T>
ForwardTiles<T>& forward_tiles() {
  thread_local ForwardTiles<T> tiles;
  return tiles;
}

// The products' packed K and V, one set per thread too, forgotten at the start of every call (the
// same (batch, kv head) holds other data then) and kept for the next one up to kKeptPackedBytes:
// packing into memory fresh from the allocator faulted its pages in on every call wherever glibc
// served it by mmap (16 x 2,048 d 128: 1.7 ms a call, 1.07 ms once torch's allocations had raised
// glibc's mmap threshold). Larger ones are given back after the call.
constexpr int64_t kKeptPackedBytes = int64_t{8} << 20;
template <typename Prod>
Prod& forward_products() {
  thread_local Prod prod;
  return prod;
}

// Step 1 of a row's online softmax for a tile whose scores' max is block_max: the factor for the
// row's accumulator and sums. A tile whose max is no new one leaves the row's reference where it
// was: alpha = 1 without exp2 (the max changes in few tiles, about ln(tiles) of them on random
// scores; the scalar exp2f was 2% of the bfloat16 forward at 2,048 d 64). Not for a row that has
// seen only -inf (alpha is 0 then), nor NaN (the comparison fails).
template <typename T>
inline T rescale_row(detail::OnlineSoftmax<T>& sm, T block_max) {
  return block_max <= sm.m && sm.m > -INFINITY ? T(1) : sm.rescale_factor(block_max);
}

// Whether key tile t can go through stale_reference_tile as a task's first tile (own = true):
// one block of 32 columns (up to 32 keys), every key visible, no score mod, bias, mask or dropout.
inline bool own_reference_ok(const Params& p, const Geometry<float>& g, const Mask& mask,
                             const TilePair& t, const detail::ScoreMod<float>* mod,
                             const detail::HeadExtras* ex) {
  return t.np == 32 && mod == nullptr && ex == nullptr && p.p_dropout == 0.0f && g.c > 0.0f &&
         mask.block_fully_visible(t.i0, t.i0 + t.rows, t.j0, t.j0 + t.cols);
}

// Whether key tile t can go through stale_reference_tile (given rows that have all seen a key):
// every score visible and kept by the mask, if any; no score mod, no dropout; a bias, if any,
// bfloat16 or float32 with its keys contiguous (read in place in the micro-kernel's epilogue).
inline bool stale_reference_ok(const Params& p, const Geometry<float>& g, const Mask& mask,
                               const TilePair& t, const detail::ScoreMod<float>* mod,
                               const detail::HeadExtras* ex) {
  if (mod != nullptr || p.p_dropout != 0.0f || !(g.c > 0.0f) || t.cols != t.np ||
      !mask.block_fully_visible(t.i0, t.i0 + t.rows, t.j0, t.j0 + t.cols))
    return false;
  if (ex == nullptr) return true;
  if (ex->bias != nullptr && (ex->bias_col != 1 || (ex->bias_dtype != DType::bfloat16 &&
                                                    ex->bias_dtype != DType::float32)))
    return false;
  return ex->keep == nullptr || mask_tile_full(ex, t.i0, t.rows, t.j0, t.cols);
}

// A key tile that stale_reference_ok admits, of rows that have all seen earlier tiles, through
// the bfloat16 pair products' scores_exp: P = exp2(c S + log2(e) bias - m) against each row's
// max m from the earlier tiles, computed in the S micro-kernel's epilogue, O and the row's sums
// left unscaled and m unchanged, as FlashAttention-4's conditional rescale does (P up to
// 2^kStaleSlack; exact all the same, m being only the reference P and lse are taken against).
// Rows where an exponent passes m by more than that, or is NaN, are redone as other tiles are,
// from S computed again (the max grows past the slack in few tiles after a row's first). Drops
// S's store, the pass for each row's max (and the bias) and the one reading S back for exp2.
// ex: the head's bias and mask (every score of the tile kept).
// own (own_reference_ok; a task's first tile, O not yet written): each row's reference is its
// own max, taken in the epilogue from the row's 32 columns in registers; O = P V.
template <typename Prod>
void stale_reference_tile(const Params& p, const Geometry<float>& g, const Mask& mask, int64_t kt,
                          const TilePair& t, int64_t rows, const detail::HeadExtras* ex, Prod& prod,
                          ForwardTiles<float>& tiles, detail::OnlineSoftmax<float>* sm,
                          float* lanes, float* S, float* O, bool own) {
  constexpr int64_t W = Simd<float>::W;
  static_assert(PairProducts<Prod>::value && W == 16, "scores_exp's sums are 16 lanes a row");
  float* ref = tiles.row_max.get(g.Brp);
  float* sums = tiles.tile_lanes.get(g.Brp * W);
  if (tiles.over.size() < static_cast<size_t>(g.Brp)) tiles.over.resize(static_cast<size_t>(g.Brp));
  uint8_t* over = tiles.over.data();
  float* own_max = tiles.tile_max.get(g.Brp);
  if (!own)  // own: each row's reference comes from its own scores
    for (int64_t r = 0; r < t.mp; ++r) ref[r] = r < rows ? sm[r].reference() : 0.0f;
  detail::HeadExtras bias_only;  // the bias alone (the mask keeps every score here)
  if (own) {
    prod.scores_exp(p, g, kt, t, g.c, ref, sums, over, static_cast<const void*>(nullptr), 0,
                    own_max);
    for (int64_t r = 0; r < rows; ++r)
      if (!over[r]) sm[r].m = own_max[r];
  } else if (ex != nullptr && ex->bias != nullptr) {
    bias_only = *ex;
    bias_only.keep = nullptr;
    const void* x = element(ex->bias, ex->bias_dtype, ex->bias_offset(t.i0, t.j0));
    if (ex->bias_dtype == DType::bfloat16)
      prod.scores_exp(p, g, kt, t, g.c, ref, sums, over, static_cast<const uint16_t*>(x),
                      ex->bias_row);
    else
      prod.scores_exp(p, g, kt, t, g.c, ref, sums, over, static_cast<const float*>(x),
                      ex->bias_row);
  } else {
    prod.scores_exp(p, g, kt, t, g.c, ref, sums, over, static_cast<const void*>(nullptr), 0);
  }
  bool redo = false;
  for (int64_t r = 0; r < rows; ++r) {
    if (over[r]) {
      redo = true;
      continue;
    }
    vstore(lanes + r * W, vload(lanes + r * W) + vload(sums + r * W));
  }
  if (redo) {
    prod.scores(p, g, kt, t, S);
    if (own) mask_scores(g, mask, S, t, own_max);  // padding columns at -inf, S scaled
    for (int64_t r = 0; r < rows; ++r) {
      if (!over[r]) continue;
      float* s = S + r * g.Bcp;
      float c = g.c, row_max;
      if (own) {
        row_max = own_max[r];
        c = 1.0f;
      } else if (bias_only.bias != nullptr) {  // as mask_scores does it
        row_scale_max(s, t.np, g.c);
        row_max = apply_extras_row(s, bias_only, t.i0 + r, t.j0, 0, t.cols);
        c = 1.0f;
      } else {
        row_max = row_max_of(s, t.np) * g.c;
      }
      const float alpha = rescale_row(sm[r], row_max);
      const vec_t<float> sum = prod.exp_pairs(g, S, r, t.np, c, sm[r].reference());
      vstore(lanes + r * W, vload(lanes + r * W) * vset1(alpha) + sum);
      if (alpha != 1.0f && !own) row_scale(O + r * g.dp, g.dp, alpha);
    }
  }
  prod.accumulate_pairs(g, t, rows, O, own);
}

template <typename T, typename Prod>
void fa2_forward_impl(const Params& p, int threads) {
  // Packed bytes a key: K^T and V rows of d and dp elements, bfloat16 pairs or T.
  const int64_t key_bytes = (p.headdim + detail::round_up(p.headdim, kNR<T>)) *
                            (PairProducts<Prod>::value ? 2 : static_cast<int64_t>(sizeof(T)));
  const Geometry<T> g = make_geometry<T>(p, fa2_forward_block_rows(p, key_bytes, threads),
                                         fa2_block_cols(), true);
  const Mask mask = mask_of(p);
  const bool zigzag = uneven_work(p);
  const bool together = heads_together(p, g);
  parallel_tasks(p.batch * p.nheads * g.nqb, threads, [&](Tasks& tasks, int) {
    Prod& prod = forward_products<Prod>();
    prod.forget();
    prod.slots(together ? p.nheads_kv : 1);
    ForwardTiles<T>& tiles = forward_tiles<T>();
    Buffer<T> xrow;
    T* S = tiles.s.get(g.Brp * g.Bcp);
    T* O = tiles.o.get(g.Brp * g.dp);
    T* O0 = tiles.o0.get(g.Brp * g.dp);
    T* row_max = tiles.row_max.get(g.Brp);
    std::vector<detail::OnlineSoftmax<T>>& sm = tiles.sm;
    if (sm.size() < static_cast<size_t>(g.Brp)) sm.resize(static_cast<size_t>(g.Brp));
    // Each row's running sum l lane by lane (W values a row, rescaled as sm's l would be), added
    // up into sm at the end. (T values, not a std::vector of vectors: the library's templates
    // would handle those outside this file's instruction-set pragma, with another call ABI.)
    constexpr int64_t W = Simd<T>::W;
    T* lanes = tiles.lanes.get(g.Brp * W);
    for (int64_t task = 0; tasks.next(task);) {
      const int64_t per_batch = p.nheads * g.nqb, b = task / per_batch, rest = task % per_batch;
      const int64_t h = together ? rest % p.nheads : rest / g.nqb, hk = h / p.h_h_k_ratio;
      const int64_t qt = block_order(together ? rest / p.nheads : rest % g.nqb, g.nqb, zigzag);
      const int64_t i0 = g.qt.start(qt), rows = g.qt.size(qt);
      const int64_t j_begin = mask.block_col_begin(i0), j_end = mask.block_col_end(i0 + rows);
      const BlockMask bm = detail::block_mask_of(p, b, h);
      const HeadMods<T> mods(p, b, h);
      detail::HeadExtras bias_only;  // tile_extras' bias without the mask

      // O is written by the first tile's O = P V (o_live from then on), not zero-filled first:
      // with few key tiles the fill and the first product's reads of O were a few per cent of
      // the forward.
      bool o_live = false;
      std::fill(sm.begin(), sm.begin() + g.Brp, detail::OnlineSoftmax<T>{});
      std::fill(lanes, lanes + g.Brp * W, T(0));
      bool q_loaded = false;
      for (int64_t kt = g.kt.tile_of(j_begin);
           j_begin < j_end && kt < g.nkb && g.kt.start(kt) < j_end; ++kt) {
        if (!pair_in_mask(g, bm, qt, kt)) continue;  // a zero block: never loaded or computed
        // Products in T pad a tile's keys to one vector (gemm's one-vector strip: a 16-key tile
        // costs 16 columns, not 32); the bfloat16 pair kernels work on whole 32-column groups.
        const TilePair t = tile_pair(g, qt, kt, PairProducts<Prod>::value ? kNR<T> : Simd<T>::W);
        if (mask_tile_empty(mods.extras(), t.i0, t.rows, t.j0, t.cols)) continue;
        // A tile whose mask keeps every score is a plain tile (or a bias-only one).
        const detail::HeadExtras* ex = tile_extras(mods.extras(), t, bias_only);
        if (!q_loaded) {
          prod.start(p, g, b, h, hk, i0, rows);
          q_loaded = true;
        }
        if (kt + 1 < g.nkb)  // the next tile's bias rows, a step ahead (each in its own page)
          prefetch_extras_tile(mods.extras(), p, b, h, i0, rows, g.kt.start(kt + 1),
                               g.kt.size(kt + 1), false);
        if constexpr (PairProducts<Prod>::value) {
          const auto started = [](const detail::OnlineSoftmax<T>& s) { return s.m > -INFINITY; };
          const bool own = !o_live && own_reference_ok(p, g, mask, t, mods.get(), ex);
          if (own || (o_live && stale_reference_ok(p, g, mask, t, mods.get(), ex) &&
                      std::all_of(sm.begin(), sm.begin() + rows, started))) {
            stale_reference_tile(p, g, mask, kt, t, rows, ex, prod, tiles, sm.data(), lanes, S, O,
                                 own);
            o_live = true;
            continue;
          }
        }
        prod.scores(p, g, kt, t, S);
        // c: the scale still to apply in exp2 (scale_in_exp2), or 1 once mask_scores applied it.
        T c = T(1);
        bool hidden = false;
        if (scale_in_exp2(g, mask, t, mods.get(), ex)) {
          c = g.c;
          for (int64_t r = 0; r < rows; ++r) row_max[r] = row_max_of(S + r * g.Bcp, t.np) * c;
        } else {
          hidden = mask_scores(g, mask, S, t, row_max, mods.get(), static_cast<T*>(nullptr), ex);
        }
        // Where P goes straight into O += P V (no dropout, no row to redo), the bfloat16 pair
        // products take it as its exponentials are computed: rounded to pairs in the same pass,
        // not stored as floats and read back (Bf16Products::exp_pairs).
        constexpr bool kPairs = PairProducts<Prod>::value;
        const bool direct = kPairs && p.p_dropout == 0.0f && !pair_masked(mask, t, hidden);
        for (int64_t r = 0; r < rows; ++r) {
          const T alpha = rescale_row(sm[r], row_max[r]);
          vec_t<T> sum;
          if constexpr (kPairs)
            sum = direct ? prod.exp_pairs(g, S, r, t.np, c, sm[r].reference())
                         : row_exp2_lanes(S + r * g.Bcp, t.np, c, sm[r].reference());
          else
            sum = row_exp2_lanes(S + r * g.Bcp, t.np, c, sm[r].reference());
          vstore(lanes + r * W, vload(lanes + r * W) * vset1(alpha) + sum);
          if (alpha != T(1) && o_live) row_scale(O + r * g.dp, g.dp, alpha);
        }
        const bool fresh = !o_live;
        o_live = true;
        if constexpr (kPairs) {
          if (direct) {
            prod.accumulate_pairs(g, t, rows, O, fresh);
            continue;
          }
        }
        for (int64_t r = rows; r < t.mp; ++r) std::fill(S + r * g.Bcp, S + r * g.Bcp + t.np, T(0));
        if (p.p_dropout > 0.0f) apply_dropout(g, p, b, h, t, S);
        if (!pair_masked(mask, t, hidden)) {
          prod.accumulate(g, t, S, O, fresh);
          continue;
        }
        if (fresh) std::fill(O, O + g.Brp * g.dp, T(0));
        std::copy(O, O + rows * g.dp, O0);
        prod.accumulate(g, t, S, O, false);
        redo_nonfinite_rows(g, mask, t, S, O0, O,
                            element(p.v_ptr, p.dtype, v_offset(p, b, t.j0, hk)), p.dtype,
                            p.v_row_stride, xrow, hidden ? mods.extras() : nullptr,
                            PairProducts<Prod>::value);
      }
      if (!o_live) std::fill(O, O + g.Brp * g.dp, T(0));  // no key tile: every row empty
      for (int64_t r = 0; r < rows; ++r) {
        sm[r].l = hsum<T>(vload(lanes + r * W));
        T o_scale = sm[r].inv_l(), lse = sm[r].lse();
        if (p.sinks_ptr != nullptr) {
          const auto f = detail::finalize_with_sink(sm[r].m, sm[r].l, detail::sink_of<T>(p, h));
          o_scale = f.o_scale;
          lse = f.lse;
        }
        convert_row_out(O + r * g.dp, o_scale, g.d,
                        element(p.o_ptr, p.dtype, o_offset(p, b, i0 + r, h)), p.dtype);
        lse_at(p, b, h, i0 + r) = static_cast<float>(lse);
      }
    }
    prod.release_if_over(kKeptPackedBytes);
  });
}

// Q and dO converted to T and padded, with lse in the exp2 domain and D = rowsum(dO * O), for every
// (batch, head): the backward pass's preprocessing. Each head holds padded_rows(g) rows, tile qt
// at row tile_row(g, qt) (blocks.inl).
template <typename T>
struct BackwardInputs {
  // In a BackwardWorkspace, not zero-filled: every tile's rows, padding included, are written once
  // by prepare_backward_inputs (zero-filling them first doubled the memory traffic, which
  // dominated long-query, few-key backward passes; benchmarks/results/cpu_tuning.md).
  T *Q = nullptr, *dO = nullptr, *L2 = nullptr, *D = nullptr;
  // Q^T and dO^T of each query tile (dp x qn_max, the tile's rows padded to a vector as
  // columns), where the products take them (scores_by_keys); else null.
  T *Qt = nullptr, *dOt = nullptr;
  int64_t rows_alloc = 0;
  int64_t bh0 = 0;  // the first (batch, head) held: every one, or one kv head's group (by_keys)

  T* q(int64_t bh, int64_t i) { return Q + ((bh - bh0) * rows_alloc + i) * dp_; }
  T* dout(int64_t bh, int64_t i) { return dO + ((bh - bh0) * rows_alloc + i) * dp_; }
  T* l2(int64_t bh, int64_t i) { return L2 + (bh - bh0) * rows_alloc + i; }
  T* d(int64_t bh, int64_t i) { return D + (bh - bh0) * rows_alloc + i; }
  T* qt(int64_t bh, int64_t tile) { return Qt == nullptr ? nullptr : Qt + t_slot(bh, tile); }
  T* dout_t(int64_t bh, int64_t tile) { return dOt == nullptr ? nullptr : dOt + t_slot(bh, tile); }
  int64_t dp_ = 0, nqb_ = 0, qn_max = 0;

 private:
  int64_t t_slot(int64_t bh, int64_t tile) const {
    return ((bh - bh0) * nqb_ + tile) * dp_ * qn_max;
  }
};

// The columns of a query tile's Q^T: its rows, padded to a whole vector.
template <typename T>
int64_t transposed_rows(int64_t rows) {
  return detail::round_up(rows, static_cast<int64_t>(Simd<T>::W));
}

// Query tile qt of head (b, h) as the backward reads it: Q and dO converted to T (Brp rows of dp,
// padding rows zero: Q = dO = 0 there makes their dS and dV terms 0), lse in the exp2 domain and
// D = rowsum(dO * O) (Brp entries, zero past the tile's rows). O: scratch of Brp x dp.
template <typename T>
void load_query_tile(const Params& p, const Geometry<T>& g, int64_t b, int64_t h, int64_t qt, T* Q,
                     T* dO, T* L2, T* D, T* O, T* Qt = nullptr, T* dOt = nullptr) {
  const int64_t i0 = g.qt.start(qt), rows = g.qt.size(qt);
  const void* q = element(p.q_ptr, p.dtype, q_offset(p, b, i0, h));
  const void* dout = element(p.do_ptr, p.dtype, do_offset(p, b, i0, h));
  const void* out = element(p.o_ptr, p.dtype, o_offset(p, b, i0, h));
  // Every row's lines requested before the first is copied (prefetch_rows says why).
  prefetch_elements(q, p.dtype, p.q_row_stride, rows, g.d);
  prefetch_elements(dout, p.dtype, p.do_row_stride, rows, g.d);
  prefetch_elements(out, p.dtype, p.o_row_stride, rows, g.d);
  load_rows(q, p.dtype, p.q_row_stride, rows, g.d, Q, g.dp, g.Brp);
  load_rows(dout, p.dtype, p.do_row_stride, rows, g.d, dO, g.dp, g.Brp);
  // O is read once, by D's dot products: in place where its rows are T already and hold whole
  // vectors (no zero columns to add), else converted into the scratch first.
  const T* o_rows = static_cast<const T*>(out);
  int64_t o_ld = p.o_row_stride;
  if (p.dtype != dtype_of<T>() || g.d != g.dp) {
    load_rows(out, p.dtype, p.o_row_stride, rows, g.d, O, g.dp, rows);
    o_rows = O;
    o_ld = g.dp;
  }
  for (int64_t r = 0; r < g.Brp; ++r) {
    const bool in_tile = r < rows;
    D[r] = in_tile ? row_dot(dO + r * g.dp, o_rows + r * o_ld, g.dp) : T(0);
    L2[r] = in_tile ? static_cast<T>(lse_at(p, b, h, i0 + r)) * static_cast<T>(detail::kLog2e)
                    : T(0);
  }
  if (Qt == nullptr) return;
  // Q^T and dO^T (dp x qn, columns past the tile's rows zero) for BackwardProductsByKeys.
  constexpr int64_t W = Simd<T>::W;
  const int64_t qn = transposed_rows<T>(rows);
  for (int64_t r0 = 0; r0 < rows; r0 += W)
    for (int64_t c = 0; c < g.dp; c += W) {
      transpose_block(Q + r0 * g.dp + c, g.dp, std::min(W, rows - r0), Qt + c * qn + r0, qn);
      transpose_block(dO + r0 * g.dp + c, g.dp, std::min(W, rows - r0), dOt + c * qn + r0, qn);
    }
}

template <typename T>
void attach_inputs(const Geometry<T>& g, int64_t bh0, int64_t heads, BackwardRows<T>& rows,
                   BackwardInputs<T>& in, bool transposed = false) {
  in.dp_ = g.dp;
  in.rows_alloc = padded_rows(g);
  in.bh0 = bh0;
  const int64_t rows_all = heads * in.rows_alloc;
  in.Q = rows.Q.get(rows_all * g.dp);
  in.dO = rows.dO.get(rows_all * g.dp);
  in.L2 = rows.L2.get(rows_all);
  in.D = rows.D.get(rows_all);
  in.nqb_ = g.nqb;
  in.qn_max = transposed_rows<T>(g.Br);
  const int64_t t_all = transposed ? heads * g.nqb * g.dp * in.qn_max : 0;
  in.Qt = transposed ? rows.Qt.get(t_all) : nullptr;
  in.dOt = transposed ? rows.dOt.get(t_all) : nullptr;
}

template <typename T>
void prepare_backward_inputs(const Params& p, const Geometry<T>& g, int threads,
                             BackwardWorkspace<T>& ws, BackwardInputs<T>& in, bool transposed) {
  attach_inputs(g, 0, p.batch * p.nheads, ws.all, in, transposed);
  parallel_tasks(p.batch * p.nheads * g.nqb, threads, [&](Tasks& tasks, int) {
    T* O = backward_tiles<T>().o.get(g.Brp * g.dp);
    for (int64_t task = 0; tasks.next(task);) {
      // Ordered (batch, query tile, head): a tile's rows of every head are read together
      // (heads_together says why).
      const int64_t b = task / (g.nqb * p.nheads), qt = task / p.nheads % g.nqb;
      const int64_t h = task % p.nheads, bh = b * p.nheads + h;
      const int64_t t0 = tile_row(g, qt);
      load_query_tile(p, g, b, h, qt, in.q(bh, t0), in.dout(bh, t0), in.l2(bh, t0), in.d(bh, t0), O,
                      in.qt(bh, qt), in.dout_t(bh, qt));
    }
  });
}

// The backward's key columns of a tile are a whole number of these: the bfloat16 products' pair
// width (kNR), else one vector, as in the forward (a 16-key tile computed 32 columns of S and dP,
// half of them padding).
template <typename T>
int64_t backward_key_align(const Params& p) {
#if FLASHDL_HAVE_BF16_DOT
  if (std::is_same_v<T, float> && p.dtype == DType::bfloat16) return kNR<T>;
#endif
  return Simd<T>::W;
}

// dQ of head (b, h), every row: scale times the sum of the partials parts[0..n) (a head's rows of
// each thread's dQ partial, at tile_row offsets), in that order; one partial is stored as it is.
template <typename T>
void store_dq_head(const Params& p, const Geometry<T>& g, int64_t b, int64_t h,
                   const T* const* parts, int n, T* acc) {
  for (int64_t i = 0; i < p.seqlen_q; ++i) {
    const int64_t qt = g.qt.tile_of(i), row = tile_row(g, qt) + i - g.qt.start(qt);
    const T* src = parts[0] + row * g.dp;
    if (n > 1) {
      std::fill(acc, acc + g.dp, T(0));
      for (int k = 0; k < n; ++k) row_axpby(acc, parts[k] + row * g.dp, g.dp, T(1), T(1));
      src = acc;
    }
    convert_row_out(src, static_cast<T>(p.scale_softmax), g.d,
                    element(p.dq_ptr, p.dtype,
                            b * p.dq_batch_stride + i * p.dq_row_stride + h * p.dq_head_stride),
                    p.dtype);
  }
}

// The backward with key tiles as tasks: dK and dV of a task stay in the thread's buffers, dQ is
// summed in per-thread partials over the (batch, kv head) pairs of the thread's static slice.
// Tasks in (batch, kv head, key tile) order take one parallel region (one_region): each thread
// converts Q and dO of its kv heads' groups itself (BackwardInputs, one group at a time; a group
// two threads share is converted by both) and stores dQ of the heads no other thread touches;
// the last thread to finish sums the shared ones' partials, in thread order. A small backward
// paid a region's wake-up three times (the inputs, the tasks, the dQ sums): 16 x 16 d 64 on 2
// threads 52 -> 30 us. In key-tile-major order (below) every thread
// touches every head: Q and dO converted once for all (prepare_backward_inputs), and dQ summed
// in a region of its own.
template <typename T>
void fa2_backward_by_keys(const Params& p, const Geometry<T>& g, const Mask& mask, bool zigzag,
                          int threads) {
  Workspace<T> ws;
  const int64_t group = p.h_h_k_ratio;
  const int64_t nbhk = p.batch * p.nheads_kv;
  const int64_t ntasks = nbhk * g.nkb;
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, ntasks)));
  const int64_t head_elems = padded_rows(g) * g.dp;
  DBiasPartials<T> dbias(p, nthreads);
  // A broadcast bias's dBias: tasks in key-tile-major order, each thread summing dBias over the
  // (batch, head) pairs of its key tiles (DBiasKeyTiles, O(seqlen) memory) instead of a whole
  // dBias partial a thread; its dQ partials then cover every (batch, kv head).
  const bool by_tile = dbias.on && !dbias.direct;
  DBiasKeyTiles<T> dbias_tiles(p, g, by_tile ? nthreads : 0);
  // Key-tile-major order also where every head's dQ partial is small (few query rows) and the key
  // tiles are many: a key tile's K and V rows, and its dK and dV rows, are then read and written
  // whole across the kv heads instead of head by head down the sequence (as heads_together, for
  // the forward; at 16 x 16,384 that walk was 45% of the time). With few key tiles a thread's
  // static slice would hold whole tile indices, the short last tile's on one thread alone
  // (128 x 128 d 128: 1.4x slower).
  constexpr int64_t kSmallDq = int64_t{1} << 20;  // bytes of one thread's dQ partials
  constexpr int64_t kManyKeyTiles = 16;
  const bool key_major =
      by_tile || (p.nheads_kv > 1 && g.nkb >= kManyKeyTiles &&
                  p.batch * p.nheads * head_elems * static_cast<int64_t>(sizeof(T)) <= kSmallDq);
  const bool one_region = !key_major;
#if FLASHDL_HAVE_BF16_DOT
  const bool bf16_pairs = std::is_same_v<T, float> && p.dtype == DType::bfloat16;
#else
  const bool bf16_pairs = false;
#endif
  // Few query rows a head: the products on K and V rows as loaded (BackwardProductsByKeys).
  const bool transposed = scores_by_keys(p) && !bf16_pairs;
  BackwardInputs<T> all;  // Q and dO of every head, converted before the tasks (key-tile-major)
  if (!one_region) prepare_backward_inputs(p, g, threads, *ws, all, transposed);
  auto task_of = [&](int64_t task, int64_t& bhk, int64_t& index) {
    bhk = key_major ? task % nbhk : task / g.nkb;
    index = key_major ? task / nbhk : task % g.nkb;
  };
  // dQ partial sums: thread t covers the (batch, kv head) pairs first_bhk[t]..last_bhk[t], those
  // its static slice touches.
  std::vector<std::vector<T>>& dq_part = ws->part;
  if (static_cast<int>(dq_part.size()) < nthreads) dq_part.resize(static_cast<size_t>(nthreads));
  if (static_cast<int>(ws->own.size()) < nthreads) ws->own.resize(static_cast<size_t>(nthreads));
  std::vector<int64_t> first_bhk(static_cast<size_t>(nthreads)), last_bhk(nthreads);
  for (int t = 0; t < nthreads; ++t) {
    int64_t begin, end;
    static_slice(ntasks, nthreads, t, begin, end);
    first_bhk[t] = key_major ? 0 : begin / g.nkb;
    last_bhk[t] = key_major ? nbhk - 1 : (end - 1) / g.nkb;
  }
  // The head partials of (bhk, hg), in thread order, into parts; their count.
  auto partials_of = [&](int64_t bhk, int64_t hg, const T** parts) {
    int n = 0;
    for (int t = 0; t < nthreads; ++t)
      if (first_bhk[t] <= bhk && bhk <= last_bhk[t])
        parts[n++] = dq_part[t].data() + ((bhk - first_bhk[t]) * group + hg) * head_elems;
    return n;
  };
  std::atomic<int> finished{0};
  parallel_for(ntasks, nthreads, [&](int64_t begin, int64_t end, int t) {
    if (by_tile) dbias_tiles.open(t, begin / nbhk, (end - 1) / nbhk);
    std::vector<T>& part = dq_part[t];
    const auto part_elems = static_cast<size_t>((last_bhk[t] - first_bhk[t] + 1) * group *
                                                head_elems);
    // one_region: each kv head group's partials are zeroed when the thread takes up the group and
    // stored (those of heads no other thread touches) when it moves on, while they are in its
    // cache, instead of all zeroed at the start and stored at the end (a 16 x 16 backward's
    // partials, 36 KiB, left L1 in between; cpu_tuning.md section 48).
    if (one_region) {
      if (part.size() < part_elems) part.resize(part_elems);
    } else {
      part.assign(part_elems, T(0));
    }
    std::vector<const T*> parts(static_cast<size_t>(nthreads));
    T* acc = backward_tiles<T>().acc.get(g.dp);
    // dQ of the heads of group bhk that only this thread touches.
    auto store_private_dq = [&](int64_t bhk) {
      for (int64_t hg = 0; hg < group; ++hg)
        if (partials_of(bhk, hg, parts.data()) == 1)
          store_dq_head(p, g, bhk / p.nheads_kv, bhk % p.nheads_kv * group + hg, parts.data(), 1,
                        acc);
    };
    BackwardTiles<T>& tiles = backward_tiles<T>();
    KeyBlock<T>& kb_bufs = tiles.kb;
    BackwardScratch<T>& scratch = tiles.scratch;
#if FLASHDL_HAVE_BF16_DOT
    // bfloat16 inputs: the products on bfloat16 pairs (bf16dot.inl).
    const bool bf16 = std::is_same_v<T, float> && p.dtype == DType::bfloat16;
    Bf16BackwardProducts& bprod = tiles.bprod;
#endif
    if (!by_tile) dbias.attach(t, p, scratch);
    T* dK = tiles.dk.get(g.Bcp * g.dp);
    T* dV = tiles.dv.get(g.Bcp * g.dp);
    BackwardInputs<T> own;  // one_region: Q and dO of the group of kv head `held`
    int64_t held = -1;
    BackwardInputs<T>& in = one_region ? own : all;
    for (int64_t task = begin; task < end; ++task) {
      int64_t bhk, index;
      task_of(task, bhk, index);
      const int64_t b = bhk / p.nheads_kv, hk = bhk % p.nheads_kv;
      if (one_region && bhk != held) {
        if (held >= 0) store_private_dq(held);
        T* group_part = part.data() + (bhk - first_bhk[t]) * group * head_elems;
        std::fill(group_part, group_part + group * head_elems, T(0));
        attach_inputs(g, bhk * group, group, ws->own[t], own, transposed);
        T* O = tiles.o.get(g.Brp * g.dp);
        for (int64_t hg = 0; hg < group; ++hg)
          for (int64_t qt = 0; qt < g.nqb; ++qt) {
            const int64_t bh = bhk * group + hg, t0 = tile_row(g, qt);
            load_query_tile(p, g, b, hk * group + hg, qt, own.q(bh, t0), own.dout(bh, t0),
                            own.l2(bh, t0), own.d(bh, t0), O, own.qt(bh, qt), own.dout_t(bh, qt));
          }
        held = bhk;
      }
      const int64_t kt = block_order(index, g.nkb, zigzag);
      if (by_tile) dbias_tiles.task(t, index, kt, p, g, scratch);
      const int64_t j0 = g.kt.start(kt), cols = g.kt.size(kt);
      // The products touch nm = round_up(cols, kMR) rows of dK and dV, read np keys of K, K^T
      // and V^T (or of K and V, transposed; the bfloat16 pairs are packed from the inputs).
      const int64_t nm = detail::round_up(cols, kMR);
      const int64_t np = detail::round_up(cols, backward_key_align<T>(p));
      std::fill(dK, dK + nm * g.dp, T(0));
      std::fill(dV, dV + nm * g.dp, T(0));
      const int64_t i_begin = mask.row_begin(j0), i_end = mask.row_end(j0 + cols - 1);
      bool kv_loaded = false;
      for (int64_t hg = 0; hg < group && i_begin < i_end; ++hg) {
        const int64_t h = hk * group + hg, bh = b * p.nheads + h;
        const BlockMask bm = detail::block_mask_of(p, b, h);
        const detail::HeadExtras ex = detail::extras_of(p, b, h);
        T* dq_head = part.data() + ((bhk - first_bhk[t]) * group + hg) * head_elems;
        for (int64_t qt = g.qt.tile_of(i_begin); qt < g.nqb && g.qt.start(qt) < i_end; ++qt) {
          if (!pair_in_mask(g, bm, qt, kt)) continue;  // a zero block: never loaded or computed
          if (mask_tile_empty(&ex, g.qt.start(qt), g.qt.size(qt), j0, cols)) continue;
          if (!kv_loaded) {
            if (transposed)
              kb_bufs.load_rows_only(p, g, b, hk, j0, cols, np);
            else if (!bf16_pairs)
              kb_bufs.load(p, g, b, hk, j0, cols, np);
#if FLASHDL_HAVE_BF16_DOT
            if constexpr (std::is_same_v<T, float>)
              if (bf16) bprod.keys(p, g, b, hk, j0, cols);
#endif
            kv_loaded = true;
          }
          const TilePair tp = tile_pair(g, qt, kt, backward_key_align<T>(p));
          const int64_t t0 = tile_row(g, qt);
          if (qt + 1 < g.nqb)  // the next pair's bias (and dBias) rows, a step ahead
            prefetch_extras_tile(&ex, p, b, h, g.qt.start(qt + 1), g.qt.size(qt + 1), j0, cols,
                                 scratch.dbias == nullptr);
#if FLASHDL_HAVE_BF16_DOT
          if constexpr (std::is_same_v<T, float>) {
            if (bf16) {
              bprod.queries(g, tp, in.q(bh, t0), in.dout(bh, t0));
              backward_block(g, p, mask, b, h, tp, in.l2(bh, t0), in.d(bh, t0), bprod, dK, dV,
                             dq_head + t0 * g.dp, scratch);
              continue;
            }
          }
#endif
          if (transposed) {
            const BackwardProductsByKeys<T> prod{in.q(bh, t0),
                                                 in.dout(bh, t0),
                                                 in.qt(bh, qt),
                                                 in.dout_t(bh, qt),
                                                 kb_bufs.k_rows,
                                                 kb_bufs.v_rows,
                                                 kb_bufs.k_tail,
                                                 kb_bufs.v_tail,
                                                 kb_bufs.k_ld,
                                                 kb_bufs.v_ld,
                                                 transposed_rows<T>(tp.rows),
                                                 tiles.st.get(g.Bcp * in.qn_max)};
            backward_block(g, p, mask, b, h, tp, in.l2(bh, t0), in.d(bh, t0), prod, dK, dV,
                           dq_head + t0 * g.dp, scratch);
            continue;
          }
          backward_block(g, p, mask, b, h, tp, in.q(bh, t0), in.dout(bh, t0), in.l2(bh, t0),
                         in.d(bh, t0), kb_bufs.K.data.data(), kb_bufs.Kt.data.data(),
                         kb_bufs.Vt.data.data(), dK, dV, dq_head + t0 * g.dp, scratch);
        }
      }
      store_key_grads(p, g, b, hk, j0, cols, dK, dV);
    }
    if (by_tile) dbias_tiles.close(t, p, g);
    if (!one_region) return;
    // dQ of the last group's heads only this thread touched (the earlier groups' were stored as
    // the thread moved on); the last thread to get here also stores the shared ones (its acquire
    // sees every other thread's partials, released by their add).
    if (held >= 0) store_private_dq(held);
    if (finished.fetch_add(1, std::memory_order_acq_rel) + 1 != nthreads) return;
    int64_t done = -1;  // first_bhk[0], last_bhk[0], first_bhk[1], ... never decrease
    for (int u = 0; u < nthreads; ++u)
      for (const int64_t bhk : {first_bhk[u], last_bhk[u]}) {
        if (bhk <= done) continue;
        done = bhk;
        for (int64_t hg = 0; hg < group; ++hg) {
          const int n = partials_of(bhk, hg, parts.data());
          if (n > 1)
            store_dq_head(p, g, bhk / p.nheads_kv, bhk % p.nheads_kv * group + hg, parts.data(), n,
                          acc);
        }
      }
  });
  if (by_tile)
    dbias_tiles.finish(p, g);
  else
    dbias.finish(p, threads);  // (with by_tile it would add its empty partials: a pass for nothing)
  if (one_region) return;

  // dQ = scale * (sum of the partials in thread order).
  parallel_for(p.batch * p.nheads, threads, [&](int64_t begin, int64_t end, int) {
    std::vector<const T*> parts(static_cast<size_t>(nthreads));
    T* acc = backward_tiles<T>().acc.get(g.dp);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / p.nheads, h = bh % p.nheads;
      const int n = partials_of(b * p.nheads_kv + h / group, h % group, parts.data());
      store_dq_head(p, g, b, h, parts.data(), n, acc);
    }
  });
}

// The backward with query tiles as tasks, for long queries over few keys: dQ of a tile is complete
// when its task ends and goes straight to the output, so nothing of size seqlen_q is allocated;
// dK and dV are summed in per-thread partials over the (batch, kv head) pairs of the thread's
// slice, reduced in thread order (bitwise reproducible for a given thread count, as by_keys).
template <typename T>
void fa2_backward_by_queries(const Params& p, const Geometry<T>& g, const Mask& mask, bool zigzag,
                             int threads) {
  const int64_t group = p.h_h_k_ratio;
  const int64_t ntasks = p.batch * p.nheads * g.nqb;
  const int nthreads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, ntasks)));
  const int64_t kv_elems = g.nkb * g.Bcp * g.dp;  // one (batch, kv head)'s dK (or dV) tiles
  Workspace<T> ws;
  std::vector<std::vector<T>>& dkv_part = ws->part;
  if (static_cast<int>(dkv_part.size()) < nthreads) dkv_part.resize(static_cast<size_t>(nthreads));
  DBiasPartials<T> dbias(p, nthreads);
  // Thread t's partials cover (batch, kv head) pairs first_bhk[t]..last_bhk[t]: bhk = bh / group.
  std::vector<int64_t> first_bhk(static_cast<size_t>(nthreads), 0), last_bhk(nthreads, -1);
  // Tasks ordered (batch, query tile, head) where a head has one key tile: the heads of a query
  // tile in turn read its rows of Q, dO and O, and write those of dQ, whole, where walking one
  // head down the sequence reads a short run every row stride (heads_together says more; each
  // kv head's key tile is kept in a slot of its own, below). Else (batch, head, query tile).
  // Either way a thread's static slice, so the partials' sums stay bitwise reproducible.
  const bool heads_inner = g.nkb == 1 && heads_together(p, g);
  const int64_t per_batch = p.nheads * g.nqb;
  parallel_for(ntasks, nthreads, [&](int64_t begin, int64_t end, int t) {
    first_bhk[t] = heads_inner ? begin / per_batch * p.nheads_kv : begin / g.nqb / group;
    last_bhk[t] = heads_inner ? ((end - 1) / per_batch + 1) * p.nheads_kv - 1
                              : (end - 1) / g.nqb / group;
    std::vector<T>& part = dkv_part[t];
    part.assign(static_cast<size_t>((last_bhk[t] - first_bhk[t] + 1) * 2 * kv_elems), T(0));
    BackwardTiles<T>& tiles = backward_tiles<T>();
    T* Q = tiles.q.get(g.Brp * g.dp);
    T* dO = tiles.dout.get(g.Brp * g.dp);
    T* L2 = tiles.l2.get(g.Brp);
    T* D = tiles.d.get(g.Brp);
    T* O = tiles.o.get(g.Brp * g.dp);
    T* dQ = tiles.dq.get(g.Brp * g.dp);
    // Key tiles as loaded (and converted), kept in slots across tasks: one per kv head where the
    // heads of a query tile go in turn (heads_inner); every key tile of the (batch, kv head) at
    // hand where they fit kKeptKeyTiles (its query tiles, one task after another, each walk all
    // of them: reloading a tile for every pair was ~13% of a float32 4,096 x 1,024 d 128
    // backward); else one. The bfloat16 products hold a task's query
    // rows beside the key tile: with a slot a tile, each slot converts them once a task.
    constexpr int64_t kKeptKeyTiles = int64_t{4} << 20;  // bytes: K, K^T and V^T of each tile,
    const int64_t tile_units = p.dtype == DType::bfloat16 ? 5 : 3;  // (+ the pairs in bfloat16)
    const bool keep_tiles = !heads_inner && g.nkb > 1 &&
                            g.nkb * tile_units * g.Bcp * g.dp * int64_t{sizeof(T)} <= kKeptKeyTiles;
    const int64_t slots = heads_inner ? p.nheads_kv : keep_tiles ? g.nkb : 1;
    std::vector<KeyBlock<T>>& kb_slots = tiles.slots;
    if (static_cast<int64_t>(kb_slots.size()) < slots) kb_slots.resize(static_cast<size_t>(slots));
    std::vector<int64_t> loaded(static_cast<size_t>(slots), -1);   // the (bhk, key tile) in each
    std::vector<int64_t> queried(static_cast<size_t>(slots), -1);  // the task whose rows each has
    BackwardScratch<T>& scratch = tiles.scratch;
    dbias.attach(t, p, scratch);
#if FLASHDL_HAVE_BF16_DOT
    const bool bf16 = std::is_same_v<T, float> && p.dtype == DType::bfloat16;
    std::vector<Bf16BackwardProducts>& bprods = tiles.bprods;
    if (bf16 && static_cast<int64_t>(bprods.size()) < slots)
      bprods.resize(static_cast<size_t>(slots));
#endif
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = heads_inner ? task / per_batch * p.nheads + task % p.nheads : task / g.nqb;
      const int64_t b = bh / p.nheads, h = bh % p.nheads, hk = h / group, bhk = bh / group;
      const int64_t qt = block_order(heads_inner ? task % per_batch / p.nheads : task % g.nqb,
                                     g.nqb, zigzag);
      const int64_t i0 = g.qt.start(qt), rows = g.qt.size(qt);
      const int64_t j_begin = mask.block_col_begin(i0), j_end = mask.block_col_end(i0 + rows);
      const BlockMask bm = detail::block_mask_of(p, b, h);
      const detail::HeadExtras ex = detail::extras_of(p, b, h);
      T* dK_head = part.data() + (bhk - first_bhk[t]) * 2 * kv_elems;
      T* dV_head = dK_head + kv_elems;
      std::fill(dQ, dQ + g.Brp * g.dp, T(0));
      bool q_loaded = false;
      for (int64_t kt = g.kt.tile_of(j_begin);
           j_begin < j_end && kt < g.nkb && g.kt.start(kt) < j_end; ++kt) {
        if (!pair_in_mask(g, bm, qt, kt)) continue;  // a zero block: never loaded or computed
        const TilePair tp = tile_pair(g, qt, kt, backward_key_align<T>(p));
        if (mask_tile_empty(&ex, tp.i0, tp.rows, tp.j0, tp.cols)) continue;
        const auto slot = static_cast<size_t>(heads_inner ? hk : keep_tiles ? kt : 0);
        KeyBlock<T>& kb_bufs = kb_slots[slot];
        if (!q_loaded) {
          load_query_tile(p, g, b, h, qt, Q, dO, L2, D, O);
          q_loaded = true;
        }
#if FLASHDL_HAVE_BF16_DOT
        Bf16BackwardProducts* bp = bf16 ? &bprods[slot] : nullptr;
        if constexpr (std::is_same_v<T, float>) {
          if (bf16 && queried[slot] != task) {
            bp->queries(g, tp, Q, dO);
            queried[slot] = task;
          }
        }
#endif
        if (loaded[slot] != bhk * g.nkb + kt) {
#if FLASHDL_HAVE_BF16_DOT
          if constexpr (std::is_same_v<T, float>)
            if (bf16) bp->keys(p, g, b, hk, tp.j0, tp.cols);
          if (!bf16)
#endif
            kb_bufs.load(p, g, b, hk, tp.j0, tp.cols, tp.np);
          loaded[slot] = bhk * g.nkb + kt;
        }
        T* dK = dK_head + kt * g.Bcp * g.dp;
        T* dV = dV_head + kt * g.Bcp * g.dp;
        if (kt + 1 < g.nkb)  // the next pair's bias (and dBias) rows, a step ahead
          prefetch_extras_tile(&ex, p, b, h, tp.i0, tp.rows, g.kt.start(kt + 1), g.kt.size(kt + 1),
                               scratch.dbias == nullptr);
#if FLASHDL_HAVE_BF16_DOT
        if constexpr (std::is_same_v<T, float>) {
          if (bf16) {
            backward_block(g, p, mask, b, h, tp, L2, D, *bp, dK, dV, dQ, scratch);
            continue;
          }
        }
#endif
        backward_block(g, p, mask, b, h, tp, Q, dO, L2, D, kb_bufs.K.data.data(),
                       kb_bufs.Kt.data.data(), kb_bufs.Vt.data.data(), dK, dV, dQ, scratch);
      }
      void* dq = element(p.dq_ptr, p.dtype,
                         b * p.dq_batch_stride + i0 * p.dq_row_stride + h * p.dq_head_stride);
      prefetch_elements<true>(dq, p.dtype, p.dq_row_stride, rows, g.d);
      for (int64_t r = 0; r < rows; ++r)
        convert_row_out(dQ + r * g.dp, static_cast<T>(p.scale_softmax), g.d,
                        element(dq, p.dtype, r * p.dq_row_stride), p.dtype);
    }
    tiles.release_slots_if_over();
  });

  dbias.finish(p, threads);
  // dK, dV = the sums of the partials in thread order (dK scaled by store_key_grads).
  parallel_for(p.batch * p.nheads_kv * g.nkb, threads, [&](int64_t begin, int64_t end, int) {
    BackwardTiles<T>& tiles = backward_tiles<T>();
    T* dK = tiles.dk.get(g.Bcp * g.dp);
    T* dV = tiles.dv.get(g.Bcp * g.dp);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bhk = task / g.nkb, kt = task % g.nkb;
      std::fill(dK, dK + g.Bcp * g.dp, T(0));
      std::fill(dV, dV + g.Bcp * g.dp, T(0));
      for (int t = 0; t < nthreads; ++t) {
        if (bhk < first_bhk[t] || bhk > last_bhk[t]) continue;
        const T* src = dkv_part[t].data() + (bhk - first_bhk[t]) * 2 * kv_elems + kt * g.Bcp * g.dp;
        row_axpby(dK, src, g.Bcp * g.dp, T(1), T(1));
        row_axpby(dV, src + kv_elems, g.Bcp * g.dp, T(1), T(1));
      }
      store_key_grads(p, g, bhk / p.nheads_kv, bhk % p.nheads_kv, g.kt.start(kt), g.kt.size(kt), dK,
                      dV);
    }
  });
}

// Which loop is outer in the backward. Keys (by_keys, FlashAttention-2's order) reuse Q and dO
// converted once for all key tiles; queries (by_queries) reload each key tile for every query tile
// but drop by_keys' per-call copies of Q and dO, its dQ partials and their reduction, all of size
// seqlen_q, which dominate where there are few key tiles per query tile. Measured on two threads:
// by_queries 1.2-3.5x faster from 4 query tiles per
// key tile up (256 x 16 to 100,000 x 16, 1024 x 256), within noise at 2048 x 1024 and 4096 x 1024,
// 1.5x slower at 2048 x 2048. Its dK/dV partials (threads x every key tile) are capped in size.
inline int64_t backward_query_tiles_per_key_tile() { return 4; }

template <typename T>
bool backward_by_queries(const Params& p, const Geometry<T>& g, int threads) {
  // A broadcast bias's dBias is summed by key tiles (fa2_backward_by_keys): O(seqlen) memory.
  if (p.dbias_ptr != nullptr && !DBiasPartials<T>(p, 0).direct) return false;
  const int64_t key_tiles = p.batch * p.nheads_kv * g.nkb;
  const int64_t partial_bytes = threads * key_tiles * 2 * g.Bcp * g.dp * int64_t{sizeof(T)};
  return g.nqb >= backward_query_tiles_per_key_tile() * g.nkb &&
         partial_bytes <= (int64_t{64} << 20);
}

template <typename T>
void fa2_backward_impl(const Params& p, int threads) {
  const Geometry<T> g = make_geometry<T>(p, fa2_block_rows(), fa2_block_cols(), true);
  const Mask mask = mask_of(p);
  const bool zigzag = uneven_work(p);
  if (backward_by_queries(p, g, threads))
    return fa2_backward_by_queries(p, g, mask, zigzag, threads);
  fa2_backward_by_keys(p, g, mask, zigzag, threads);
}

inline void fa2_forward(const Params& p, int threads) {
  if (p.dtype == DType::float64) return fa2_forward_impl<double, Products<double>>(p, threads);
#if FLASHDL_HAVE_BF16_DOT
  if (p.dtype == DType::bfloat16) return fa2_forward_impl<float, Bf16Products>(p, threads);
#endif
  fa2_forward_impl<float, Products<float>>(p, threads);
}

inline void fa2_backward(const Params& p, int threads) {
  if (p.dtype == DType::float64) return fa2_backward_impl<double>(p, threads);
  fa2_backward_impl<float>(p, threads);
}
