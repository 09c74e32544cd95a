// Owning host arrays for the tests: any storage order, padded rows and reversed (negative-stride)
// dimensions, viewed through a flashdl::TensorView; storage-dtype rounding and bit encoding written
// independently of the library's own conversions; a small deterministic random generator.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <utility>
#include <vector>

#include "flashdl/tensor.hpp"

namespace flashdl_test {

using flashdl::DType;

// ---- storage dtypes -------------------------------------------------------------------------

// Rounds x to the nearest value of a binary format with `bits` significand bits (implicit bit
// included) and smallest normal exponent `emin` (x = f * 2^e, f in [0.5, 1)), ties to even.
inline double round_to_precision(double x, int bits, int emin, double max_finite) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  int e = 0;
  std::frexp(x, &e);
  if (e < emin) e = emin;  // subnormal: a fixed quantum
  const double scale = std::ldexp(1.0, bits - e);
  const double r = std::nearbyint(x * scale) / scale;
  if (std::fabs(r) > max_finite) return std::copysign(INFINITY, x);
  return r;
}

inline double round_to(double x, DType dt) {
  switch (dt) {
    case DType::float16: return round_to_precision(x, 11, -13, 65504.0);
    case DType::bfloat16: return round_to_precision(x, 8, -125, 3.3895313892515355e38);
    case DType::float32: return static_cast<double>(static_cast<float>(x));
    default: return x;
  }
}

// Unit roundoff of the storage dtype.
inline double unit_roundoff(DType dt) {
  switch (dt) {
    case DType::float16: return std::ldexp(1.0, -11);
    case DType::bfloat16: return std::ldexp(1.0, -8);
    case DType::float32: return std::ldexp(1.0, -24);
    default: return std::ldexp(1.0, -53);
  }
}

inline uint16_t encode_fp16(double r) {  // r already representable
  const uint16_t sign = std::signbit(r) ? 0x8000u : 0u;
  const double a = std::fabs(r);
  if (std::isnan(r)) return 0x7e00u;
  if (std::isinf(r)) return sign | 0x7c00u;
  if (a == 0.0) return sign;
  if (a < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(a * std::ldexp(1.0, 24));
  int e = 0;
  const double f = std::frexp(a, &e);
  const auto man = static_cast<uint16_t>((f * 2.0 - 1.0) * 1024.0);
  return sign | static_cast<uint16_t>((e - 1 + 15) << 10) | man;
}

inline double decode_fp16(uint16_t h) {
  const double sign = (h & 0x8000u) ? -1.0 : 1.0;
  const int e = (h >> 10) & 0x1f;
  const int man = h & 0x3ff;
  if (e == 0) return sign * std::ldexp(static_cast<double>(man), -24);
  if (e == 31) return man ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  return sign * std::ldexp(1.0 + man / 1024.0, e - 15);
}

inline uint16_t encode_bf16(double r) {  // r already representable: the top half of its float
  const float f = static_cast<float>(r);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

inline double decode_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- random numbers ---------------------------------------------------------------------------

struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {  // splitmix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double symmetric(double amp) { return amp * (2.0 * uniform() - 1.0); }      // [-amp, amp)
};

// ---- arrays -----------------------------------------------------------------------------------

// How a logical array is laid out in memory. The last dimension is always contiguous.
struct Layout {
  std::vector<int> order;  // storage order of the other dimensions, outermost first; empty: natural
  int64_t pad = 0;         // unused elements after every last-dimension row
  int reverse = -1;        // a dimension (not the last) stored back to front: negative stride
};

class Array {
 public:
  Array() = default;
  Array(DType dtype, std::vector<int64_t> shape, const Layout& layout = {})
      : shape_(std::move(shape)) {
    const int rank = static_cast<int>(shape_.size());
    if (rank < 1 || rank > flashdl::kMaxRank) throw std::runtime_error("Array: bad rank");
    std::vector<int> order = layout.order;
    if (order.empty()) {
      order.resize(rank - 1);
      std::iota(order.begin(), order.end(), 0);
    }
    std::vector<int64_t> strides(rank);
    strides[rank - 1] = 1;
    int64_t s = shape_[rank - 1] + layout.pad;
    for (int k = rank - 2; k >= 0; --k) {
      strides[order[k]] = s;
      s *= shape_[order[k]];
    }
    storage_elems_ = s;
    elem_ = static_cast<int64_t>(flashdl::dtype_size(dtype));
    words_.assign(static_cast<size_t>((storage_elems_ * elem_ + 7) / 8 + 1), 0);
    int64_t base = 0;
    if (layout.reverse >= 0 && shape_[layout.reverse] > 0) {
      base = strides[layout.reverse] * (shape_[layout.reverse] - 1);
      strides[layout.reverse] = -strides[layout.reverse];
    }
    base_ = base;
    view_.data = bytes() + base * elem_;
    view_.dtype = dtype;
    view_.rank = rank;
    for (int i = 0; i < rank; ++i) {
      view_.shape[i] = shape_[i];
      view_.strides[i] = strides[i];
    }
  }

  // Copies own their storage, so the view must point into the copy's.
  Array(const Array& o)
      : shape_(o.shape_),
        words_(o.words_),
        storage_elems_(o.storage_elems_),
        elem_(o.elem_),
        base_(o.base_),
        view_(o.view_) {
    view_.data = bytes() + base_ * elem_;
  }
  Array& operator=(const Array& o) {
    if (this != &o) {
      Array tmp(o);
      *this = std::move(tmp);
    }
    return *this;
  }
  Array(Array&&) = default;  // a moved vector keeps its buffer: the view stays valid
  Array& operator=(Array&&) = default;

  const flashdl::TensorView& view() const { return view_; }
  DType dtype() const { return view_.dtype; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const { return view_.numel(); }
  unsigned char* bytes() { return reinterpret_cast<unsigned char*>(words_.data()); }
  const unsigned char* bytes() const {
    return reinterpret_cast<const unsigned char*>(words_.data());
  }
  std::vector<unsigned char> byte_copy() const {
    return {bytes(), bytes() + storage_elems_ * elem_};
  }

  // Storage element index of logical element `flat` (row-major over the logical shape).
  int64_t storage_index(int64_t flat) const {
    int64_t off = base_;
    for (int i = view_.rank - 1; i >= 0; --i) {
      off += (flat % shape_[i]) * view_.strides[i];
      flat /= shape_[i];
    }
    return off;
  }

  double get(int64_t flat) const { return load(storage_index(flat)); }
  void set(int64_t flat, double x) { store(storage_index(flat), x); }

  std::vector<double> values() const {
    std::vector<double> out(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) out[i] = get(i);
    return out;
  }
  // Fills the logical elements with `x` rounded to the dtype.
  void assign(const std::vector<double>& x) {
    for (int64_t i = 0; i < numel(); ++i) set(i, x[i]);
  }
  void fill_random(Rng& rng, double amp) {
    for (int64_t i = 0; i < numel(); ++i) set(i, rng.symmetric(amp));
  }
  // Every byte 0xFF: NaN in every float dtype, so an element nobody wrote is caught.
  void poison() { std::memset(bytes(), 0xFF, static_cast<size_t>(storage_elems_ * elem_)); }

  // After poison() and a call: true when no storage element outside the view was written.
  bool padding_untouched() const {
    std::vector<char> used(static_cast<size_t>(storage_elems_), 0);
    for (int64_t i = 0; i < numel(); ++i) used[storage_index(i)] = 1;
    for (int64_t e = 0; e < storage_elems_; ++e)
      if (!used[e])
        for (int64_t b = 0; b < elem_; ++b)
          if (bytes()[e * elem_ + b] != 0xFF) return false;
    return true;
  }

 private:
  double load(int64_t e) const {
    const unsigned char* p = bytes() + e * elem_;
    switch (view_.dtype) {
      case DType::float16: {
        uint16_t h;
        std::memcpy(&h, p, 2);
        return decode_fp16(h);
      }
      case DType::bfloat16: {
        uint16_t h;
        std::memcpy(&h, p, 2);
        return decode_bf16(h);
      }
      case DType::float32: {
        float f;
        std::memcpy(&f, p, 4);
        return f;
      }
      case DType::float64: {
        double d;
        std::memcpy(&d, p, 8);
        return d;
      }
      case DType::int32: {
        int32_t i;
        std::memcpy(&i, p, 4);
        return i;
      }
      default: return static_cast<double>(*p);
    }
  }
  void store(int64_t e, double x) {
    unsigned char* p = bytes() + e * elem_;
    const double r = round_to(x, view_.dtype);
    switch (view_.dtype) {
      case DType::float16: {
        const uint16_t h = encode_fp16(r);
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::bfloat16: {
        const uint16_t h = encode_bf16(r);
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::float32: {
        const float f = static_cast<float>(r);
        std::memcpy(p, &f, 4);
        break;
      }
      case DType::float64: std::memcpy(p, &r, 8); break;
      case DType::int32: {
        const auto i = static_cast<int32_t>(x);
        std::memcpy(p, &i, 4);
        break;
      }
      default: *p = x != 0.0; break;
    }
  }

  std::vector<int64_t> shape_;
  std::vector<uint64_t> words_;
  int64_t storage_elems_ = 0, elem_ = 1, base_ = 0;
  flashdl::TensorView view_{};
};

// A copy of `a` in another dtype, contiguous (values exactly preserved when widening).
inline Array convert(const Array& a, DType dt) {
  Array out(dt, a.shape());
  out.assign(a.values());
  return out;
}

}  // namespace flashdl_test
