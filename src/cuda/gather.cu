// The gather of a paged (or seqused_k) varlen call on CUDA, the device half of src/varlen.cpp's
// gather_paged (which checks the tables on the host, as for the CPU): the page ids each sequence
// reads and the gathered offsets copied in one piece to a stream-ordered device buffer, then one
// launch copies every used key and value row into contiguous stream-ordered buffers, which the
// contiguous varlen forward then reads. All on the caller's stream; nothing is synchronised.
// Memory: the gathered k and v, 2 * (sum of the keys the sequences use) * nheads_kv * headdim
// elements, plus 4 * (batch + 1 + batch * pages) bytes of tables, for the length of the call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "backend.hpp"
#include "check.hpp"
#include "flashdl/detail/tiles.hpp"

namespace flashdl::cuda {
namespace gather {  // named, not anonymous: the ptxas report (tools/kernel_report.sh) names it

constexpr int kThreads = 256;

// Strides and lengths in units of the copy (U below), k at [0] and v at [1].
struct GatherArgs {
  const unsigned char* src[2];
  unsigned char* dst[2];
  int64_t page_stride[2], row_stride[2], head_stride[2];
  const int32_t* cu_k;   // (batch + 1,) gathered offsets, device
  const int32_t* table;  // (batch, pages) page ids, or (batch,) first rows, device
  int64_t batch, page_size, pages, nheads_kv, row_units, total;
};

// One thread per unit U of a head row of the gathered keys (blockIdx.y 0) or values (1): the
// sequence of the row by binary search over cu_k, then its page (or first row) from the table.
template <typename U>
__global__ void __launch_bounds__(kThreads) gather_kernel(const __grid_constant__ GatherArgs a) {
  const int which = static_cast<int>(blockIdx.y);
  const U* src = reinterpret_cast<const U*>(a.src[which]);
  U* dst = reinterpret_cast<U*>(a.dst[which]);
  const int64_t per_row = a.nheads_kv * a.row_units, units = a.total * per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < units;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = i / per_row, rest = i - row * per_row;
    const int64_t h = rest / a.row_units, c = rest - h * a.row_units;
    int64_t lo = 0, hi = a.batch;  // cu_k[lo] <= row < cu_k[hi]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (a.cu_k[mid] <= row)
        lo = mid;
      else
        hi = mid;
    }
    const int64_t j = row - a.cu_k[lo];
    const int64_t from = a.page_size > 0
                             ? a.table[lo * a.pages + j / a.page_size] * a.page_stride[which] +
                                   (j % a.page_size) * a.row_stride[which]
                             : (a.table[lo] + j) * a.row_stride[which];
    dst[i] = src[from + h * a.head_stride[which] + c];
  }
}

// The device tables and the gathered buffers; release() frees them behind the queued work.
class Gathered final : public GatheredKv {
 public:
  std::unique_ptr<StreamWorkspace> tables, kbuf, vbuf;
  void release() override {
    if (kbuf) kbuf->release();
    if (vbuf) vbuf->release();
    if (tables) tables->release();
  }
};

template <typename U>
void launch(const GatherArgs& a, int64_t units, cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>(detail::ceil_div(units, kThreads), 1 << 20);
  FLASHDL_LAUNCH(dim3(static_cast<unsigned>(blocks), 2), kThreads, 0, stream, gather_kernel<U>)(a);
  FLASHDL_CUDA_CHECK_LAUNCH("paged varlen gather kernel launch");
}

}  // namespace gather

std::unique_ptr<GatheredKv> gather_kv(const KvGather& g) {
  using gather::Gathered;
  DeviceGuard guard(g.k.device.id);
  const auto stream = static_cast<cudaStream_t>(g.stream);
  const int hd = g.k.rank - 1;  // the headdim axis
  const int64_t hk = g.k.shape[hd - 1], d = g.k.shape[hd];
  const auto es = static_cast<int64_t>(dtype_size(g.k.dtype));
  const auto batch = static_cast<int64_t>(g.cu_k.size()) - 1;
  const int64_t total = g.cu_k.back();
  auto out = std::make_unique<Gathered>();
  // At least 16 bytes: a call with no keys still gets buffers to point its views at.
  const auto bytes = static_cast<std::size_t>(std::max<int64_t>(total * hk * d * es, 16));
  out->kbuf = std::make_unique<StreamWorkspace>(bytes, stream);
  out->vbuf = std::make_unique<StreamWorkspace>(bytes, stream);
  out->k = out->kbuf->get<void>();
  out->v = out->vbuf->get<void>();
  if (total * hk * d == 0) return out;

  // cu_k then the table, one copy (from pageable memory it waits for the stream's earlier work).
  std::vector<int32_t> host(g.cu_k);
  host.insert(host.end(), g.table.begin(), g.table.end());
  out->tables = std::make_unique<StreamWorkspace>(host.size() * sizeof(int32_t), stream);
  int32_t* dev = out->tables->get<int32_t>();
  FLASHDL_CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), host.size() * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, stream));

  // 16-byte units where every row start is 16-byte aligned, else 2-byte units (1-byte for an odd
  // element size).
  auto aligned = [&](const TensorView& t, int64_t unit) {
    if (reinterpret_cast<std::uintptr_t>(t.data) % static_cast<std::uintptr_t>(unit) != 0)
      return false;
    for (int i = 0; i < hd; ++i)
      if (t.strides[i] * es % unit != 0) return false;
    return d * es % unit == 0;
  };
  const int64_t unit = aligned(g.k, 16) && aligned(g.v, 16) ? 16 : es % 2 == 0 ? 2 : 1;
  gather::GatherArgs a{};
  const TensorView* src[2] = {&g.k, &g.v};
  for (int w = 0; w < 2; ++w) {
    a.src[w] = static_cast<const unsigned char*>(src[w]->data);
    a.page_stride[w] = g.page_size > 0 ? src[w]->strides[0] * es / unit : 0;
    a.row_stride[w] = src[w]->strides[hd - 2] * es / unit;
    a.head_stride[w] = src[w]->strides[hd - 1] * es / unit;
  }
  a.dst[0] = out->kbuf->get<unsigned char>();
  a.dst[1] = out->vbuf->get<unsigned char>();
  a.cu_k = dev;
  a.table = dev + batch + 1;
  a.batch = batch;
  a.page_size = g.page_size;
  a.pages = g.pages;
  a.nheads_kv = hk;
  a.row_units = d * es / unit;
  a.total = total;
  const int64_t units = total * hk * a.row_units;
  if (unit == 16)
    gather::launch<uint4>(a, units, stream);
  else if (unit == 2)
    gather::launch<uint16_t>(a, units, stream);
  else
    gather::launch<unsigned char>(a, units, stream);
  return out;
}

}  // namespace flashdl::cuda
