// nvcuda::wmma for flashdl's CUDA host emulator: 16 x 16 x 16 fragments of float16 / bfloat16 with
// float accumulators, in the register layout of the PTX ISA's mma.m16n8k16 (two n = 8 halves per
// 16 x 16 tile), which is what nvcc gives on sm_80 and sm_90: lane l = 4 g + t holds
//   accumulator element i:  row g + 8 ((i / 2) % 2), column 8 (i / 4) + 2 t + i % 2
//   matrix_a element i:     row g + 8 ((i / 2) % 2), column 8 (i / 4) + 2 t + i % 2
//   matrix_b element i:     row 2 t + i % 2 + 8 ((i / 2) % 2), column g + 8 (i / 4)
// float16 operand fragments have 16 elements, the second 8 repeating the first (as nvcc's do);
// bfloat16 ones have 8. Loads and stores check the pointer's 32-byte alignment and that the leading
// dimension is a multiple of 16 bytes, as wmma requires.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "half.hpp"
#include "runtime.hpp"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename T, int N>
struct __frag_base {
  enum { num_elements = N };
  T x[N];
};

template <typename Use, int m, int n, int k, typename T, typename Layout = void>
class fragment;
template <typename L>
class fragment<matrix_a, 16, 16, 16, __half, L> : public __frag_base<__half, 16> {};
template <typename L>
class fragment<matrix_b, 16, 16, 16, __half, L> : public __frag_base<__half, 16> {};
template <typename L>
class fragment<matrix_a, 16, 16, 16, __nv_bfloat16, L> : public __frag_base<__nv_bfloat16, 8> {};
template <typename L>
class fragment<matrix_b, 16, 16, 16, __nv_bfloat16, L> : public __frag_base<__nv_bfloat16, 8> {};
template <>
class fragment<accumulator, 16, 16, 16, float, void> : public __frag_base<float, 8> {};

namespace detail {

inline int lane() { return static_cast<int>(threadIdx.x % 32); }
// (row, column) of element i (of the first 8) for lane l.
inline int acc_row(int l, int i) { return l / 4 + 8 * ((i / 2) % 2); }
inline int acc_col(int l, int i) { return 8 * (i / 4) + 2 * (l % 4) + i % 2; }
inline int b_row(int l, int i) { return 2 * (l % 4) + i % 2 + 8 * ((i / 2) % 2); }
inline int b_col(int l, int i) { return l / 4 + 8 * (i / 4); }

template <typename Use>
inline int elem_row(int l, int i) {
  return std::is_same<Use, matrix_b>::value ? b_row(l, i % 8) : acc_row(l, i % 8);
}
template <typename Use>
inline int elem_col(int l, int i) {
  return std::is_same<Use, matrix_b>::value ? b_col(l, i % 8) : acc_col(l, i % 8);
}

inline void check_ptr(const void* p, unsigned ldm, std::size_t elem_bytes, const char* what) {
  if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0)
    ::flashdl_emu::fail((std::string(what) + ": pointer not 32-byte aligned").c_str());
  if ((ldm * elem_bytes) % 16 != 0)
    ::flashdl_emu::fail(
        (std::string(what) + ": leading dimension not a multiple of 16 bytes").c_str());
}

template <typename T>
struct MmaLane {
  float* d;
  const T* a;
  const T* b;
  const float* c;
};

}  // namespace detail

template <typename Use, typename T, typename L>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ldm) {
  detail::check_ptr(p, ldm, sizeof(T), "wmma::load_matrix_sync");
  const int l = detail::lane();
  for (int i = 0; i < f.num_elements; ++i) {
    const int r = detail::elem_row<Use>(l, i), c = detail::elem_col<Use>(l, i);
    f.x[i] = std::is_same<L, row_major>::value ? p[r * ldm + c] : p[c * ldm + r];
  }
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout) {
  detail::check_ptr(p, ldm, sizeof(float), "wmma::load_matrix_sync");
  const int l = detail::lane();
  for (int i = 0; i < f.num_elements; ++i) {
    const int r = detail::acc_row(l, i), c = detail::acc_col(l, i);
    f.x[i] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
  }
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
  detail::check_ptr(p, ldm, sizeof(float), "wmma::store_matrix_sync");
  const int l = detail::lane();
  for (int i = 0; i < f.num_elements; ++i) {
    const int r = detail::acc_row(l, i), c = detail::acc_col(l, i);
    (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[i];
  }
}

template <typename Use, typename T, typename L, typename V>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, L>& f, const V& v) {
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = static_cast<T>(v);
}

// D = A B + C for the warp: the last lane to arrive rebuilds A, B and C from every lane's
// fragments (elements 0 to 7) and writes every lane's D.
template <typename T, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, T, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, T, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
  detail::MmaLane<T> mine{d.x, a.x, b.x, c.x};
  ::flashdl_emu::warp_collective(
      0xffffffffu, ::flashdl_emu::kMma, &mine,
      [](void* const* s, void*) {
        float A[16][16], B[16][16], C[16][16];
        for (int l = 0; l < 32; ++l) {
          const auto* m = static_cast<const detail::MmaLane<T>*>(s[l]);
          for (int i = 0; i < 8; ++i) {
            A[detail::acc_row(l, i)][detail::acc_col(l, i)] = static_cast<float>(m->a[i]);
            B[detail::b_row(l, i)][detail::b_col(l, i)] = static_cast<float>(m->b[i]);
            C[detail::acc_row(l, i)][detail::acc_col(l, i)] = m->c[i];
          }
        }
        float D[16][16];
        for (int r = 0; r < 16; ++r)
          for (int col = 0; col < 16; ++col) {
            float acc = C[r][col];
            for (int k = 0; k < 16; ++k) acc += A[r][k] * B[k][col];
            D[r][col] = acc;
          }
        for (int l = 0; l < 32; ++l) {
          auto* m = static_cast<const detail::MmaLane<T>*>(s[l]);
          for (int i = 0; i < 8; ++i) m->d[i] = D[detail::acc_row(l, i)][detail::acc_col(l, i)];
        }
      },
      nullptr);
}

}  // namespace wmma
}  // namespace nvcuda
