// The CUDA host emulator's own model, checked with small kernels: the wmma register layout and
// products against a plain matrix product, shuffles and votes, block barriers, cp.async landing
// only at its wait, launch-configuration errors, float16/bfloat16 rounding, and that a deadlock, a
// divergent warp collective and __trap abort the process with a message (in a child process).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>
#include <mma.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

namespace wmma = nvcuda::wmma;

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  failures += !ok;
}

// ---- wmma ------------------------------------------------------------------------------------------
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major>;
using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

void mma_kernel(const __half* a, const __half* bt, const float* c, float* d) {
  FragA fa;
  FragB fb;
  FragAcc acc;
  wmma::load_matrix_sync(fa, a, 16);
  wmma::load_matrix_sync(fb, bt, 16);  // B column-major = B^T row-major
  wmma::load_matrix_sync(acc, c, 16, wmma::mem_row_major);
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(d, acc, 16, wmma::mem_row_major);
}

// Every accumulator element's (row, col) as the PTX ISA's m16n8k16 layout gives it.
void layout_kernel(const float* codes, int* bad) {
  FragAcc f;
  wmma::load_matrix_sync(f, codes, 16, wmma::mem_row_major);
  const int l = static_cast<int>(threadIdx.x % 32), g = l / 4, t = l % 4;
  for (int i = 0; i < f.num_elements; ++i) {
    const int row = g + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * t + i % 2;
    if (f.x[i] != float(16 * row + col)) atomicAdd(bad, 1);
  }
}

void check_wmma() {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> dist(-64, 64);
  __half *a, *bt;
  float *c, *d, *codes;
  int* bad;
  cudaMalloc(reinterpret_cast<void**>(&a), 256 * sizeof(__half));
  cudaMalloc(reinterpret_cast<void**>(&bt), 256 * sizeof(__half));
  cudaMalloc(reinterpret_cast<void**>(&c), 256 * sizeof(float));
  cudaMalloc(reinterpret_cast<void**>(&d), 256 * sizeof(float));
  cudaMalloc(reinterpret_cast<void**>(&codes), 256 * sizeof(float));
  cudaMalloc(reinterpret_cast<void**>(&bad), sizeof(int));
  std::vector<float> A(256), B(256), C(256);
  for (int i = 0; i < 256; ++i) {
    A[i] = float(dist(rng)) / 16, B[i] = float(dist(rng)) / 16, C[i] = float(dist(rng));
    a[i] = __float2half_rn(A[i]);
    c[i] = C[i];
    codes[i] = float(i);
  }
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 16; ++n) bt[n * 16 + k] = __float2half_rn(B[k * 16 + n]);
  *bad = 0;
  FLASHDL_EMU_LAUNCH(1, 32, 0, nullptr, mma_kernel)(a, bt, c, d);
  bool same = cudaGetLastError() == cudaSuccess;
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      double want = C[m * 16 + n];
      for (int k = 0; k < 16; ++k) want += double(A[m * 16 + k]) * B[k * 16 + n];
      same = same && d[m * 16 + n] == float(want);  // exact: small multiples of 1/256
    }
  expect(same, "wmma: D = A B + C (A row-major, B column-major) equals the plain product");
  FLASHDL_EMU_LAUNCH(1, 64, 0, nullptr, layout_kernel)(codes, bad);
  expect(*bad == 0, "wmma: accumulator element i of lane l is the m16n8k16 layout's (row, col)");
  for (void* p : {static_cast<void*>(a), static_cast<void*>(bt), static_cast<void*>(c),
                  static_cast<void*>(d), static_cast<void*>(codes), static_cast<void*>(bad)})
    cudaFree(p);
}

// ---- warps, barriers, cp.async ------------------------------------------------------------------------
void warp_kernel(int* out) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  int sum = lane;
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  const int from7 = __shfl_sync(0xffffffffu, lane * 10, 7);
  const unsigned odd = __ballot_sync(0xffffffffu, lane % 2);
  const int all_small = __all_sync(0xffffffffu, lane < 32),
            any_big = __any_sync(0xffffffffu, lane > 30);
  out[threadIdx.x] = (sum == 496) + 2 * (from7 == 70) + 4 * (odd == 0xaaaaaaaau) + 8 * all_small +
                     16 * any_big;
}

void block_sum_kernel(const int* in, int* out) {
  unsigned char* smem = ::flashdl_emu::dynamic_smem();
  int* part = reinterpret_cast<int*>(smem);
  part[threadIdx.x] = in[threadIdx.x];
  __syncthreads();
  for (unsigned n = blockDim.x / 2; n > 0; n /= 2) {
    if (threadIdx.x < n) part[threadIdx.x] += part[threadIdx.x + n];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = part[0];
}

// __syncthreads_or over rounds: round k has thread k * 37 % 160 (k < 3) vote 1, round 3 none; a
// round's answer must not leak into the next.
void barrier_or_kernel(int* out) {
  int bits = 0;
  for (int k = 0; k < 4; ++k)
    bits |= __syncthreads_or(k < 3 && int(threadIdx.x) == k * 37 % 160) << k;
  out[blockIdx.x * blockDim.x + threadIdx.x] = bits;
}

void cp_async_kernel(const float* src, float* before, float* after) {
  unsigned char* smem = ::flashdl_emu::dynamic_smem();
  float* tile = reinterpret_cast<float*>(smem);
  __pipeline_memcpy_async(tile + 4 * threadIdx.x, src + 4 * threadIdx.x, 16);
  __pipeline_commit();
  before[threadIdx.x] = tile[4 * threadIdx.x];  // not landed yet: the 0xff fill (NaN)
  __pipeline_wait_prior(0);
  after[threadIdx.x] = tile[4 * threadIdx.x];
}

void check_threads() {
  int* out;
  cudaMalloc(reinterpret_cast<void**>(&out), 64 * sizeof(int));
  FLASHDL_EMU_LAUNCH(1, 64, 0, nullptr, warp_kernel)(out);
  bool ok = true;
  for (int i = 0; i < 64; ++i) ok = ok && out[i] == 31;
  expect(ok, "warps: xor-shuffle sum, broadcast shuffle, ballot, all, any");
  cudaFree(out);

  int *in, *sums;
  cudaMalloc(reinterpret_cast<void**>(&in), 256 * sizeof(int));
  cudaMalloc(reinterpret_cast<void**>(&sums), 3 * sizeof(int));
  for (int i = 0; i < 256; ++i) in[i] = i;
  FLASHDL_EMU_LAUNCH(3, 256, 256 * sizeof(int), nullptr, block_sum_kernel)(in, sums);
  expect(sums[0] == 32640 && sums[1] == 32640 && sums[2] == 32640,
         "__syncthreads: a shared-memory tree sum over 256 threads, 3 blocks");
  cudaFree(in);
  cudaFree(sums);

  int* ors;
  cudaMalloc(reinterpret_cast<void**>(&ors), 2 * 160 * sizeof(int));
  FLASHDL_EMU_LAUNCH(2, 160, 0, nullptr, barrier_or_kernel)(ors);
  ok = true;
  for (int i = 0; i < 2 * 160; ++i) ok = ok && ors[i] == 7;
  expect(ok, "__syncthreads_or: every thread gets the OR of its round, rounds do not mix");
  cudaFree(ors);

  float *src, *before, *after;
  cudaMalloc(reinterpret_cast<void**>(&src), 128 * sizeof(float));
  cudaMalloc(reinterpret_cast<void**>(&before), 32 * sizeof(float));
  cudaMalloc(reinterpret_cast<void**>(&after), 32 * sizeof(float));
  for (int i = 0; i < 128; ++i) src[i] = float(i);
  FLASHDL_EMU_LAUNCH(1, 32, 128 * sizeof(float), nullptr, cp_async_kernel)(src, before, after);
  bool landed = true, early = true;
  for (int i = 0; i < 32; ++i) {
    landed = landed && after[i] == float(4 * i);
    early = early && std::isnan(before[i]);
  }
  expect(early && landed, "cp.async: old contents before __pipeline_wait_prior, the copy after");
  cudaFree(src);
  cudaFree(before);
  cudaFree(after);
}

// ---- launches -----------------------------------------------------------------------------------------
void empty_kernel() {}

void check_launches() {
  cudaGetLastError();
  FLASHDL_EMU_LAUNCH(1, 1025, 0, nullptr, empty_kernel)();
  expect(cudaGetLastError() == cudaErrorInvalidConfiguration, "launch: 1025 threads refused");
  FLASHDL_EMU_LAUNCH(dim3(1, 65536), 32, 0, nullptr, empty_kernel)();
  expect(cudaGetLastError() == cudaErrorInvalidConfiguration, "launch: grid.y 65536 refused");
  FLASHDL_EMU_LAUNCH(1, 32, 64 * 1024, nullptr, empty_kernel)();
  expect(cudaGetLastError() == cudaErrorInvalidValue,
         "launch: 64 KiB of shared memory refused without cudaFuncSetAttribute");
  cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024);
  FLASHDL_EMU_LAUNCH(1, 32, 64 * 1024, nullptr, empty_kernel)();
  expect(cudaGetLastError() == cudaSuccess, "launch: 64 KiB accepted after cudaFuncSetAttribute");
}

// ---- conversions -------------------------------------------------------------------------------------
void check_conversions() {
  // float16: every value exactly halfway between two neighbours rounds to the even one; overflow
  // to inf; subnormals.
  bool ok = true;
  for (unsigned h = 0; h < 0x7c00u; ++h) {  // finite non-negative halves
    const float x = __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
    ok = ok && __half_as_ushort(__float2half_rn(x)) == h;
    if (h + 1 < 0x7c00u) {
      const float y = __half2float(__ushort_as_half(static_cast<unsigned short>(h + 1)));
      const unsigned mid = __half_as_ushort(__float2half_rn(0.5f * (x + y)));
      ok = ok && mid == (h % 2 == 0 ? h : h + 1);
    }
  }
  ok = ok && __half_as_ushort(__float2half_rn(65520.0f)) == 0x7c00u &&
       __half_as_ushort(__float2half_rn(65519.0f)) == 0x7bffu &&
       __half2float(__ushort_as_half(1)) == std::ldexp(1.0f, -24);
  expect(ok, "float16: round trip of every finite value, ties to even, overflow, subnormals");
  bool bok = true;
  for (unsigned b = 0; b < 0x7f80u; b += 7) {
    const float x = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(b)));
    const float y = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(b + 1)));
    bok = bok && __bfloat16_as_ushort(__float2bfloat16_rn(x)) == b &&
          __bfloat16_as_ushort(__float2bfloat16_rn(x + 0.5f * (y - x))) == (b % 2 == 0 ? b : b + 1);
  }
  expect(bok, "bfloat16: round trip and ties to even");
}

// ---- float modes --------------------------------------------------------------------------------------
// out[0] = a denormal product, out[1] = a denormal input times 1 (read from memory: not folded).
void float_modes_kernel(const float* in, float* out) {
  out[0] = in[0] * in[1];
  out[1] = in[2] * in[3];
}

void check_float_modes() {
  float *in, *plain, *flushed;
  cudaMalloc(reinterpret_cast<void**>(&in), 4 * sizeof(float));
  cudaMalloc(reinterpret_cast<void**>(&plain), 2 * sizeof(float));
  cudaMalloc(reinterpret_cast<void**>(&flushed), 2 * sizeof(float));
  in[0] = in[1] = std::ldexp(1.0f, -70);
  in[2] = std::ldexp(1.0f, -130);
  in[3] = 1.0f;
  FLASHDL_EMU_LAUNCH(1, 1, 0, nullptr, float_modes_kernel)(in, plain);
  // As in a translation unit compiled with FLASHDL_EMU_FTZ=1 (nvcc's -ftz=true).
#undef FLASHDL_EMU_FTZ
#define FLASHDL_EMU_FTZ 1
  FLASHDL_EMU_LAUNCH(1, 1, 0, nullptr, float_modes_kernel)(in, flushed);
#undef FLASHDL_EMU_FTZ
#define FLASHDL_EMU_FTZ 0
  const volatile float a = in[0], b = in[1];
  const float host = a * b;
  expect(plain[0] == std::ldexp(1.0f, -140) && plain[1] == std::ldexp(1.0f, -130),
         "float modes: a plain launch keeps denormal results and inputs");
#if defined(__SSE2__)
  expect(flushed[0] == 0.0f && flushed[1] == 0.0f,
         "float modes: an FLASHDL_EMU_FTZ launch flushes denormal results and inputs to 0");
#endif
  expect(host == std::ldexp(1.0f, -140), "float modes: the caller's own modes after the launch");
  cudaFree(in);
  cudaFree(plain);
  cudaFree(flushed);
}

// ---- what aborts --------------------------------------------------------------------------------------
void divergent_barrier_kernel() {
  if (threadIdx.x < 32) __syncthreads();  // warp 1 exits; warp 0 waits at a barrier... (allowed)
  if (threadIdx.x < 16) __syncwarp();     // lanes 16-31 exited: the collective cannot complete
}
void divergent_collective_kernel() {
  if (threadIdx.x % 2) {
    __syncwarp();
  } else {
    (void)__shfl_xor_sync(0xffffffffu, 1, 1);
  }
}
void trap_kernel() {
  if (threadIdx.x == 5) __trap();
}
void read_kernel(const float* p, std::size_t i, float* sink) { *sink = p[i]; }

// How body, run in a child process (stderr silenced), ended it: waitpid's status.
int child_status(const std::function<void()>& body) {
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    std::freopen("/dev/null", "w", stderr);
    body();
    std::_Exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

// Whether body ends the process by a signal or a non-zero exit (a sanitizer's report).
bool dies(const std::function<void()>& body) {
  const int status = child_status(body);
  return WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0);
}

bool aborts(const std::function<void()>& body) {
  const int status = child_status(body);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

void check_aborts() {
  expect(aborts([] { FLASHDL_EMU_LAUNCH(1, 64, 0, nullptr, divergent_barrier_kernel)(); }),
         "abort: a warp collective that lanes which exited never reach (deadlock)");
  expect(aborts([] { FLASHDL_EMU_LAUNCH(1, 32, 0, nullptr, divergent_collective_kernel)(); }),
         "abort: lanes of a warp at different collectives");
  expect(aborts([] { FLASHDL_EMU_LAUNCH(1, 32, 0, nullptr, trap_kernel)(); }), "abort: __trap()");
  expect(!aborts([] { FLASHDL_EMU_LAUNCH(1, 32, 0, nullptr, empty_kernel)(); }),
         "no abort: an empty kernel");
  // Past the end of an allocation: exactly (AddressSanitizer), else beyond the guard page.
#if defined(__SANITIZE_ADDRESS__)
  const std::size_t past = 1000;  // one float past 1000
  const char* how =
      "abort: a kernel reading one float past a cudaMalloc allocation (AddressSanitizer)";
#else
  const std::size_t past = 1000 + 256;  // 1 KiB past the end: within the guard page
  const char* how = "abort: a kernel reading past a cudaMalloc allocation's guard page";
#endif
  float *p, *sink;
  cudaMalloc(reinterpret_cast<void**>(&p), 1000 * sizeof(float));
  cudaMalloc(reinterpret_cast<void**>(&sink), sizeof(float));
  expect(!dies(
             [&] { FLASHDL_EMU_LAUNCH(1, 1, 0, nullptr, read_kernel)(p, std::size_t(999), sink); }),
         "no abort: a kernel reading the last float of an allocation");
  expect(dies([&] { FLASHDL_EMU_LAUNCH(1, 1, 0, nullptr, read_kernel)(p, past, sink); }), how);
  cudaFree(p);
  cudaFree(sink);
}

}  // namespace

int main() {
  check_wmma();
  check_threads();
  check_launches();
  check_conversions();
  check_float_modes();
  check_aborts();
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
