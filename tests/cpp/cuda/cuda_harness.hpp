// Helpers for the CUDA tests: 16-bit float conversions on the host, strided layouts, buffers
// poisoned with NaN (device memory, or host memory for --cpu runs), placing arrays in a layout and
// reading them back with a check of the gaps, and the naive forward "in the input precision" of
// the tolerance rule, with or without the score modifiers (softcap, ALiBi).
// Self-contained on purpose: it shares no code with the kernels it checks.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashdl/tensor.hpp"

namespace cuda_test {

#define CUDA_TEST_CHECK(expr)                                                   \
  do {                                                                          \
    const cudaError_t err_ = (expr);                                            \
    if (err_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(err_));                                   \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

// ---- 16-bit floats (round to nearest even) -------------------------------------------------------
inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const int32_t exp = static_cast<int32_t>((u >> 23) & 0xffu);
  uint32_t mant = u & 0x7fffffu;
  if (exp == 0xff) return sign | 0x7c00u | (mant ? 0x200u : 0u);
  const int32_t e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00u;
  if (e <= 0) {  // subnormal or zero
    if (e < -10) return sign;
    mant |= 0x800000u;
    const int shift = 14 - e;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (uint32_t(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry rounds into the exponent
  return static_cast<uint16_t>(sign | h);
}
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) return (sign ? -1.0f : 1.0f) * std::ldexp(float(mant), -24);
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t to_bits(float f, flashdl::DType dt) {
  return dt == flashdl::DType::float16 ? float_to_fp16(f) : float_to_bf16(f);
}
inline float from_bits(uint16_t h, flashdl::DType dt) {
  return dt == flashdl::DType::float16 ? fp16_to_float(h) : bf16_to_float(h);
}
inline float round_to(float f, flashdl::DType dt) { return from_bits(to_bits(f, dt), dt); }

// ---- strided layouts -----------------------------------------------------------------------------
// How a logical 4-d (or 3-d) array sits in its buffer.
enum class Kind { contiguous, transposed, padded, odd };  // transposed: (b, h, s, d) storage
inline const char* kind_name(Kind k) {
  switch (k) {
    case Kind::contiguous: return "contiguous";
    case Kind::transposed: return "transposed";
    case Kind::padded: return "padded";
    case Kind::odd: return "odd-stride";
  }
  return "?";
}

struct Layout {
  int64_t shape[4];
  int64_t strides[4];
  int64_t span;  // elements the buffer needs
  int64_t offset(int64_t a, int64_t b, int64_t c, int64_t d) const {
    return a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3];
  }
};

// (batch, seq, heads, d): padded rows keep 16-byte alignment (+8), odd ones break it (+3).
inline Layout make_layout(int64_t b, int64_t s, int64_t h, int64_t d, Kind kind) {
  Layout L{{b, s, h, d}, {}, 0};
  const int64_t dd = d + (kind == Kind::padded ? 8 : kind == Kind::odd ? 3 : 0);
  if (kind == Kind::transposed) {
    L.strides[3] = 1;
    L.strides[1] = dd;
    L.strides[2] = s * dd;
    L.strides[0] = h * s * dd;
  } else {
    L.strides[3] = 1;
    L.strides[2] = dd;
    L.strides[1] = h * dd;
    L.strides[0] = s * h * dd;
  }
  L.span = b * L.strides[0];
  return L;
}

// lse (b, h, sq) float32; strided: stored as (b, h + 1, sq + 3), gaps after every row and batch.
inline Layout lse_layout(int64_t b, int64_t h, int64_t sq, bool strided) {
  if (!strided) return Layout{{b, h, sq, 1}, {h * sq, sq, 1, 1}, b * h * sq};
  return Layout{{b, h, sq, 1}, {(h + 1) * (sq + 3), sq + 3, 1, 1}, b * (h + 1) * (sq + 3)};
}

// ---- memory: device, or host when the test runs on the CPU backend (--cpu) ----------------------
class Buffer {
 public:
  Buffer(size_t n, bool host) : bytes(n), host_(host) {
    if (host_) {
      // aligned_alloc wants a multiple of the alignment; 256 matches cudaMalloc's, so the
      // alignment-dependent paths see the same layouts on both backends.
      ptr = std::aligned_alloc(256, (n / 256 + 1) * 256);
      if (ptr == nullptr) {
        std::fprintf(stderr, "host allocation of %zu bytes failed\n", n);
        std::exit(1);
      }
    } else {
      CUDA_TEST_CHECK(cudaMalloc(&ptr, n > 0 ? n : 1));
    }
  }
  ~Buffer() {
    if (host_)
      std::free(ptr);
    else
      cudaFree(ptr);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  flashdl::Device device() const {
    return flashdl::Device{host_ ? flashdl::DeviceType::cpu : flashdl::DeviceType::cuda, 0};
  }
  // The library works on a non-blocking stream that does not wait for the legacy default stream
  // these helpers use; they synchronise the device (the test may, the library never does).
  void poison() {  // 0xff bytes: NaN in every float format
    if (host_) {
      std::memset(ptr, 0xff, bytes);
      return;
    }
    CUDA_TEST_CHECK(cudaMemset(ptr, 0xff, bytes));
    CUDA_TEST_CHECK(cudaDeviceSynchronize());
  }
  template <typename U>
  void upload(const std::vector<U>& h) {
    if (h.empty()) return;  // seqlen 0: no copy (and no null source pointer)
    if (host_) {
      std::memcpy(ptr, h.data(), h.size() * sizeof(U));
      return;
    }
    CUDA_TEST_CHECK(cudaMemcpy(ptr, h.data(), h.size() * sizeof(U), cudaMemcpyHostToDevice));
    CUDA_TEST_CHECK(cudaDeviceSynchronize());
  }
  template <typename U>
  std::vector<U> download() const {
    std::vector<U> h(bytes / sizeof(U));
    if (h.empty()) return h;
    if (host_)
      std::memcpy(h.data(), ptr, h.size() * sizeof(U));
    else
      CUDA_TEST_CHECK(cudaMemcpy(h.data(), ptr, h.size() * sizeof(U), cudaMemcpyDeviceToHost));
    return h;
  }

  void* ptr = nullptr;
  size_t bytes = 0;

 private:
  bool host_;
};

inline flashdl::TensorView view_of(const Buffer& buf, flashdl::DType dt, const Layout& L,
                                   int rank) {
  flashdl::TensorView t;
  t.data = buf.ptr;
  t.dtype = dt;
  t.device = buf.device();
  t.rank = rank;
  for (int i = 0; i < rank; ++i) {
    t.shape[i] = L.shape[i];
    t.strides[i] = L.strides[i];
  }
  return t;
}

// A logical contiguous 4-d array placed in `L`'s layout as 16-bit values; the gaps hold NaN.
inline std::vector<uint16_t> place(const std::vector<float>& x, const Layout& L,
                                   flashdl::DType dt) {
  std::vector<uint16_t> buf(size_t(L.span), 0xffff);
  size_t i = 0;
  for (int64_t a = 0; a < L.shape[0]; ++a)
    for (int64_t b = 0; b < L.shape[1]; ++b)
      for (int64_t c = 0; c < L.shape[2]; ++c)
        for (int64_t d = 0; d < L.shape[3]; ++d)
          buf[size_t(L.offset(a, b, c, d))] = to_bits(x[i++], dt);
  return buf;
}

// The float32 lse (logical (b, h, sq)) placed in its layout; the gaps hold NaN.
inline std::vector<float> place_lse(const std::vector<float>& lse, const Layout& L) {
  std::vector<float> buf(size_t(L.span), bits_to_float(0xffffffffu));
  size_t i = 0;
  for (int64_t a = 0; a < L.shape[0]; ++a)
    for (int64_t b = 0; b < L.shape[1]; ++b)
      for (int64_t c = 0; c < L.shape[2]; ++c) buf[size_t(L.offset(a, b, c, 0))] = lse[i++];
  return buf;
}

// The logical contiguous values of a 16-bit buffer in layout `L`. Clears `gaps_untouched` when a
// position outside the view no longer holds the 0xffff poison.
inline std::vector<double> gather(const std::vector<uint16_t>& buf, const Layout& L,
                                  flashdl::DType dt, bool& gaps_untouched) {
  std::vector<double> x;
  x.reserve(size_t(L.shape[0] * L.shape[1] * L.shape[2] * L.shape[3]));
  std::vector<char> used(buf.size(), 0);
  for (int64_t a = 0; a < L.shape[0]; ++a)
    for (int64_t b = 0; b < L.shape[1]; ++b)
      for (int64_t c = 0; c < L.shape[2]; ++c)
        for (int64_t d = 0; d < L.shape[3]; ++d) {
          const auto off = size_t(L.offset(a, b, c, d));
          used[off] = 1;
          x.push_back(from_bits(buf[off], dt));
        }
  for (size_t i = 0; i < buf.size(); ++i) gaps_untouched &= used[i] || buf[i] == 0xffff;
  return x;
}

// Multiples of 1/64 in [-2, 2]: exact in float16 and bfloat16, so one oracle serves both.
template <typename Rng>
std::vector<float> random_values(int64_t n, Rng& rng) {
  std::uniform_int_distribution<int> dist(-128, 128);
  std::vector<float> x(size_t(n > 0 ? n : 0));
  for (float& e : x) e = float(dist(rng)) / 64.0f;
  return x;
}

// max |a - b|; NaN anywhere counts as infinitely far.
inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = std::fabs(a[i] - b[i]);
    if (!(e <= m)) m = std::isnan(e) ? INFINITY : e;
  }
  return m;
}

// max |x| (NaN counts as infinite).
inline double max_abs(const std::vector<double>& x) {
  double m = 0.0;
  for (double e : x)
    if (!(std::fabs(e) <= m)) m = std::isnan(e) ? INFINITY : std::fabs(e);
  return m;
}

inline bool any_nan(const std::vector<double>& x) {
  for (double e : x)
    if (std::isnan(e)) return true;
  return false;
}

// ---- the naive algorithm in the input precision --------------------------------------------------
// float scores from the 16-bit inputs, softmax in float, P rounded to the storage type before P V
// (as a framework's half-precision attention does), float accumulation, out rounded. Inputs are
// logical contiguous (b, s, h, d) float vectors holding 16-bit values exactly.
struct Shape {
  int64_t b, sq, sk, h, hk, d;
  int64_t left, right;  // resolved window, causal = (left, 0); -1 unbounded
  bool visible(int64_t i, int64_t j) const {
    const int64_t c = i + sk - sq;
    return (left < 0 || j >= c - left) && (right < 0 || j <= c + right);
  }
};

// ---- NaN and Inf at keys a row cannot see (what a row cannot see never reaches it) ----------------
// Plants non-finite values in k and v (logical (b, sk, hk, d)) at each key of `keys`, in every
// batch entry and kv head: V gets NaN (first key, column 0), +Inf and -Inf (second, columns 1 and
// d - 1), ...; K gets +Inf, NaN, -Inf in turn (column key % d). Keys that a row of the same tile
// sees and another does not are the ones that test the masked products.
inline void plant_nonfinite(const Shape& s, const std::vector<int64_t>& keys, std::vector<float>& k,
                            std::vector<float>& v) {
  const float kinds[3] = {INFINITY, NAN, -INFINITY};
  for (size_t n = 0; n < keys.size(); ++n)
    for (int64_t b = 0; b < s.b; ++b)
      for (int64_t h = 0; h < s.hk; ++h) {
        const size_t row = size_t(((b * s.sk + keys[n]) * s.hk + h) * s.d);
        if (n % 2 == 0) {
          v[row] = NAN;
        } else {
          v[row + 1] = INFINITY;
          v[row + size_t(s.d - 1)] = -INFINITY;
        }
        k[row + size_t(keys[n] % s.d)] = kinds[n % 3];
      }
}

// Per query row i (of every batch entry and head): whether it sees none of `keys`, so that its
// output, lse and gradients must be those of the clean inputs. visible(i, j): the row's mask.
template <typename Visible>
std::vector<char> rows_blind_to(int64_t sq, const std::vector<int64_t>& keys,
                                const Visible& visible) {
  std::vector<char> blind(size_t(sq), 1);
  for (int64_t i = 0; i < sq; ++i)
    for (const int64_t j : keys) blind[size_t(i)] &= !visible(i, j);
  return blind;
}

// lse (logical (planes, rows)) of the rows that `keep` marks within 1e-3 + 1e-4 |want| of the
// reference's, -inf exactly where it is -inf.
inline bool lse_matches_rows(const std::vector<float>& got, const std::vector<float>& want,
                             int64_t planes, int64_t rows, const std::vector<char>& keep) {
  bool ok = true;
  for (int64_t x = 0; x < planes; ++x)
    for (int64_t i = 0; i < rows; ++i) {
      if (!keep[size_t(i)]) continue;
      const float w = want[size_t(x * rows + i)], g = got[size_t(x * rows + i)];
      ok &= std::isinf(w) ? g == w : std::fabs(double(g) - w) <= 1e-3 + 1e-4 * std::fabs(w);
    }
  return ok;
}

// max |a - b| over the rows (logical (b, rows, h, d)) that `keep` marks.
inline double max_abs_diff_rows(const std::vector<double>& a, const std::vector<double>& b,
                                int64_t batch, int64_t rows, int64_t h, int64_t d,
                                const std::vector<char>& keep) {
  double m = 0.0;
  for (int64_t x = 0; x < batch; ++x)
    for (int64_t i = 0; i < rows; ++i) {
      if (!keep[size_t(i)]) continue;
      const size_t o = size_t((x * rows + i) * h * d);
      const std::vector<double> ra(a.begin() + o, a.begin() + o + h * d);
      const std::vector<double> rb(b.begin() + o, b.begin() + o + h * d);
      m = std::fmax(m, max_abs_diff(ra, rb));
    }
  return m;
}

// The rows (index along n of a logical (batch, n, heads, d) array) that `keep` marks, in order.
inline std::vector<double> select_rows(const std::vector<double>& x, int64_t batch, int64_t n,
                                       int64_t heads, int64_t d, const std::vector<char>& keep) {
  std::vector<double> r;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < n; ++i)
      if (keep[size_t(i)]) {
        const auto o = x.begin() + (b * n + i) * heads * d;
        r.insert(r.end(), o, o + heads * d);
      }
  return r;
}

// The score modifiers as the naive algorithms apply them, in float and the natural-log domain, in
// flash-attn's order: s = scale q.k; s = softcap tanh(s / softcap); s -= slope |i + sk - sq - j|.
// Written from the definition, independently of the library's detail/score_mod.hpp.
struct ScoreMods {
  float softcap = 0.0f;  // 0: off
  int64_t nheads = 0;
  std::vector<float> slopes;  // logical (b, nheads) (broadcast slopes repeated); empty: no ALiBi

  // s = scale q.k of query i at key j, dist = i + sk - sq - j.
  float score(float s, int64_t b, int64_t h, int64_t dist) const {
    if (softcap > 0.0f) s = softcap * std::tanh(s / softcap);
    if (!slopes.empty()) s -= slopes[size_t(b * nheads + h)] * float(dist < 0 ? -dist : dist);
    return s;
  }
  // d score / d (scale q.k): 1 - tanh^2 with a cap, else 1.
  float grad(float s) const {
    if (!(softcap > 0.0f)) return 1.0f;
    const float t = std::tanh(s / softcap);
    return 1.0f - t * t;
  }
};

// mods: the score modifiers, or null for plain attention; softmax_scale: NaN for 1 / sqrt(d).
inline void naive_lowp(const Shape& s, const std::vector<float>& q, const std::vector<float>& k,
                       const std::vector<float>& v, flashdl::DType dt, std::vector<double>& out,
                       const ScoreMods* mods = nullptr, float softmax_scale = NAN) {
  out.assign(size_t(s.b * s.sq * s.h * s.d), 0.0);
  const float scale = std::isnan(softmax_scale) ? 1.0f / std::sqrt(float(s.d)) : softmax_scale;
  std::vector<float> p(size_t(s.sk)), acc(size_t(s.d));
  for (int64_t bi = 0; bi < s.b; ++bi)
    for (int64_t hi = 0; hi < s.h; ++hi) {
      const int64_t hk = hi / (s.h / s.hk);
      for (int64_t i = 0; i < s.sq; ++i) {
        const float* qr = &q[size_t(((bi * s.sq + i) * s.h + hi) * s.d)];
        float m = -INFINITY;
        for (int64_t j = 0; j < s.sk; ++j) {
          p[j] = -INFINITY;
          if (!s.visible(i, j)) continue;
          const float* kr = &k[size_t(((bi * s.sk + j) * s.hk + hk) * s.d)];
          float dot = 0.0f;
          for (int64_t c = 0; c < s.d; ++c) dot += qr[c] * kr[c];
          p[j] = mods ? mods->score(dot * scale, bi, hi, i + s.sk - s.sq - j) : dot * scale;
          m = std::fmax(m, p[j]);
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        double* o = &out[size_t(((bi * s.sq + i) * s.h + hi) * s.d)];
        if (m == -INFINITY) continue;  // empty row: out = 0
        float l = 0.0f;
        for (int64_t j = 0; j < s.sk; ++j) l += (p[j] = std::exp(p[j] - m));
        for (int64_t j = 0; j < s.sk; ++j) {
          const float w = round_to(p[j] / l, dt);
          if (w == 0.0f) continue;
          const float* vr = &v[size_t(((bi * s.sk + j) * s.hk + hk) * s.d)];
          for (int64_t c = 0; c < s.d; ++c) acc[c] += w * vr[c];
        }
        for (int64_t c = 0; c < s.d; ++c) o[c] = round_to(acc[c], dt);
      }
    }
}

}  // namespace cuda_test
