// Rotary embedding for the KV-cache call (src/kvcache.cpp): the checks of rotary_cos and
// rotary_sin. The backends rotate (src/cpu/kvcache.cpp on the host, src/cuda/kvcache.cu on the
// device, both with detail::rotate).
#include "rotary.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "checks.hpp"

namespace flashdl {

using namespace validate;

Rotary check_rotary(const KvCacheExtras& x, const TensorView& q,
                    const std::vector<int32_t>& seqlens, int64_t seqlen_new, int64_t capacity,
                    const Options& o) {
  Rotary r;
  if (!x.rotary_cos.defined() && !x.rotary_sin.defined()) return r;
  if (x.rotary_cos.defined() != x.rotary_sin.defined())
    fail(ErrorKind::value, std::string(x.rotary_cos.defined() ? "rotary_sin" : "rotary_cos") +
                               ": expected both rotary_cos and rotary_sin or neither");
  const char* lay = "(seqlen_ro, rotary_dim / 2)";
  check_rank("rotary_cos", x.rotary_cos, 2, lay);
  check_rank("rotary_sin", x.rotary_sin, 2, lay);
  check_shape("rotary_sin", x.rotary_sin, {x.rotary_cos.shape[0], x.rotary_cos.shape[1]},
              "(the shape of rotary_cos)");
  check_storage("rotary_cos", x.rotary_cos, q.dtype, "the dtype of q", q.device);
  check_storage("rotary_sin", x.rotary_sin, q.dtype, "the dtype of q", q.device);
  r.on = true;
  r.interleaved = x.rotary_interleaved;
  r.dim = 2 * x.rotary_cos.shape[1];
  const int64_t d = q.shape[3];
  if (r.dim < 2 || r.dim > d)
    fail(ErrorKind::value,
         "rotary_cos: rotary_dim (2 x its last dimension) must be in [2, "
         "headdim = " +
             std::to_string(d) + "], got shape " + shape_str(x.rotary_cos));
  // flash-attn's convention: with causal or a window, query row i sits at cache_seqlens + i;
  // without, every row at cache_seqlens. A window side that reaches past the cache's capacity
  // is unbounded (flash-attn resolves such a window to none before it picks).
  const bool causal = o.causal;
  const bool left = o.window_left >= 0 && o.window_left < capacity;
  const bool right = o.window_right >= 0 && o.window_right < capacity;
  r.per_row_q = causal || left || right;
  const int64_t seqlen_ro = x.rotary_cos.shape[0], sq = q.shape[1];
  for (size_t b = 0; b < seqlens.size(); ++b) {
    int64_t last = -1;  // the largest position read
    if (seqlen_new > 0) last = seqlens[b] + seqlen_new - 1;
    if (sq > 0) last = std::max<int64_t>(last, seqlens[b] + (r.per_row_q ? sq - 1 : 0));
    if (last >= seqlen_ro)
      fail(ErrorKind::value, "rotary_cos: sequence " + std::to_string(b) + " needs position " +
                                 std::to_string(last) + " (cache_seqlens[" + std::to_string(b) +
                                 "] = " + std::to_string(seqlens[b]) +
                                 " plus its new rows), but rotary_cos has " +
                                 std::to_string(seqlen_ro) + " rows; nothing was written");
  }
  return r;
}

}  // namespace flashdl
