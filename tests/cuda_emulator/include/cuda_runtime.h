// flashdl CUDA host emulator: the CUDA runtime and device builtins (flashdl_emu/runtime.hpp).
#pragma once
#include "flashdl_emu/runtime.hpp"
