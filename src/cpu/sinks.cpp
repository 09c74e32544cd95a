// The attention sinks' gradient, shared by every CPU schedule: the sink of head h enters row i's
// softmax as one more logit with no value, so with P_sink = exp(sink_h - lse_i) (lse includes the
// sink) and D_i = rowsum(dO_i * O_i), dSink_h = sum_i P_sink * (0 - D_i). The kernels need no
// change for dq, dk, dv: their P = exp(S - lse) already excludes the sink's share and D is theirs.
// O(batch * nheads * seqlen_q * headdim), one pass over out and dout after the kernels.
#include <cmath>

#include "backend.hpp"
#include "cpu/convert.hpp"
#include "cpu/threads.hpp"

namespace flashdl::cpu {

void sinks_backward(const Params& p) {
  const int threads = p.num_threads > 0 ? p.num_threads : num_threads();
  // One task per head, its batches and rows summed in order in double: reproducible for any
  // thread count.
  parallel_for(p.nheads, threads, [&](int64_t begin, int64_t end, int) {
    for (int64_t h = begin; h < end; ++h) {
      const double sink = static_cast<double>(p.sinks_ptr[h * p.sinks_stride]);
      double acc = 0.0;
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t i = 0; i < p.seqlen_q; ++i) {
          const double lse = static_cast<double>(
              p.lse_ptr[b * p.lse_batch_stride + h * p.lse_head_stride + i * p.lse_row_stride]);
          if (!(lse > -INFINITY)) continue;
          const int64_t o = b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
          const int64_t d = b * p.do_batch_stride + i * p.do_row_stride + h * p.do_head_stride;
          double D = 0.0;
          for (int64_t c = 0; c < p.headdim; ++c)
            D += load_as_double(p.do_ptr, p.dtype, d + c) * load_as_double(p.o_ptr, p.dtype, o + c);
          acc += std::exp(sink - lse) * D;
        }
      p.dsinks_ptr[h * p.dsinks_stride] = static_cast<float>(-acc);
    }
  });
}

}  // namespace flashdl::cpu
