// flashdl's CUDA host emulator: the part of the CUDA runtime and device language that flashdl's
// CUDA backend uses, implemented on the CPU so that the kernels' own source runs without a GPU.
//
// Each thread block runs as blockDim cooperative fibers on one host thread (blocks are spread over
// host threads). A fiber runs until it reaches a synchronisation point: __syncthreads, a warp
// collective (__syncwarp, shuffles, votes, wmma::mma_sync) or a cp.async wait; the order in which
// fibers resume is shuffled from a seed (FLASHDL_EMU_SEED), so code that reads shared memory
// another thread wrote without a barrier in between gives different results from run to run.
// Checked as the hardware or the programming guide requires, and reported with the block and
// thread (the process then aborts): barriers and warp collectives that not every thread reaches
// (deadlock) or that a warp reaches at different calls, wmma pointer alignment and leading
// dimensions, cp.async sizes, alignment and destinations, launch configurations (block size,
// grid, dynamic shared memory against cudaFuncSetAttribute), and __trap. Shared memory starts
// filled with 0xff bytes (NaN in every float type) and sits just before an inaccessible page, as
// does every cudaMalloc allocation, so reads of unwritten shared memory show and overruns fault.
//
// A launch written in a translation unit compiled with FLASHDL_EMU_FTZ=1 (the ones nvcc compiles
// with -ftz=true) runs with the host's flush-to-zero and denormals-are-zero modes on (x86's MXCSR;
// elsewhere the flag is ignored), so float denormals flush as the GPU's -ftz=true arithmetic
// flushes them; the caller's modes are restored when the grid is done.
//
// What it does not model: timing, the tensor cores' accumulation order (products are summed in
// float in k order), memory-model subtleties beyond barriers, and the true register layout of
// wmma fragments (it uses the PTX ISA's m16n8k16 layout, the one flashdl's kernels check for).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- qualifiers -----------------------------------------------------------------------------------
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) alignas(n)
#define __restrict__ __restrict

// ---- vector types -----------------------------------------------------------------------------------
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

// ---- runtime API ------------------------------------------------------------------------------------
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInsufficientDriver = 35,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorLaunchFailure = 719,
};
typedef cudaError_t cudaError;
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaDeviceAttr {
  cudaDevAttrMaxGridDimX = 5,
  cudaDevAttrMaxGridDimY = 6,
  cudaDevAttrMaxGridDimZ = 7,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};
constexpr unsigned cudaStreamDefault = 0, cudaStreamNonBlocking = 1;
struct cudaDeviceProp {
  char name[256];
  int major, minor;
  int multiProcessorCount;
  std::size_t sharedMemPerBlock, sharedMemPerBlockOptin, totalGlobalMem;
  int maxThreadsPerBlock;
  int maxGridSize[3];
};

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorName(cudaError_t err);
const char* cudaGetErrorString(cudaError_t err);
cudaError_t cudaMalloc(void** ptr, std::size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMallocAsync(void** ptr, std::size_t bytes, cudaStream_t stream);
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream);
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* ptr, int value, std::size_t bytes);
cudaError_t cudaMemsetAsync(void* ptr, int value, std::size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value);
template <typename F>
cudaError_t cudaFuncSetAttribute(F* func, cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(func), attr, value);
}

// ---- the emulator's own interface (the device builtins below and the launch macro use it) ---------
namespace flashdl_emu {

uint3 thread_idx();
uint3 block_idx();
dim3 block_dim();
dim3 grid_dim();
unsigned char* dynamic_smem();
[[noreturn]] void fail(const char* what);  // reports the block and thread, then aborts

void syncthreads();
int syncthreads_or(int pred);  // a block barrier that returns whether any thread's pred was nonzero
// A warp collective: every lane in `mask` calls it with the same `kind`; the last to arrive runs
// op(slots), slots[l] being lane l's `mine` (nullptr for lanes outside the mask), and then all of
// them go on.
using WarpOp = void (*)(void* const* slots, void* ctx);
void warp_collective(unsigned mask, int kind, void* mine, WarpOp op, void* ctx);
enum WarpKind { kSyncwarp = 1, kShuffle, kVote, kMma };

// Kernel launches: the grid runs to completion before launch() returns (every stream is
// synchronous). `body` runs the kernel once for the calling fiber.
struct LaunchConfig {
  dim3 grid, block;
  std::size_t smem;
  const void* func;
  bool ftz;  // float denormals flushed (the launching translation unit's FLASHDL_EMU_FTZ)
};
void launch(const LaunchConfig& cfg, void (*body)(void* ctx), void* ctx);

template <typename... Ps>
struct Launcher {
  void (*kernel)(Ps...);
  LaunchConfig cfg;
  template <typename... As>
  void operator()(As&&... as) const {
    std::tuple<std::decay_t<Ps>...> args(std::forward<As>(as)...);
    struct Ctx {
      void (*kernel)(Ps...);
      std::tuple<std::decay_t<Ps>...>* args;
    } ctx{kernel, &args};
    launch(
        cfg,
        [](void* c) {
          auto* x = static_cast<Ctx*>(c);
          std::apply(x->kernel, *x->args);  // every thread gets its own copy of the parameters
        },
        &ctx);
  }
};
template <typename... Ps>
Launcher<Ps...> launcher(void (*kernel)(Ps...), dim3 grid, dim3 block, std::size_t smem,
                         cudaStream_t, bool ftz) {
  return Launcher<Ps...>{kernel, LaunchConfig{grid, block, smem,
                                              reinterpret_cast<const void*>(kernel), ftz}};
}

template <typename T>
struct ShuffleSlot {
  T value;
  int src;  // lane to read
  T result;
};
template <typename T>
T shuffle(unsigned mask, T v, int src) {
  static_assert(std::is_trivially_copyable<T>::value, "shuffled values are bit copies");
  ShuffleSlot<T> slot{v, src, v};
  warp_collective(
      mask, kShuffle, &slot,
      [](void* const* s, void*) {
        for (int l = 0; l < 32; ++l) {
          if (!s[l]) continue;
          auto* me = static_cast<ShuffleSlot<T>*>(s[l]);
          const int from = me->src & 31;
          if (s[from])
            me->result = static_cast<ShuffleSlot<T>*>(s[from])->value;  // else: own value
        }
      },
      nullptr);
  return slot.result;
}

struct VoteSlot {
  int pred;
  unsigned ballot;
};
inline unsigned ballot(unsigned mask, int pred) {
  VoteSlot slot{pred != 0, 0u};
  warp_collective(
      mask, kVote, &slot,
      [](void* const* s, void*) {
        unsigned b = 0;
        for (int l = 0; l < 32; ++l)
          if (s[l] && static_cast<VoteSlot*>(s[l])->pred) b |= 1u << l;
        for (int l = 0; l < 32; ++l)
          if (s[l]) static_cast<VoteSlot*>(s[l])->ballot = b;
      },
      nullptr);
  return slot.ballot;
}

}  // namespace flashdl_emu

// Kernel launches are written FLASHDL_LAUNCH(grid, block, smem, stream, kernel)(args...) in
// flashdl's sources (kernel<<<...>>>(args...) under nvcc). FLASHDL_EMU_FTZ is read where the
// launch is written, so each translation unit's launches carry its own flag.
#ifndef FLASHDL_EMU_FTZ
#define FLASHDL_EMU_FTZ 0
#endif
#define FLASHDL_EMU_LAUNCH(grid, block, smem, stream, ...) \
  ::flashdl_emu::launcher(__VA_ARGS__, grid, block, smem, stream, FLASHDL_EMU_FTZ != 0)

// ---- device builtins -------------------------------------------------------------------------------
#define threadIdx (::flashdl_emu::thread_idx())
#define blockIdx (::flashdl_emu::block_idx())
#define blockDim (::flashdl_emu::block_dim())
#define gridDim (::flashdl_emu::grid_dim())
constexpr int warpSize = 32;

inline void __syncthreads() { ::flashdl_emu::syncthreads(); }
inline int __syncthreads_or(int pred) { return ::flashdl_emu::syncthreads_or(pred); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::flashdl_emu::warp_collective(
      mask, ::flashdl_emu::kSyncwarp, &mask, [](void* const*, void*) {}, nullptr);
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  return ::flashdl_emu::shuffle(mask, v, (lane & ~(width - 1)) + (src % width));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int src = lane ^ lane_mask;
  // A source outside the lane's segment of `width` lanes leaves the value unchanged.
  return ::flashdl_emu::shuffle(mask, v,
                                (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int src = lane + static_cast<int>(delta);
  return ::flashdl_emu::shuffle(mask, v,
                                (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : lane);
}
inline unsigned __ballot_sync(unsigned mask, int pred) { return ::flashdl_emu::ballot(mask, pred); }
inline int __all_sync(unsigned mask, int pred) {
  return ::flashdl_emu::ballot(mask, pred) == mask;  // every lane of the mask takes part
}
inline int __any_sync(unsigned mask, int pred) { return ::flashdl_emu::ballot(mask, pred) != 0; }
[[noreturn]] inline void __trap() { ::flashdl_emu::fail("__trap()"); }
inline void __threadfence() {}
inline void __threadfence_block() {}

inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline int __float_as_int(float f) {
  int x;
  std::memcpy(&x, &f, 4);
  return x;
}
inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned x;
  std::memcpy(&x, &f, 4);
  return x;
}
inline float atomicAdd(float* p, float v) {
  unsigned* u = reinterpret_cast<unsigned*>(p);
  unsigned cur = __atomic_load_n(u, __ATOMIC_RELAXED);
  for (;;) {
    const float old = __uint_as_float(cur);
    if (__atomic_compare_exchange_n(u, &cur, __float_as_uint(old + v), false, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED))
      return old;
  }
}
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
