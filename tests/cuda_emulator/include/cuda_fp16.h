// flashdl CUDA host emulator: float16 and bfloat16 (flashdl_emu/half.hpp).
#pragma once
#include "flashdl_emu/half.hpp"
