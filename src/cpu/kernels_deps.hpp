// Everything the per-instruction-set kernels include, compiled for the baseline target: included by
// isa_*.cpp before they switch the target on, so no inline function or template from these
// headers is ever emitted with wider instructions (the linker keeps one copy of each, and it must
// run on any x86-64).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cpu/convert.hpp"
#include "cpu/schedules.hpp"
#include "cpu/threads.hpp"
#include "flashdl/detail/block_mask.hpp"
#include "flashdl/detail/extras.hpp"
#include "flashdl/detail/kv_cache.hpp"
#include "flashdl/detail/mask.hpp"
#include "flashdl/detail/dropout.hpp"
#include "flashdl/detail/philox.hpp"
#include "flashdl/detail/score_mod.hpp"
#include "flashdl/detail/softmax.hpp"
#include "flashdl/detail/tiles.hpp"
#include "flashdl/tensor.hpp"
