// The checks every entry point (attention, varlen, the KV cache, merge_states) builds its
// validation from: each names the argument it checks, what was expected and what was given, and
// throws flashdl::Error (never a crash, never a write). src/checks.cpp.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "flashdl/error.hpp"
#include "flashdl/tensor.hpp"

namespace flashdl::validate {

// The extents of a validated problem (validate.hpp's checks return them; Params are filled from
// them).
struct Shapes {
  int64_t batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim;
};

[[noreturn]] void fail(ErrorKind kind, const std::string& msg);
// A number in an error message as the caller wrote it: the shortest text that reads back exactly.
std::string num_str(double x);
std::string num_str(float x);
std::string shape_str(const TensorView& t);
std::string shape_str(std::initializer_list<int64_t> shape);

// Rank 1 to kMaxRank, no negative extent, data unless empty.
void check_defined(const char* name, const TensorView& t);
void check_rank(const char* name, const TensorView& t, int rank, const char* layout);
void check_shape(const char* name, const TensorView& t, std::initializer_list<int64_t> shape,
                 const char* layout);
void check_dtype(const char* name, const TensorView& t, DType expected, const char* why);
// An int32 index table in host memory (block tables, cache lengths, batch indices): its rank,
// dtype and device, named `name` in errors; and its element (i, j), any strides.
void check_host_int32(const char* name, const TensorView& t, int rank, const char* layout);
inline int64_t host_int32(const TensorView& t, int64_t i, int64_t j = 0) {
  const auto* base = static_cast<const int32_t*>(t.data);
  return base[i * t.strides[0] + (t.rank > 1 ? j * t.strides[1] : 0)];
}
void check_device(const char* name, const TensorView& t, Device expected);
void check_last_dim_contiguous(const char* name, const TensorView& t);
// An array the kernels read or write beside q: of `dtype` (why says whose: "the dtype of q"), on
// `device` (the device of q), its last dimension contiguous.
void check_storage(const char* name, const TensorView& t, DType dtype, const char* dtype_why,
                   Device device);
// out (written) and in share no byte: their memory spans are disjoint, or they are views of the
// same shape and strides whose elements interleave without a common one (k and v sliced from one
// packed buffer). Otherwise ValueError naming out and in.
// An argument's name and view, for the checks that walk several arrays.
using NamedView = std::pair<const char*, const TensorView*>;
void check_no_overlap(const char* out_name, const TensorView& out, const char* in_name,
                      const TensorView& in);
// A written array addresses each element through one index only (a sufficient condition, exact
// for stride 0: see checks.cpp). Otherwise ValueError naming it.
void check_no_self_overlap(const char* name, const TensorView& t);

}  // namespace flashdl::validate
