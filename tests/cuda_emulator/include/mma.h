// flashdl CUDA host emulator: nvcuda::wmma (flashdl_emu/wmma.hpp).
#pragma once
#include "flashdl_emu/wmma.hpp"
