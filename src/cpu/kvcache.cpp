// The CPU backend's attention over a KV cache, as the CUDA backend's cuda::forward_kvcache: the
// rotary embedding of q and the new keys (into buffers), the append of the new keys and values to
// the cache, then the attention (kvcache.inl's kernel, through forward()). src/kvcache.cpp has
// checked everything before this writes the cache.
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend.hpp"
#include "cpu/convert.hpp"
#include "flashdl/detail/kv_cache.hpp"
#include "flashdl/detail/rotary.hpp"

namespace flashdl::cpu {

namespace {

// (batch, rows, heads, d) elements of dtype at data, with element strides.
struct Rows {
  const void* data = nullptr;
  DType dtype = DType::float32;
  int64_t batch = 0, rows = 0, heads = 0, d = 0;
  int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
};

// n elements of dtype dt at src (contiguous) into T, and back: the switch hoisted out of the
// element loop (a switch per element made the rotation cost 2x a small decode step).
template <typename T>
void row_in(const void* src, DType dt, int64_t n, T* dst) {
  switch (dt) {
    case DType::float16:
      for (int64_t e = 0; e < n; ++e)
        dst[e] = static_cast<T>(fp16_to_float(static_cast<const uint16_t*>(src)[e]));
      break;
    case DType::bfloat16:
      for (int64_t e = 0; e < n; ++e)
        dst[e] = static_cast<T>(bf16_to_float(static_cast<const uint16_t*>(src)[e]));
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
        static_cast<uint16_t*>(dst)[e] = float_to_fp16(static_cast<float>(src[e]));
      break;
    case DType::bfloat16:
      for (int64_t e = 0; e < n; ++e)
        static_cast<uint16_t*>(dst)[e] = float_to_bf16(static_cast<float>(src[e]));
      break;
    case DType::float32:
      for (int64_t e = 0; e < n; ++e) static_cast<float*>(dst)[e] = static_cast<float>(src[e]);
      break;
    default:
      for (int64_t e = 0; e < n; ++e) static_cast<double*>(dst)[e] = static_cast<double>(src[e]);
  }
}

// x rotated into a contiguous buffer of its dtype: row i of sequence b at position
// cache_seqlens[b] + i (per_row) or cache_seqlens[b]. T: float32 arithmetic (float64 for float64),
// one rounding at the end.
template <typename T>
std::vector<unsigned char> rotated(const Rows& x, const KvAppend& a, bool per_row) {
  const int64_t B = x.batch, S = x.rows, H = x.heads, d = x.d, dim = a.rotary_dim;
  const auto es = static_cast<int64_t>(dtype_size(x.dtype));
  std::vector<unsigned char> buf(static_cast<size_t>(B * S * H * d * es));
  auto* out = reinterpret_cast<char*>(buf.data());
  const auto* in = static_cast<const char*>(x.data);
  const int64_t half = dim / 2;
  std::vector<T> c(static_cast<size_t>(half)), sn(static_cast<size_t>(half)),
      row(static_cast<size_t>(dim));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < S; ++i) {
      const int64_t at = a.cache_seqlens[b] + (per_row ? i : 0);
      row_in(static_cast<const char*>(a.rotary_cos) + at * a.rotary_cos_stride * es, x.dtype, half,
             c.data());
      row_in(static_cast<const char*>(a.rotary_sin) + at * a.rotary_sin_stride * es, x.dtype, half,
             sn.data());
      for (int64_t h = 0; h < H; ++h) {
        const char* src = in + (b * x.batch_stride + i * x.row_stride + h * x.head_stride) * es;
        char* dst = out + ((b * S + i) * H + h) * d * es;
        row_in(src, x.dtype, dim, row.data());
        for (int64_t m = 0; m < half; ++m) {
          const detail::RotaryPair pr = detail::rotary_pair(m, dim, a.rotary_interleaved);
          T y1, y2;
          detail::rotate(row[pr.first], row[pr.second], c[m], sn[m], &y1, &y2);
          row[pr.first] = y1;
          row[pr.second] = y2;
        }
        row_out(row.data(), dim, dst, x.dtype);
        std::memcpy(dst + dim * es, src + dim * es, static_cast<size_t>((d - dim) * es));
      }
    }
  return buf;
}

// x rotated into buf (resized), and the contiguous Rows of buf.
Rows rotate_into(const Rows& x, const KvAppend& a, bool per_row, std::vector<unsigned char>& buf) {
  buf = x.dtype == DType::float64 ? rotated<double>(x, a, per_row) : rotated<float>(x, a, per_row);
  Rows r = x;
  r.data = buf.data();
  r.head_stride = x.d;
  r.row_stride = x.heads * x.d;
  r.batch_stride = x.rows * x.heads * x.d;
  return r;
}

// Rows [seqused_k - seqlen_new, seqused_k) of every sequence of the cache (counted from
// cache_leftpad) = the new keys (or values) src.
void append_rows(const Params& p, const Rows& src, bool values) {
  const auto es = static_cast<int64_t>(dtype_size(src.dtype));
  char* base = static_cast<char*>(const_cast<void*>(values ? p.v_ptr : p.k_ptr));
  const auto* from = static_cast<const char*>(src.data);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t j = 0; j < src.rows; ++j)
      for (int64_t hk = 0; hk < p.nheads_kv; ++hk) {
        const int64_t pos = p.seqused_k[b] - src.rows + j;
        const int64_t dst = values ? detail::v_cache_offset(p, b, pos, hk)
                                   : detail::k_cache_offset(p, b, pos, hk);
        const int64_t off = b * src.batch_stride + j * src.row_stride + hk * src.head_stride;
        std::memcpy(base + dst * es, from + off * es, static_cast<size_t>(p.headdim * es));
      }
}

}  // namespace

void forward_kvcache(const Params& params, const KvAppend& a) {
  Params p = params;
  const bool append = a.seqlen_new > 0 && a.k_ptr != nullptr && a.v_ptr != nullptr;
  Rows k_new{a.k_ptr,   p.dtype,          p.batch,        a.seqlen_new,   p.nheads_kv,
             p.headdim, a.k_batch_stride, a.k_row_stride, a.k_head_stride};
  const Rows v_new{a.v_ptr,   p.dtype,          p.batch,        a.seqlen_new,   p.nheads_kv,
                   p.headdim, a.v_batch_stride, a.v_row_stride, a.v_head_stride};
  // Rotary embedding: q and the new keys rotated into buffers (q at cache_seqlens + row when
  // causal or windowed, else at cache_seqlens; key row j at cache_seqlens + j), read from there.
  std::vector<unsigned char> q_rot, k_rot;
  if (a.rotary_dim > 0) {
    if (append) k_new = rotate_into(k_new, a, true, k_rot);
    if (p.batch > 0 && p.seqlen_q > 0 && p.nheads > 0) {
      const Rows q{p.q_ptr,   p.dtype,          p.batch,        p.seqlen_q,     p.nheads,
                   p.headdim, p.q_batch_stride, p.q_row_stride, p.q_head_stride};
      const Rows r = rotate_into(q, a, a.rotary_per_row_q, q_rot);
      p.q_ptr = r.data;
      p.q_batch_stride = r.batch_stride;
      p.q_row_stride = r.row_stride;
      p.q_head_stride = r.head_stride;
    }
  }
  if (append) {
    append_rows(p, k_new, false);
    append_rows(p, v_new, true);
  }
  if (p.batch == 0 || p.seqlen_q == 0 || p.nheads == 0) return;
  forward(p);
}

}  // namespace flashdl::cpu
