// Attention over a KV cache (contiguous or paged) on the CPU, built for decoding: a few query rows
// against many keys. A task is one (batch, kv head, key split, chunk of rows); its rows are the
// query rows of every head of the GQA group, so each K and V row is read from memory and
// converted once per kv head and used by all of the group's rows: S by dot products against the
// row, O += P V by one multiply-add per row -- no transposed packing, whose scalar scatter would
// cost more than the arithmetic here. Key splits (split-KV, "flash-decoding") give normalised
// partial (O, lse) that are merged exactly (detail::merge_weights) once every split is done.

// Rows of one task; kv_rows_per_task() keeps Q, S and O of a task within L1 and L2.
inline int64_t kv_rows_per_task() { return 64; }
// Keys per tile: S holds rows x kv_tile_keys() scores.
inline int64_t kv_tile_keys() { return 64; }
// A split below this many keys costs more in merging and per-task setup than it saves.
inline int64_t kv_min_split_keys() { return 512; }

// Splits per (batch, kv head): the caller's num_splits, else as many as keep every thread busy
// (two tasks per thread) while each split keeps kv_min_split_keys() keys; never more than the
// longest sequence's key tiles.
inline int64_t kv_num_splits(const Params& p, int threads, int64_t row_chunks, int64_t max_keys) {
  const int64_t tiles = std::max<int64_t>(1, detail::ceil_div(max_keys, kv_tile_keys()));
  if (p.num_splits > 0) return std::min(p.num_splits, tiles);
  const int64_t tasks = p.batch * p.nheads_kv * row_chunks;
  const int64_t want = detail::ceil_div(int64_t{2} * threads, std::max<int64_t>(tasks, 1));
  const int64_t most = std::max<int64_t>(1, max_keys / kv_min_split_keys());
  return std::max<int64_t>(1, std::min({want, most, tiles}));
}

template <typename T>
void kvcache_forward_impl(const Params& p, int threads) {
  const int64_t group = p.h_h_k_ratio, sq = p.seqlen_q, d = p.headdim;
  const int64_t dp = detail::round_up(d, kNR<T>);
  const int64_t Bt = kv_tile_keys();
  const int64_t rows_all = group * sq;  // rows of one (batch, kv head)
  const int64_t Rc = std::min(rows_all, kv_rows_per_task());
  const int64_t row_chunks = detail::ceil_div(rows_all, Rc);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.batch; ++b) max_keys = std::max<int64_t>(max_keys, p.seqused_k[b]);
  const int64_t S = kv_num_splits(p, threads, row_chunks, max_keys);
  const T c = static_cast<T>(p.scale_softmax_log2);
  constexpr int W = Simd<T>::W;

  // Partial results of split s of row r of (b, hk): normalised O (dp floats) and lse.
  const bool split = S > 1;
  std::vector<T> o_part, lse_part;
  auto part = [&](int64_t b, int64_t hk, int64_t s, int64_t r) {
    return ((b * p.nheads_kv + hk) * S + s) * rows_all + r;
  };
  if (split) {
    o_part.assign(static_cast<size_t>(p.batch * p.nheads_kv * S * rows_all * dp), T(0));
    lse_part.assign(static_cast<size_t>(p.batch * p.nheads_kv * S * rows_all), T(-INFINITY));
  }

  const int64_t ntasks = p.batch * p.nheads_kv * S * row_chunks;
  parallel_for(ntasks, threads, [&](int64_t begin, int64_t end, int) {
    Buffer<T> qbuf, sbuf, obuf, kbuf, vbuf;
    T* Q = qbuf.get(Rc * dp);
    T* Sc = sbuf.get(Rc * Bt);
    T* O = obuf.get(Rc * dp);
    T* krow = kbuf.get(dp);
    T* vrow = vbuf.get(dp);
    std::vector<detail::OnlineSoftmax<T>> sm(static_cast<size_t>(Rc));
    std::vector<detail::ScoreMod<T>> mod(static_cast<size_t>(Rc));
    std::vector<int64_t> lo(static_cast<size_t>(Rc)), hi(static_cast<size_t>(Rc)),
        diag(static_cast<size_t>(Rc));
    const bool modified = detail::has_score_mod(p);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t rc = task % row_chunks, rest = task / row_chunks;
      const int64_t s = rest % S, bhk = rest / S;
      const int64_t b = bhk / p.nheads_kv, hk = bhk % p.nheads_kv;
      const int64_t r0 = rc * Rc, rows = std::min(Rc, rows_all - r0);
      const int64_t keys = p.seqused_k[b];
      const int64_t chunk = detail::round_up(detail::ceil_div(keys, S), Bt);
      const int64_t k0 = std::min(keys, s * chunk), k1 = std::min(keys, k0 + chunk);
      const Mask mask{sq, keys, p.window_left, p.window_right};

      // Row r is query i of head hk * group + hg: Q converted, its visible keys and modifiers.
      int64_t any_lo = k1, any_hi = k0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t hg = (r0 + r) / sq, i = (r0 + r) % sq, h = hk * group + hg;
        load_rows(element(p.q_ptr, p.dtype, q_offset(p, b, i, h)), p.dtype, p.q_row_stride, 1, d,
                  Q + r * dp, dp, 1);
        lo[r] = std::max(mask.col_begin(i), k0);
        hi[r] = std::min(mask.col_end(i), k1);
        diag[r] = mask.diag(i);
        if (modified) mod[r] = detail::score_mod_of<T>(p, b, h);
        any_lo = std::min(any_lo, lo[r]);
        any_hi = std::max(any_hi, hi[r]);
      }
      std::fill(O, O + rows * dp, T(0));
      std::fill(sm.begin(), sm.end(), detail::OnlineSoftmax<T>{});

      // Only the keys some row sees (a window's) are read.
      for (int64_t t0 = any_lo; t0 < any_hi; t0 += Bt) {
        const int64_t cols = std::min(Bt, any_hi - t0), n = detail::round_up(cols, int64_t{W});
        for (int64_t j = 0; j < cols; ++j) {  // S = Q K^T, a key row at a time
          convert_row_in(element(p.k_ptr, p.dtype, detail::k_cache_offset(p, b, t0 + j, hk)),
                         p.dtype, d, krow);
          std::fill(krow + d, krow + dp, T(0));
          for (int64_t r = 0; r < rows; ++r) Sc[r * Bt + j] = row_dot(Q + r * dp, krow, dp);
        }
        for (int64_t r = 0; r < rows; ++r) {  // modifiers, mask, online softmax
          T* srow = Sc + r * Bt;
          std::fill(srow + cols, srow + n, T(0));
          const int64_t l = lo[r] - t0, h = std::min(hi[r] - t0, cols);
          const T rmax = modified ? row_modified_range_max(srow, n, mod[r], diag[r] - t0, l, h,
                                                           static_cast<T*>(nullptr))
                                  : row_scale_range_max(srow, n, c, l, h);
          const T alpha = sm[r].rescale_factor(rmax);
          sm[r].accumulate(alpha, row_exp2_sum(srow, n, sm[r].reference()));
          if (alpha != T(1)) row_scale(O + r * dp, dp, alpha);
        }
        for (int64_t j = 0; j < cols; ++j) {  // O += P V, a value row at a time
          convert_row_in(element(p.v_ptr, p.dtype, detail::v_cache_offset(p, b, t0 + j, hk)),
                         p.dtype, d, vrow);
          std::fill(vrow + d, vrow + dp, T(0));
          for (int64_t r = 0; r < rows; ++r) {
            const T pj = Sc[r * Bt + j];
            if (pj != T(0)) row_axpby(O + r * dp, vrow, dp, T(1), pj);
          }
        }
      }

      for (int64_t r = 0; r < rows; ++r) {
        const int64_t hg = (r0 + r) / sq, i = (r0 + r) % sq, h = hk * group + hg;
        if (!split) {
          convert_row_out(O + r * dp, sm[r].inv_l(), d,
                          element(p.o_ptr, p.dtype, o_offset(p, b, i, h)), p.dtype);
          lse_at(p, b, h, i) = static_cast<float>(sm[r].lse());
        } else {
          const int64_t at = part(b, hk, s, r0 + r);
          row_scale(O + r * dp, dp, sm[r].inv_l());
          std::copy(O + r * dp, O + (r + 1) * dp, o_part.begin() + at * dp);
          lse_part[static_cast<size_t>(at)] = sm[r].lse();
        }
      }
    }
  });
  if (!split) return;

  // Merge the splits of every row, in split order.
  parallel_for(p.batch * p.nheads_kv * rows_all, threads, [&](int64_t begin, int64_t end, int) {
    Buffer<T> acc_buf;
    T* acc = acc_buf.get(dp);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task % rows_all, bhk = task / rows_all;
      const int64_t b = bhk / p.nheads_kv, hk = bhk % p.nheads_kv;
      const int64_t hg = r / sq, i = r % sq, h = hk * group + hg;
      T lse = T(-INFINITY);
      std::fill(acc, acc + dp, T(0));
      for (int64_t s = 0; s < S; ++s) {
        const int64_t at = part(b, hk, s, r);
        const detail::MergeWeights<T> w = detail::merge_weights(lse, lse_part[at]);
        row_axpby(acc, o_part.data() + at * dp, dp, w.wa, w.wb);
        lse = w.lse;
      }
      convert_row_out(acc, T(1), d, element(p.o_ptr, p.dtype, o_offset(p, b, i, h)), p.dtype);
      lse_at(p, b, h, i) = static_cast<float>(lse);
    }
  });
}

inline void kvcache_forward(const Params& p, int threads) {
  if (p.dtype == DType::float64) return kvcache_forward_impl<double>(p, threads);
  kvcache_forward_impl<float>(p, threads);
}
