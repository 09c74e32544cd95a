// The paged (or seqused_k) form of forward_varlen: checks of the tables, then the gather (by
// memcpy over the threads on the CPU, by the CUDA backend's gather kernel for CUDA arrays).
#include "varlen_paged.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>

#include "checks.hpp"
#include "cpu/threads.hpp"

namespace flashdl {

using namespace validate;

namespace {

// The (total, nheads_kv, headdim) contiguous view of a gathered buffer.
TensorView gathered_view(const TensorView& src, void* data, int64_t total, int64_t hk, int64_t d) {
  TensorView t = src;
  t.data = data;
  t.rank = 3;
  t.shape = {total, hk, d, 0};
  t.strides = {hk * d, d, 1, 0};
  return t;
}

}  // namespace

// The paged (or seqused_k) form of forward_varlen, checked and gathered: by memcpy on the CPU,
// by the CUDA backend's gather kernel (src/cuda/gather.cu) on the call's stream for CUDA arrays,
// after the same checks of the same host tables. Returns false for validate_only (the layout
// checked, nothing read).
bool gather_paged(const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                  const TensorView& out, const TensorView& lse, const PagedKv& pk,
                  const Options& options, Gathered& g) {
  const bool paged = pk.block_table.defined();
  check_rank("q", q, 3, "(total_q, nheads, headdim)");
  check_rank("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)");
  if (cu_seqlens_q.shape[0] < 1)
    fail(ErrorKind::value,
         "cu_seqlens_q: expected shape (batch + 1,) with cu[0] == 0, got an "
         "empty array");
  const int64_t batch = cu_seqlens_q.shape[0] - 1;
  const char* klay = paged ? "(num_pages, page_size, nheads_kv, headdim) (paged)"
                           : "(total_k, nheads_kv, headdim)";
  check_rank("k", k, paged ? 4 : 3, klay);
  check_rank("v", v, paged ? 4 : 3, klay);
  if (paged)
    check_shape("v", v, {k.shape[0], k.shape[1], k.shape[2], k.shape[3]}, "(the shape of k)");
  else
    check_shape("v", v, {k.shape[0], k.shape[1], k.shape[2]}, "(the shape of k)");
  check_storage("k", k, q.dtype, "the dtype of q", q.device);
  check_storage("v", v, q.dtype, "the dtype of q", q.device);
  const int hd = paged ? 3 : 2;  // the headdim axis
  if (k.shape[hd] != q.shape[2])
    fail(ErrorKind::value, "k: headdim " + std::to_string(k.shape[hd]) +
                               " does not match the headdim of q, " + std::to_string(q.shape[2]));
  for (auto [name, t] : {NamedView{"k", &k}, {"v", &v}}) {
    check_no_overlap("out", out, name, *t);
    check_no_overlap("lse", lse, name, *t);
  }
  int64_t page_size = 0, max_pages = 0;
  if (paged) {
    check_host_int32("block_table", pk.block_table, 2, "(batch, max_pages_per_sequence)");
    if (pk.block_table.shape[0] != batch)
      fail(ErrorKind::value, "block_table: expected " + std::to_string(batch) +
                                 " rows (the batch of cu_seqlens_q), got shape " +
                                 shape_str(pk.block_table));
    page_size = k.shape[1];
    max_pages = pk.block_table.shape[1];
    if (page_size < 1)
      fail(ErrorKind::value, "k: expected pages of at least one row, got shape " + shape_str(k));
  }
  if (pk.seqused_k.defined()) {
    check_host_int32("seqused_k", pk.seqused_k, 1, "(batch,)");
    check_shape("seqused_k", pk.seqused_k, {batch}, "(batch,): the keys each sequence uses");
  }
  check_host_int32("cu_seqlens_k", cu_seqlens_k, 1, "(batch + 1,)");
  check_shape("cu_seqlens_k", cu_seqlens_k, {batch + 1}, "(batch + 1, as cu_seqlens_q)");
  // The gathered offsets are a host array, and cu_seqlens_q must sit with them (for CUDA q too).
  if (cu_seqlens_q.device.type != DeviceType::cpu)
    fail(ErrorKind::value, "cu_seqlens_q: expected an array on the CPU (host memory) with " +
                               std::string(paged ? "block_table" : "seqused_k") + ", got " +
                               device_name(cu_seqlens_q.device.type) + ":" +
                               std::to_string(cu_seqlens_q.device.id));
  if (options.validate_only) return false;

  // Keys of each sequence: its length in cu_seqlens_k, or seqused_k.
  std::vector<int64_t> keys(static_cast<size_t>(batch));
  if (host_int32(cu_seqlens_k, 0) != 0)
    fail(ErrorKind::value, "cu_seqlens_k: expected cu_seqlens_k[0] == 0, got " +
                               std::to_string(host_int32(cu_seqlens_k, 0)));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = host_int32(cu_seqlens_k, b + 1) - host_int32(cu_seqlens_k, b);
    if (len < 0)
      fail(ErrorKind::value, "cu_seqlens_k: expected non-decreasing offsets, got cu_seqlens_k[" +
                                 std::to_string(b + 1) + "] < cu_seqlens_k[" + std::to_string(b) +
                                 "]");
    keys[b] = len;
    if (pk.seqused_k.defined()) {
      const int64_t used = host_int32(pk.seqused_k, b);
      if (used < 0 || used > len)
        fail(ErrorKind::value, "seqused_k: expected 0 <= seqused_k[" + std::to_string(b) +
                                   "] <= " + std::to_string(len) + " (the length of sequence " +
                                   std::to_string(b) + " in cu_seqlens_k), got " +
                                   std::to_string(used));
      keys[b] = used;
    }
    if (paged) {
      if (keys[b] > max_pages * page_size)
        fail(ErrorKind::value, "block_table: sequence " + std::to_string(b) + " has " +
                                   std::to_string(keys[b]) + " keys, more than its " +
                                   std::to_string(max_pages) + " pages of " +
                                   std::to_string(page_size) + " rows hold");
      for (int64_t page = 0; page * page_size < keys[b]; ++page) {
        const int64_t id = host_int32(pk.block_table, b, page);
        if (id < 0 || id >= k.shape[0])
          fail(ErrorKind::value, "block_table: block_table[" + std::to_string(b) + ", " +
                                     std::to_string(page) + "] = " + std::to_string(id) +
                                     " is not a page of k (0.." + std::to_string(k.shape[0] - 1) +
                                     ")");
      }
    } else if (host_int32(cu_seqlens_k, b) + keys[b] > k.shape[0]) {
      fail(ErrorKind::value, "cu_seqlens_k: sequence " + std::to_string(b) + " ends past the " +
                                 std::to_string(k.shape[0]) + " rows of k");
    }
  }

  // Gather run by run: the longest stretch of keys contiguous in memory (within a page, or a
  // sequence's rows) whose rows are whole (heads adjacent) is one copy, else a copy per (key,
  // head); the copies are spread over the threads. (A copy per (key, head) on one thread made the
  // gather 10% of a 256-row chunk over 16k keys.)
  const int64_t hk = k.shape[hd - 1], d = q.shape[2];
  const auto es = static_cast<int64_t>(dtype_size(q.dtype));
  g.cu_k.assign(static_cast<size_t>(batch + 1), 0);
  for (int64_t b = 0; b < batch; ++b) g.cu_k[b + 1] = static_cast<int32_t>(g.cu_k[b] + keys[b]);
  const int64_t total = g.cu_k[batch];
  g.cut = cu_seqlens_k;
  g.cut.data = g.cu_k.data();
  g.cut.strides = {1, 0, 0, 0};
  if (q.device.type != DeviceType::cpu) {
    // CUDA: the pages each sequence reads (or its first row) to the backend, which gathers on
    // the device, on the call's stream.
    KvGather kg;
    kg.k = k;
    kg.v = v;
    kg.stream = options.stream;
    kg.cu_k = g.cu_k;
    if (paged) {
      kg.page_size = page_size;
      for (int64_t b = 0; b < batch; ++b)
        kg.pages = std::max(kg.pages, (keys[b] + page_size - 1) / page_size);
      kg.table.assign(static_cast<size_t>(batch * kg.pages), 0);
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t page = 0; page * page_size < keys[b]; ++page)
          kg.table[b * kg.pages + page] = static_cast<int32_t>(host_int32(pk.block_table, b, page));
    } else {
      for (int64_t b = 0; b < batch; ++b)
        kg.table.push_back(static_cast<int32_t>(host_int32(cu_seqlens_k, b)));
    }
    g.device = cuda::gather_kv(kg);
    g.kt = gathered_view(k, g.device->k, total, hk, d);
    g.vt = gathered_view(v, g.device->v, total, hk, d);
    return true;
  }
  const int threads = options.num_threads > 0 ? options.num_threads : cpu::num_threads();
  struct Copy {
    int64_t dst, src, bytes;  // byte offsets into the buffer and the source
  };
  for (auto [src, buf, view] : {std::tuple{&k, &g.k, &g.kt}, {&v, &g.v, &g.vt}}) {
    buf->reset(new unsigned char[static_cast<size_t>(std::max<int64_t>(total * hk * d * es, es))]);
    const auto* from = static_cast<const char*>(src->data);
    char* to = reinterpret_cast<char*>(buf->get());
    const int64_t row_stride = src->strides[hd - 2], head_stride = src->strides[hd - 1];
    const bool whole_rows = hk == 1 || head_stride == d;
    const bool runs = whole_rows && row_stride == hk * d;
    std::vector<Copy> copies;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < keys[b];) {
        int64_t off = 0, run = 1;
        if (paged) {
          const int64_t page = host_int32(pk.block_table, b, j / page_size);
          off = page * src->strides[0] + (j % page_size) * row_stride;
          if (runs) run = std::min(keys[b] - j, page_size - j % page_size);
        } else {
          off = (host_int32(cu_seqlens_k, b) + j) * row_stride;
          if (runs) run = keys[b] - j;
        }
        const int64_t dst = (g.cu_k[b] + j) * hk * d * es;
        if (whole_rows)  // run rows (run is 1 unless rows are adjacent too)
          copies.push_back({dst, off * es, run * hk * d * es});
        else
          for (int64_t h = 0; h < hk; ++h)
            copies.push_back({dst + h * d * es, (off + h * head_stride) * es, d * es});
        j += run;
      }
    cpu::parallel_for(static_cast<int64_t>(copies.size()), threads,
                      [&](int64_t begin, int64_t end, int) {
                        for (int64_t c = begin; c < end; ++c)
                          std::memcpy(to + copies[c].dst, from + copies[c].src,
                                      static_cast<size_t>(copies[c].bytes));
                      });
    *view = gathered_view(*src, buf->get(), total, hk, d);
  }
  return true;
}

}  // namespace flashdl
