// flashdl CUDA host emulator: cp.async primitives (flashdl_emu/pipeline.hpp).
#pragma once
#include "flashdl_emu/pipeline.hpp"
