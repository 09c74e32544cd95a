// Tensor-core building blocks: wmma fragment types for 16x16x16 half/bfloat16 -> float, element
// conversions, warp reductions, and the row map of an accumulator fragment.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <type_traits>

#include "fa2_plan.hpp"

namespace flashdl::cuda {

namespace wmma = nvcuda::wmma;

// A kernel's dynamic shared memory (the launch's byte count), 128-byte aligned; the host
// emulator hands out its own per block.
#ifdef FLASHDL_CUDA_EMULATOR
#define FLASHDL_DYNAMIC_SMEM(name) unsigned char* const name = ::flashdl_emu::dynamic_smem()
#else
#define FLASHDL_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

constexpr int kFrag = 16;  // wmma tile: m = n = k = 16
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, wmma::row_major>;
// B = K^T read from K stored row-major: element (k, n) sits at K[n][k], i.e. column-major.
template <typename T>
using FragBt = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, wmma::col_major>;
template <typename T>
using FragB = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, wmma::row_major>;
// A = X^T read from X stored row-major (the backward's P^T and dS^T): column-major.
template <typename T>
using FragAt = wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, wmma::col_major>;
using FragAcc = wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float>;

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

// wmma::load_matrix_sync for bfloat16 compiles (nvcc 13) to generic 32-bit loads with 64-bit
// addresses (wmma.load without .shared), where float16's becomes one ldmatrix (LDSM) from a
// 32-bit shared address: the bfloat16 kernels spent registers on it (the fa2 forward spilled).
// load_frag loads a bfloat16 tile as float16 (the same 16-bit patterns) and copies the bits into
// the bfloat16 fragment, which then holds what wmma's own load would put there: so on sm_80 to
// sm_90 (kTwinLoads; by the SASS, both loads give the m16n8k16 operand layout), checked at
// kernel start by twin_loads_hold. Other architectures take wmma's own load. The host emulator
// models the m16n8k16 layout, so it runs this path too.
#if (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && __CUDA_ARCH__ < 1000) || \
    defined(FLASHDL_CUDA_EMULATOR)
constexpr bool kTwinLoads = true;
#else
constexpr bool kTwinLoads = false;
#endif

template <typename Use, typename Layout, typename T>
__device__ __forceinline__ void load_frag(wmma::fragment<Use, kFrag, kFrag, kFrag, T, Layout>& f,
                                          const T* p, unsigned ld) {
  if constexpr (kTwinLoads && std::is_same<T, __nv_bfloat16>::value) {
    wmma::fragment<Use, kFrag, kFrag, kFrag, __half, Layout> h;
    wmma::load_matrix_sync(h, reinterpret_cast<const __half*>(p), ld);
#pragma unroll
    for (int i = 0; i < f.num_elements; ++i)
      f.x[i] = __ushort_as_bfloat16(__half_as_ushort(h.x[i]));
  } else {
    wmma::load_matrix_sync(f, p, ld);
  }
}

template <typename Use, typename Layout, typename T>
__device__ __forceinline__ bool twin_load_matches(const T* tile) {
  wmma::fragment<Use, kFrag, kFrag, kFrag, T, Layout> own, twin;
  wmma::load_matrix_sync(own, tile, kFrag);
  load_frag(twin, tile, kFrag);
  bool ok = true;
#pragma unroll
  for (int i = 0; i < own.num_elements; ++i) ok = ok && to_float(own.x[i]) == to_float(twin.x[i]);
  return ok;
}

// Whether load_frag gives wmma's own fragments (A row-major, B column- and row-major), from a
// 16 x 16 tile of distinct values (fill_layout_tiles's, ld 16); the same answer in every lane.
// Trivially true where load_frag is wmma's load.
template <typename T>
__device__ __forceinline__ bool twin_loads_hold(const T* codes_t) {
  if constexpr (!kTwinLoads || !std::is_same<T, __nv_bfloat16>::value) {
    return true;
  } else {
    const bool ok = twin_load_matches<wmma::matrix_a, wmma::row_major>(codes_t) &&
                    twin_load_matches<wmma::matrix_b, wmma::col_major>(codes_t) &&
                    twin_load_matches<wmma::matrix_b, wmma::row_major>(codes_t);
    return __all_sync(kFullMask, ok);
  }
}

// twin_loads_hold and the column-major A operand the backward loads (P^T, dS^T).
template <typename T>
__device__ __forceinline__ bool twin_loads_hold_backward(const T* codes_t) {
  if constexpr (!kTwinLoads || !std::is_same<T, __nv_bfloat16>::value) {
    return true;
  } else {
    return twin_loads_hold<T>(codes_t) &&
           __all_sync(kFullMask, twin_load_matches<wmma::matrix_a, wmma::col_major>(codes_t));
  }
}

// P as the A operand of P V, from the float accumulator fragment of the scores, for the layout
// layout_holds checks: element i of the A fragment is element i % 8 of the accumulator. Pairs
// convert with one instruction; float16's repeated elements 8 to 15 take the same pairs.
template <typename T>
__device__ __forceinline__ void to_a_operand(FragA<T>& a, const FragAcc& s) {
#pragma unroll
  for (int j = 0; j < FragA<T>::num_elements / 2; ++j) {
    const int i = (2 * j) % FragAcc::num_elements;
    if constexpr (std::is_same<T, __half>::value) {
      const __half2 h = __floats2half2_rn(s.x[i], s.x[i + 1]);
      a.x[2 * j] = __low2half(h);
      a.x[2 * j + 1] = __high2half(h);
    } else {
      const __nv_bfloat162 h = __floats2bfloat162_rn(s.x[i], s.x[i + 1]);
      a.x[2 * j] = __low2bfloat16(h);
      a.x[2 * j + 1] = __high2bfloat16(h);
    }
  }
}

// wmma leaves the mapping of accumulator elements to (row, col) unspecified, but it is fixed for a
// fragment type on a given architecture. A warp learns the row of each element it holds once, by
// loading a 16x16 tile whose entries are their own row index; per-row factors (the online-softmax
// rescale, 1/l) can then be applied to the accumulators in registers.
struct FragRows {
  int r[FragAcc::num_elements];
};

// scratch: 16 x ld floats of this warp's shared memory, 32-byte aligned, ld a multiple of 4.
// cols: the column instead of the row (the decode kernel's per-row slow path needs both).
__device__ __forceinline__ FragRows accumulator_index(float* scratch, int ld, bool cols) {
  const int lane = threadIdx.x % 32;
  for (int e = lane; e < kFrag * kFrag; e += 32)
    scratch[(e / kFrag) * ld + e % kFrag] = float(cols ? e % kFrag : e / kFrag);
  __syncwarp();
  FragAcc f;
  wmma::load_matrix_sync(f, scratch, ld, wmma::mem_row_major);
  FragRows index;
#pragma unroll
  for (int i = 0; i < FragAcc::num_elements; ++i) index.r[i] = static_cast<int>(f.x[i]);
  __syncwarp();  // the scratch is reused by the caller
  return index;
}
__device__ __forceinline__ FragRows accumulator_rows(float* scratch, int ld) {
  return accumulator_index(scratch, ld, false);
}
__device__ __forceinline__ FragRows accumulator_cols(float* scratch, int ld) {
  return accumulator_index(scratch, ld, true);
}

// The register layout of the 16 x 16 fragments that the tensor cores' m16n8k16 instruction gives
// on sm_80 and sm_90 (the float accumulator is two m16n8 halves): lane l's accumulator element i
// holds (acc_row(l, i), acc_col(l, i); fa2_plan.hpp, tested on the host), and the matrix_a
// fragment (row-major, float16 or bfloat16) holds the same (row, col) at element i % 8 (float16's
// fragment repeats its 8 values in elements 8 to 15). With it the softmax runs on the score
// accumulators in registers (a row's values sit in the 4 lanes of a quad) and P becomes an A
// operand without shared memory. wmma does not promise it: a kernel checks it once with
// layout_holds and falls back to a shared-memory path when it fails.
//
// Fills the two 16 x 16 index tiles layout_holds reads (ld 16): entry (r, c) = 16 r + c, as float
// and as T (exact in both: at most 255). The caller synchronises the block before the warps read.
template <typename T>
__device__ __forceinline__ void fill_layout_tiles(float* codes_f, T* codes_t, int threads) {
  for (int e = threadIdx.x; e < kFrag * kFrag; e += threads) {
    codes_f[e] = float(e);
    codes_t[e] = from_float<T>(float(e));
  }
}

// The T tile alone (twin_loads_hold's input).
template <typename T>
__device__ __forceinline__ void fill_code_tile(T* codes_t, int threads) {
  for (int e = threadIdx.x; e < kFrag * kFrag; e += threads) codes_t[e] = from_float<T>(float(e));
}

// Whether this architecture's wmma fragments follow acc_row / acc_col (accumulator) and put the
// same (row, col) at element i % 8 of matrix_a; the same answer in every lane (warp vote).
template <typename T>
__device__ __forceinline__ bool layout_holds(const float* codes_f, const T* codes_t) {
  static_assert(FragA<T>::num_elements % FragAcc::num_elements == 0, "8 or 16 A elements");
  const int lane = threadIdx.x % 32;
  FragAcc f;
  FragA<T> a;
  wmma::load_matrix_sync(f, codes_f, kFrag, wmma::mem_row_major);
  wmma::load_matrix_sync(a, codes_t, kFrag);
  bool ok = true;
#pragma unroll
  for (int i = 0; i < FragAcc::num_elements; ++i)
    ok = ok && f.x[i] == float(kFrag * acc_row(lane, i) + acc_col(lane, i));
#pragma unroll
  for (int i = 0; i < FragA<T>::num_elements; ++i)
    ok = ok && to_float(a.x[i]) == f.x[i % FragAcc::num_elements];
  return __all_sync(kFullMask, ok);
}

// The (row, col) of every accumulator element this lane holds, for kernels that write
// accumulators straight from registers to global memory (the backward's dK, dV, dQ).
struct FragMap {
  unsigned char r[FragAcc::num_elements];
  unsigned char c[FragAcc::num_elements];
  // Every even element e and e + 1 are (r, c) and (r, c + 1), c even, in every lane of the warp:
  // a pair goes to memory as one 32-bit store (store_pair).
  bool pairs;
};

// Whether a learnt map is the m16n8k16 layout of acc_row / acc_col (sm_80, sm_90), so that code
// may use that layout's offsets, known at compile time; the same answer in every lane.
__device__ __forceinline__ bool map_is_mma_layout(const FragMap& m) {
  const int lane = threadIdx.x % 32;
  bool ok = true;
#pragma unroll
  for (int e = 0; e < FragAcc::num_elements; ++e)
    ok = ok && m.r[e] == acc_row(lane, e) && m.c[e] == acc_col(lane, e);
  return __all_sync(kFullMask, ok);
}

// Learnt by every warp from two 16 x 16 float tiles at `rows` and `cols` (ld floats apart, 32-byte
// aligned) that the whole CTA filled with their own row and column indices (fill_fragment_map).
__device__ __forceinline__ FragMap accumulator_map(const float* rows, const float* cols, int ld) {
  FragAcc fr, fc;
  wmma::load_matrix_sync(fr, rows, ld, wmma::mem_row_major);
  wmma::load_matrix_sync(fc, cols, ld, wmma::mem_row_major);
  FragMap m;
#pragma unroll
  for (int i = 0; i < FragAcc::num_elements; ++i) {
    m.r[i] = static_cast<unsigned char>(fr.x[i]);
    m.c[i] = static_cast<unsigned char>(fc.x[i]);
  }
  bool pairs = true;
#pragma unroll
  for (int i = 0; i < FragAcc::num_elements; i += 2)
    pairs = pairs && m.r[i] == m.r[i + 1] && m.c[i] % 2 == 0 && m.c[i + 1] == m.c[i] + 1;
  m.pairs = __all_sync(kFullMask, pairs);
  return m;
}

// The map of the m16n8k16 layout itself (acc_row / acc_col), for kernels that have checked it
// holds (map_is_mma_layout): its offsets are then known to the compiler, a lane's rows two per
// 16-row fragment (lane / 4, lane / 4 + 8), instead of read from a learnt map.
__device__ __forceinline__ FragMap mma_frag_map() {
  const int lane = threadIdx.x % 32;
  FragMap m;
#pragma unroll
  for (int i = 0; i < FragAcc::num_elements; ++i) {
    m.r[i] = static_cast<unsigned char>(acc_row(lane, i));
    m.c[i] = static_cast<unsigned char>(acc_col(lane, i));
  }
  m.pairs = true;
  return m;
}

// T values a, b at p and p + 1 in one 32-bit store (p 4-byte aligned).
template <typename T>
__device__ __forceinline__ void store_pair(T* p, float a, float b) {
  if constexpr (std::is_same<T, __half>::value)
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
  else
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

// *p += a and *(p + 1) += b in global memory, each atomically (p 8-byte aligned): on sm_90 one
// vector reduction (float2 atomicAdd, a RED of two floats), which halves the instructions the
// load/store unit queues; elsewhere (sm_80, the host emulator) two float atomics.
__device__ __forceinline__ void atomic_add_pair(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// The CTA's half of accumulator_map: tile `rows` gets entry (r, c) = r, tile `cols` gets c. The
// caller synchronises the block before the warps read them.
__device__ __forceinline__ void fill_fragment_map(float* rows, float* cols, int ld, int threads) {
  for (int e = threadIdx.x; e < kFrag * kFrag; e += threads) {
    rows[(e / kFrag) * ld + e % kFrag] = float(e / kFrag);
    cols[(e / kFrag) * ld + e % kFrag] = float(e % kFrag);
  }
}

}  // namespace flashdl::cuda
