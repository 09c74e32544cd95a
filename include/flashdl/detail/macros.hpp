// Qualifiers for the math shared by the CPU and the CUDA code.
#pragma once

#if defined(__CUDACC__)
#define FLASHDL_HD __host__ __device__ __forceinline__
#else
#define FLASHDL_HD inline
#endif
