// The interface api.cpp dispatches to. Each backend receives a validated Params and trusts it.
#pragma once

#include <string>

#include "flashdl/params.hpp"

namespace flashdl {

namespace cpu {
void forward(const Params& params);
void backward(const Params& params);
std::string isa_name();       // the vector kernels picked at run time
int num_threads();            // threads the next call uses
void set_num_threads(int n);  // 0: default
int64_t default_sram_bytes(); // fa1 on-chip budget M: the per-core L2 cache
}  // namespace cpu

namespace cuda {
bool compiled();                    // false in a build without the CUDA backend
std::string architectures();        // the CUDA_ARCHITECTURES compiled in
int device_count(std::string* status);  // never throws; status says why 0
void forward(const Params& params);
void backward(const Params& params);
}  // namespace cuda

}  // namespace flashdl
