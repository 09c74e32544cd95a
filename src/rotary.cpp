// Rotary embedding for the KV-cache call (src/kvcache.cpp): the checks of rotary_cos and
// rotary_sin, and the rotation of q or the new keys into a buffer (host arrays; the CUDA backend
// rotates on the device with the same detail::rotate).
#include "rotary.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/convert.hpp"
#include "flashdl/detail/rotary.hpp"
#include "validate.hpp"

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
  check_dtype("rotary_cos", x.rotary_cos, q.dtype, "the dtype of q");
  check_dtype("rotary_sin", x.rotary_sin, q.dtype, "the dtype of q");
  check_device("rotary_cos", x.rotary_cos, q.device);
  check_device("rotary_sin", x.rotary_sin, q.device);
  check_last_dim_contiguous("rotary_cos", x.rotary_cos);
  check_last_dim_contiguous("rotary_sin", x.rotary_sin);
  r.on = true;
  r.interleaved = x.rotary_interleaved;
  r.dim = 2 * x.rotary_cos.shape[1];
  const int64_t d = q.shape[3];
  if (r.dim < 2 || r.dim > d)
    fail(ErrorKind::value, "rotary_cos: rotary_dim (2 x its last dimension) must be in [2, "
                           "headdim = " + std::to_string(d) + "], got shape " +
                               shape_str(x.rotary_cos));
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

namespace {

// n elements of dtype dt at src (contiguous) into T, and back: the switch hoisted out of the
// element loop (a switch per element made the rotation cost 2x a small decode step).
template <typename T>
void row_in(const void* src, DType dt, int64_t n, T* dst) {
  switch (dt) {
    case DType::float16:
      for (int64_t e = 0; e < n; ++e)
        dst[e] = static_cast<T>(cpu::fp16_to_float(static_cast<const uint16_t*>(src)[e]));
      break;
    case DType::bfloat16:
      for (int64_t e = 0; e < n; ++e)
        dst[e] = static_cast<T>(cpu::bf16_to_float(static_cast<const uint16_t*>(src)[e]));
      break;
    case DType::float32:
      for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<T>(static_cast<const float*>(src)[e]);
      break;
    default:
      for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<T>(static_cast<const double*>(src)[e]);
  }
}

template <typename T>
void row_out(const T* src, int64_t n, void* dst, DType dt) {
  switch (dt) {
    case DType::float16:
      for (int64_t e = 0; e < n; ++e)
        static_cast<uint16_t*>(dst)[e] = cpu::float_to_fp16(static_cast<float>(src[e]));
      break;
    case DType::bfloat16:
      for (int64_t e = 0; e < n; ++e)
        static_cast<uint16_t*>(dst)[e] = cpu::float_to_bf16(static_cast<float>(src[e]));
      break;
    case DType::float32:
      for (int64_t e = 0; e < n; ++e) static_cast<float*>(dst)[e] = static_cast<float>(src[e]);
      break;
    default:
      for (int64_t e = 0; e < n; ++e) static_cast<double*>(dst)[e] = static_cast<double>(src[e]);
  }
}

// x (batch, rows, heads, d) rotated into a contiguous buffer of its dtype: row i of sequence b at
// position first[b] + i (per_row) or first[b]. T: float32 arithmetic (float64 for float64), one rounding at the end.
template <typename T>
std::vector<unsigned char> rotated(const TensorView& x, const KvCacheExtras& e, const Rotary& r,
                                   const std::vector<int32_t>& first, bool per_row) {
  const int64_t B = x.shape[0], S = x.shape[1], H = x.shape[2], d = x.shape[3];
  const auto es = static_cast<int64_t>(dtype_size(x.dtype));
  std::vector<unsigned char> buf(static_cast<size_t>(B * S * H * d * es));
  auto* out = reinterpret_cast<char*>(buf.data());
  const auto* in = static_cast<const char*>(x.data);
  const int64_t half = r.dim / 2;
  std::vector<T> c(static_cast<size_t>(half)), sn(static_cast<size_t>(half)),
      row(static_cast<size_t>(r.dim));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < S; ++i) {
      const int64_t at = first[b] + (per_row ? i : 0);
      row_in(static_cast<const char*>(e.rotary_cos.data) + at * e.rotary_cos.strides[0] * es,
             x.dtype, half, c.data());
      row_in(static_cast<const char*>(e.rotary_sin.data) + at * e.rotary_sin.strides[0] * es,
             x.dtype, half, sn.data());
      for (int64_t h = 0; h < H; ++h) {
        const char* src = in + (b * x.strides[0] + i * x.strides[1] + h * x.strides[2]) * es;
        char* dst = out + ((b * S + i) * H + h) * d * es;
        row_in(src, x.dtype, r.dim, row.data());
        for (int64_t m = 0; m < half; ++m) {
          const detail::RotaryPair pr = detail::rotary_pair(m, r.dim, r.interleaved);
          T y1, y2;
          detail::rotate(row[pr.first], row[pr.second], c[m], sn[m], &y1, &y2);
          row[pr.first] = y1;
          row[pr.second] = y2;
        }
        row_out(row.data(), r.dim, dst, x.dtype);
        std::memcpy(dst + r.dim * es, src + r.dim * es, static_cast<size_t>((d - r.dim) * es));
      }
    }
  return buf;
}

}  // namespace

std::vector<unsigned char> rotate_rows(const TensorView& x, const KvCacheExtras& e,
                                       const Rotary& r, const std::vector<int32_t>& first,
                                       bool per_row) {
  return x.dtype == DType::float64 ? rotated<double>(x, e, r, first, per_row)
                                   : rotated<float>(x, e, r, first, per_row);
}

// A contiguous (batch, rows, heads, d) view of buf, otherwise like x.
TensorView contiguous_view(const TensorView& x, std::vector<unsigned char>& buf) {
  TensorView r = x;
  r.data = buf.data();
  const int64_t H = x.shape[2], d = x.shape[3];
  r.strides = {x.shape[1] * H * d, H * d, d, 1};
  return r;
}

}  // namespace flashdl
