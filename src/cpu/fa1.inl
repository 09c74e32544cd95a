// The FlashAttention (FA-1) schedule on the CPU, as Algorithms 1 and 4 of the paper write it:
// block sizes from the on-chip budget M (Bc = ceil(M / 4d), Br = min(Bc, d)), outer loop over K/V
// blocks, inner loop over Q blocks, and O, l, m (forward) or dQ (backward) living in "HBM" -- a
// per-head buffer the size of the output -- between K/V blocks. Parallel over (batch, head).

template <typename T>
Geometry<T> fa1_geometry(const Params& p, int64_t sram_bytes) {
  const detail::Fa1Tiles t = detail::fa1_tiles(sram_bytes / static_cast<int64_t>(sizeof(T)),
                                               p.headdim);
  // make_geometry caps both at the sequence lengths (and at a block mask's blocks), never above
  // the budget's.
  return make_geometry<T>(p, t.Br, t.Bc, false);
}

template <typename T>
void fa1_forward_impl(const Params& p, int threads, int64_t sram_bytes) {
  const Geometry<T> g = fa1_geometry<T>(p, sram_bytes);
  const Mask mask = mask_of(p);
  const int64_t rows_alloc = padded_rows(g);
  parallel_tasks(p.batch * p.nheads, threads, [&](Tasks& tasks, int) {
    Buffer<T> o_hbm, m_hbm, l_hbm, kt_buf, v_buf, q_buf, s_buf, pv_buf, rmax_buf, lt_buf, scratch,
        xrow;
    T* O = o_hbm.get(rows_alloc * g.dp);
    T* m = m_hbm.get(rows_alloc);
    T* l = l_hbm.get(rows_alloc);
    T* Kt = kt_buf.get(g.d * g.Bcp);
    T* V = v_buf.get(g.Bcp * g.dp);
    T* Q = q_buf.get(g.Brp * g.dp);
    T* S = s_buf.get(g.Brp * g.Bcp);
    T* PV = pv_buf.get(g.Brp * g.dp);
    T* m_tilde = rmax_buf.get(g.Brp);
    T* l_tilde = lt_buf.get(g.Brp);
    for (int64_t bh = 0; tasks.next(bh);) {
      const int64_t b = bh / p.nheads, h = bh % p.nheads, hk = h / p.h_h_k_ratio;
      const BlockMask bm = detail::block_mask_of(p, b, h);
      const HeadMods<T> mods(p, b, h);
      // Line 2: O = 0, l = 0, m = -inf.
      std::fill(O, O + rows_alloc * g.dp, T(0));
      std::fill(l, l + rows_alloc, T(0));
      std::fill(m, m + rows_alloc, T(-INFINITY));
      for (int64_t kt = 0; kt < g.nkb; ++kt) {  // line 5
        const int64_t j0 = g.kt.start(kt), cols = g.kt.size(kt);
        const int64_t i_begin = mask.row_begin(j0), i_end = mask.row_end(j0 + cols - 1);
        bool kv_loaded = false;
        for (int64_t qt = g.qt.tile_of(i_begin);
             i_begin < i_end && qt < g.nqb && g.qt.start(qt) < i_end; ++qt) {  // line 7
          if (!pair_in_mask(g, bm, qt, kt)) continue;  // a zero block: never loaded or computed
          if (mask_tile_empty(mods.extras(), g.qt.start(qt), g.qt.size(qt), j0, cols)) continue;
          if (!kv_loaded) {
            // Line 6: K_j, V_j to on-chip memory (only for blocks some query tile needs).
            load_rows_transposed(element(p.k_ptr, p.dtype, k_offset(p, b, j0, hk)), p.dtype,
                                 p.k_row_stride, cols, g.d, Kt, g.Bcp,
                                 scratch.get(kTransposeRows * g.dp));
            load_rows(element(p.v_ptr, p.dtype, v_offset(p, b, j0, hk)), p.dtype, p.v_row_stride,
                      cols, g.d, V, g.dp, g.Bcp);
            kv_loaded = true;
          }
          const TilePair t = tile_pair(g, qt, kt);
          const int64_t i0 = t.i0, rows = t.rows;
          // Line 8: Q_i (O_i, l_i, m_i are read in place below).
          load_rows(element(p.q_ptr, p.dtype, q_offset(p, b, i0, h)), p.dtype, p.q_row_stride, rows,
                    g.d, Q, g.dp, g.Brp);
          // Lines 9-10: S = tau Q K^T (masked), m~ = rowmax, P~ = exp(S - m~), l~ = rowsum.
          const bool hidden = masked_scores(g, mask, Q, Kt, g.Bcp, S, t, m_tilde, mods.get(),
                                            static_cast<T*>(nullptr), mods.extras());
          for (int64_t r = 0; r < t.mp; ++r) {
            T* s = S + r * g.Bcp;
            if (r < rows)
              l_tilde[r] = row_exp2_sum(s, t.np, detail::softmax_reference_point(m_tilde[r]));
            else
              std::fill(s, s + t.np, T(0));
          }
          if (p.p_dropout > 0.0f) apply_dropout(g, p, b, h, t, S);
          gemm<T, false, false>(t.mp, g.dp, t.np, S, g.Bcp, V, g.dp, PV, g.dp);
          if (pair_masked(mask, t, hidden))
            redo_nonfinite_rows(g, mask, t, S, static_cast<const T*>(nullptr), PV,
                                element(p.v_ptr, p.dtype, v_offset(p, b, j0, hk)), p.dtype,
                                p.v_row_stride, xrow, hidden ? mods.extras() : nullptr);
          // Lines 11-13: m_new, l_new, O_i = diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i
          //                                                  + e^(m~ - m_new) P~ V_j).
          for (int64_t r = 0; r < rows; ++r) {
            T& mi = m[i0 + r];
            T& li = l[i0 + r];
            const T m_new = std::max(mi, m_tilde[r]);
            const T ref = detail::softmax_reference_point(m_new);
            const T a = std::exp2(mi - ref), e = std::exp2(m_tilde[r] - ref);
            const T l_new = a * li + e * l_tilde[r];
            const T inv = l_new > T(0) ? T(1) / l_new : T(0);
            row_axpby(O + (i0 + r) * g.dp, PV + r * g.dp, g.dp, li * a * inv, e * inv);
            mi = m_new;
            li = l_new;
          }
        }
      }
      for (int64_t i = 0; i < p.seqlen_q; ++i) {
        detail::OnlineSoftmax<T> state;
        state.m = m[i];
        state.l = l[i];
        T o_scale = T(1), lse = state.lse();
        if (p.sinks_ptr != nullptr) {  // O here is normalised by l: the sink's factor times l
          const auto f = detail::finalize_with_sink(m[i], l[i], detail::sink_of<T>(p, h));
          o_scale = f.o_scale * l[i];
          lse = f.lse;
        }
        convert_row_out(O + i * g.dp, o_scale, g.d, element(p.o_ptr, p.dtype, o_offset(p, b, i, h)),
                        p.dtype);
        lse_at(p, b, h, i) = static_cast<float>(lse);
      }
    }
  });
}

template <typename T>
void fa1_backward_impl(const Params& p, int threads, int64_t sram_bytes) {
  const Geometry<T> g = fa1_geometry<T>(p, sram_bytes);
  const Mask mask = mask_of(p);
  const int64_t group = p.h_h_k_ratio;
  const int64_t rows_alloc = padded_rows(g);
  DBiasPartials<T> dbias(p, threads);
  parallel_for(p.batch * p.nheads_kv, threads, [&](int64_t begin, int64_t end, int thread) {
    KeyBlock<T> kv;
    BackwardScratch<T> scratch;
    dbias.attach(thread, p, scratch);
    Buffer<T> dq_hbm, dk_buf, dv_buf, q_buf, do_buf, o_buf, l2_buf, d_buf;
    T* dQ = dq_hbm.get(group * rows_alloc * g.dp);
    T* dK = dk_buf.get(g.Bcp * g.dp);
    T* dV = dv_buf.get(g.Bcp * g.dp);
    T* Q = q_buf.get(g.Brp * g.dp);
    T* dO = do_buf.get(g.Brp * g.dp);
    T* O = o_buf.get(g.Brp * g.dp);
    T* L2 = l2_buf.get(g.Brp);
    T* D = d_buf.get(g.Brp);
#if FLASHDL_HAVE_BF16_DOT
    // bfloat16 inputs: the products on bfloat16 pairs (bf16dot.inl).
    const bool bf16 = std::is_same_v<T, float> && p.dtype == DType::bfloat16;
    Bf16BackwardProducts bprod;
#endif
    for (int64_t bhk = begin; bhk < end; ++bhk) {
      const int64_t b = bhk / p.nheads_kv, hk = bhk % p.nheads_kv;
      std::fill(dQ, dQ + group * rows_alloc * g.dp, T(0));  // line 5 (dQ in HBM)
      for (int64_t kt = 0; kt < g.nkb; ++kt) {              // line 6
        const int64_t j0 = g.kt.start(kt), cols = g.kt.size(kt);
        std::fill(dK, dK + g.Bcp * g.dp, T(0));  // line 8
        std::fill(dV, dV + g.Bcp * g.dp, T(0));
        const int64_t i_begin = mask.row_begin(j0), i_end = mask.row_end(j0 + cols - 1);
        bool kv_loaded = false;
        for (int64_t hg = 0; hg < group && i_begin < i_end; ++hg) {
          const int64_t h = hk * group + hg;
          const BlockMask bm = detail::block_mask_of(p, b, h);
          const detail::HeadExtras ex = detail::extras_of(p, b, h);
          for (int64_t qt = g.qt.tile_of(i_begin); qt < g.nqb && g.qt.start(qt) < i_end;
               ++qt) {                                   // line 9
            if (!pair_in_mask(g, bm, qt, kt)) continue;  // a zero block: never loaded or computed
            if (mask_tile_empty(&ex, g.qt.start(qt), g.qt.size(qt), j0, cols)) continue;
            if (!kv_loaded) {
              // Line 7 (bfloat16: packed as the pair products take them).
#if FLASHDL_HAVE_BF16_DOT
              if constexpr (std::is_same_v<T, float>)
                if (bf16) bprod.keys(p, g, b, hk, j0, cols);
              if (!bf16)
#endif
                kv.load(p, g, b, hk, j0, cols);
              kv_loaded = true;
            }
            const TilePair t = tile_pair(g, qt, kt);
            const int64_t i0 = t.i0, rows = t.rows;
            // Line 10: Q_i, O_i, dO_i, dQ_i, l_i, m_i (here: lse_i) from HBM.
            load_rows(element(p.q_ptr, p.dtype, q_offset(p, b, i0, h)), p.dtype, p.q_row_stride,
                      rows, g.d, Q, g.dp, g.Brp);
            load_rows(element(p.o_ptr, p.dtype, o_offset(p, b, i0, h)), p.dtype, p.o_row_stride,
                      rows, g.d, O, g.dp, g.Brp);
            load_rows(element(p.do_ptr, p.dtype, do_offset(p, b, i0, h)), p.dtype, p.do_row_stride,
                      rows, g.d, dO, g.dp, g.Brp);
            for (int64_t r = 0; r < t.mp; ++r) {
              // Line 19: D_i = rowsum(dO_i o O_i).
              D[r] = r < rows ? row_dot(dO + r * g.dp, O + r * g.dp, g.dp) : T(0);
              L2[r] = r < rows
                          ? static_cast<T>(lse_at(p, b, h, i0 + r)) * static_cast<T>(detail::kLog2e)
                          : T(0);
            }
            // Lines 11-21.
            T* dQ_i = dQ + (hg * rows_alloc + tile_row(g, qt)) * g.dp;
#if FLASHDL_HAVE_BF16_DOT
            if constexpr (std::is_same_v<T, float>) {
              if (bf16) {
                bprod.queries(g, t, Q, dO);
                backward_block(g, p, mask, b, h, t, L2, D, bprod, dK, dV, dQ_i, scratch);
                continue;
              }
            }
#endif
            backward_block(g, p, mask, b, h, t, Q, dO, L2, D, kv.K.data.data(), kv.Kt.data.data(),
                           kv.Vt.data.data(), dK, dV, dQ_i, scratch);
          }
        }
        store_key_grads(p, g, b, hk, j0, cols, dK, dV);  // line 24
      }
      for (int64_t hg = 0; hg < group; ++hg) {
        const int64_t h = hk * group + hg;
        for (int64_t qt = 0; qt < g.nqb; ++qt)
          store_rows(dQ + (hg * rows_alloc + tile_row(g, qt)) * g.dp, g.dp, g.qt.size(qt), g.d,
                     static_cast<T>(p.scale_softmax),
                     element(p.dq_ptr, p.dtype,
                             b * p.dq_batch_stride + g.qt.start(qt) * p.dq_row_stride +
                                 h * p.dq_head_stride),
                     p.dtype, p.dq_row_stride);
      }
    }
  });
  dbias.finish(p, threads);
}

inline void fa1_forward(const Params& p, int threads, int64_t sram_bytes) {
  if (p.dtype == DType::float64) return fa1_forward_impl<double>(p, threads, sram_bytes);
  fa1_forward_impl<float>(p, threads, sram_bytes);
}

inline void fa1_backward(const Params& p, int threads, int64_t sram_bytes) {
  if (p.dtype == DType::float64) return fa1_backward_impl<double>(p, threads, sram_bytes);
  fa1_backward_impl<float>(p, threads, sram_bytes);
}
