// The checks every entry point builds its validation from: each names the argument it checks,
// what was expected and what was given, and throws flashdl::Error. No Params, no dispatch.
#include "checks.hpp"

#include <algorithm>
#include <charconv>
#include <string>
#include <utility>

namespace flashdl::validate {

namespace {

// Byte range [lo, hi) the view can touch; empty views touch nothing.
struct Extent {
  uintptr_t lo = 0, hi = 0;
};

Extent extent(const TensorView& t) {
  if (t.numel() == 0 || t.data == nullptr) return {};
  const auto base = reinterpret_cast<intptr_t>(t.data);
  const auto es = static_cast<intptr_t>(dtype_size(t.dtype));
  intptr_t lo = base, hi = base;
  for (int i = 0; i < t.rank; ++i) {
    const intptr_t span = static_cast<intptr_t>(t.strides[i]) * (t.shape[i] - 1) * es;
    (span < 0 ? lo : hi) += span;
  }
  return {static_cast<uintptr_t>(lo), static_cast<uintptr_t>(hi + es)};
}

}  // namespace

// Plain string arithmetic, no iostreams: with an ostringstream here, every error message that
// printed a shape killed the Python process (SIGSEGV) on the H100 machine, in pytest workers that
// had also loaded torch, CuPy and JAX.
std::string shape_str(const TensorView& t) {
  std::string s = "(";
  for (int i = 0; i < t.rank; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  s += t.rank == 1 ? ",)" : ")";
  return s;
}

std::string shape_str(std::initializer_list<int64_t> shape) {
  TensorView t;
  t.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  return shape_str(t);
}

// std::to_chars without a precision writes the shortest text that reads back to the same value,
// so a dropout_p of 1.5 prints as "1.5" (std::to_string gives "1.500000", and 1e-9 as "0.000000").
// A float prints as the shortest float text: the 0.3 a caller wrote, not 0.300000012.
template <typename T>
static std::string shortest(T x) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

std::string num_str(double x) { return shortest(x); }
std::string num_str(float x) { return shortest(x); }

[[noreturn]] void fail(ErrorKind kind, const std::string& msg) { throw Error(kind, msg); }

void check_defined(const char* name, const TensorView& t) {
  if (t.rank <= 0 || t.rank > kMaxRank)
    fail(ErrorKind::value, std::string(name) + ": expected an array of rank 1 to 4, got rank " +
                               std::to_string(t.rank));
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] < 0)
      fail(ErrorKind::value, std::string(name) + ": negative extent in shape " + shape_str(t));
  if (t.data == nullptr && t.numel() > 0)
    fail(ErrorKind::value, std::string(name) + ": null data pointer for a non-empty array");
}

void check_rank(const char* name, const TensorView& t, int rank, const char* layout) {
  check_defined(name, t);
  if (t.rank != rank)
    fail(ErrorKind::value, std::string(name) + ": expected rank " + std::to_string(rank) + " " +
                               layout + ", got shape " + shape_str(t));
}

void check_shape(const char* name, const TensorView& t, std::initializer_list<int64_t> shape,
                 const char* layout) {
  int i = 0;
  bool ok = t.rank == static_cast<int>(shape.size());
  for (int64_t s : shape) ok = ok && t.shape[i++] == s;
  if (!ok)
    fail(ErrorKind::value, std::string(name) + ": expected shape " + shape_str(shape) + " " +
                               layout + ", got " + shape_str(t));
}

void check_dtype(const char* name, const TensorView& t, DType expected, const char* why) {
  if (t.dtype != expected)
    fail(ErrorKind::type, std::string(name) + ": expected dtype " + dtype_name(expected) + " (" +
                              why + "), got " + dtype_name(t.dtype));
}

void check_host_int32(const char* name, const TensorView& t, int rank, const char* layout) {
  check_rank(name, t, rank, layout);
  check_dtype(name, t, DType::int32, "indices and lengths are int32");
  if (t.device.type != DeviceType::cpu)
    fail(ErrorKind::value, std::string(name) +
                               ": expected an array on the CPU (host memory), got " +
                               device_name(t.device.type) + ":" + std::to_string(t.device.id));
}

void check_device(const char* name, const TensorView& t, Device expected) {
  if (t.device != expected)
    fail(ErrorKind::value, std::string(name) + ": expected an array on " +
                               device_name(expected.type) + ":" + std::to_string(expected.id) +
                               " (the device of q), got " + device_name(t.device.type) + ":" +
                               std::to_string(t.device.id));
}

void check_last_dim_contiguous(const char* name, const TensorView& t) {
  const int last = t.rank - 1;
  // Empty arrays hold no element to reach, and exporters give them arbitrary (often 0) strides.
  if (t.numel() > 0 && t.shape[last] > 1 && t.strides[last] != 1)
    fail(ErrorKind::value, std::string(name) +
                               ": the last dimension must be contiguous (stride 1), "
                               "got stride " +
                               std::to_string(t.strides[last]));
}

void check_storage(const char* name, const TensorView& t, DType dtype, const char* dtype_why,
                   Device device) {
  check_dtype(name, t, dtype, dtype_why);
  check_device(name, t, device);
  check_last_dim_contiguous(name, t);
}

namespace {

// Whether no two distinct indices of t address overlapping bytes, by a sufficient condition that
// holds for every view made by slicing (with steps), transposing or selecting from a contiguous
// array: the axes of extent > 1, sorted by |stride|, each have a stride (in bytes) at least the
// span of all smaller axes (element size plus sum of |stride| x (extent - 1)). A stride of 0 on an
// axis of extent > 1 (an expanded array) fails it and does overlap; other failures may not
// (strides such as (2, 3) for shape (3, 2) interleave without a collision) but are refused too.
// An axis of extent > 1 as the overlap checks see it: |stride| in bytes and extent.
struct Axis {
  __int128 stride, extent;
};

// Whether the n axes, sorted by stride, each stride at least the span of all smaller axes
// (starting from the element size es): then no two elements share a byte. At most kMaxRank + 1
// axes: an insertion sort (std::sort's threshold path drew GCC 12 -Warray-bounds false
// positives over the five-element array).
bool axes_never_collide(Axis* axes, int n, __int128 es) {
  for (int i = 1; i < n; ++i)
    for (int j = i; j > 0 && axes[j].stride < axes[j - 1].stride; --j)
      std::swap(axes[j], axes[j - 1]);
  __int128 span = es;
  for (int i = 0; i < n; ++i) {
    if (axes[i].stride < span) return false;
    span += axes[i].stride * (axes[i].extent - 1);
  }
  return true;
}

bool provably_no_self_overlap(const TensorView& t, int64_t& zero_axis) {
  zero_axis = -1;
  if (t.numel() == 0) return true;
  Axis axes[kMaxRank + 1];
  int n = 0;
  const __int128 es = static_cast<__int128>(dtype_size(t.dtype));
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] <= 1) continue;
    if (t.strides[i] == 0) {
      zero_axis = i;
      return false;
    }
    const __int128 st = t.strides[i] < 0 ? -static_cast<__int128>(t.strides[i]) : t.strides[i];
    axes[n++] = {st * es, t.shape[i]};
  }
  return axes_never_collide(axes, n, es);
}

// Whether a and b provably share no byte: disjoint spans, or (the interleaved views of one buffer,
// e.g. k and v sliced from a packed kv) the same shape and strides at a whole-element distance,
// where the two together are one view with a leading axis of extent 2 and stride that distance,
// proven free of self-overlap above.
bool provably_disjoint(const TensorView& a, const TensorView& b) {
  const Extent x = extent(a), y = extent(b);
  if (!(x.lo < x.hi && y.lo < y.hi && x.lo < y.hi && y.lo < x.hi)) return true;
  if (a.rank != b.rank || a.rank >= kMaxRank + 1 || dtype_size(a.dtype) != dtype_size(b.dtype))
    return false;
  for (int i = 0; i < a.rank; ++i)
    if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.strides[i] != b.strides[i])) return false;
  const auto es = static_cast<intptr_t>(dtype_size(a.dtype));
  const intptr_t delta = reinterpret_cast<intptr_t>(b.data) - reinterpret_cast<intptr_t>(a.data);
  if (delta % es != 0) return false;
  // TensorView holds kMaxRank axes: the pair is checked as a view of rank + 1 built by hand.
  Axis axes[kMaxRank + 1];
  int n = 0;
  const __int128 d = delta < 0 ? -static_cast<__int128>(delta) : delta;
  if (d == 0) return false;
  axes[n++] = {d, 2};
  for (int i = 0; i < a.rank; ++i) {
    if (a.shape[i] <= 1) continue;
    if (a.strides[i] == 0) return false;
    const __int128 st = a.strides[i] < 0 ? -static_cast<__int128>(a.strides[i]) : a.strides[i];
    axes[n++] = {st * es, a.shape[i]};
  }
  return axes_never_collide(axes, n, es);
}

}  // namespace

void check_no_overlap(const char* out_name, const TensorView& out, const char* in_name,
                      const TensorView& in) {
  if (provably_disjoint(out, in)) return;
  fail(ErrorKind::value,
       std::string(out_name) + ": output memory overlaps " + in_name +
           " (their memory spans intersect, and flashdl accepts intersecting spans only for "
           "views of the same shape and strides whose elements interleave without sharing "
           "one); flashdl never writes into an input or into one output through another, pass "
           "a separate array");
}

void check_no_self_overlap(const char* name, const TensorView& t) {
  int64_t zero_axis = -1;
  if (provably_no_self_overlap(t, zero_axis)) return;
  if (zero_axis >= 0)
    fail(ErrorKind::value, std::string(name) +
                               ": the array is written but addresses one element "
                               "through several indices (stride 0 on axis " +
                               std::to_string(zero_axis) + " of extent " +
                               std::to_string(t.shape[zero_axis]) +
                               ", e.g. an expanded or broadcast array); pass an array with memory "
                               "of its own, such as a contiguous copy");
  std::string strides = "(";
  for (int i = 0; i < t.rank; ++i) strides += (i ? ", " : "") + std::to_string(t.strides[i]);
  strides += t.rank == 1 ? ",)" : ")";
  fail(ErrorKind::value, std::string(name) + ": the array is written, and its strides " + strides +
                             " for shape " + shape_str(t) +
                             " may address one element through two indices (flashdl writes "
                             "only views whose strides, sorted by size, each reach past the span "
                             "of the smaller axes); pass a contiguous array");
}

}  // namespace flashdl::validate
