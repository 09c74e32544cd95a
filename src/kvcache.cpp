// Attention over a KV cache (flash-attn's flash_attn_with_kvcache): validated whole, then the new
// keys and values are appended to the cache (the one place flashdl writes a caller's array, and
// only after every check has passed), then one forward call reads the cache through
// Params.seqused_k (and Params.block_table when it is paged). The append and the attention are
// the backend's (cpu::forward_kvcache, cuda::forward_kvcache on the device).
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "backend.hpp"
#include "dispatch.hpp"
#include "fill_params.hpp"
#include "flashdl/api.hpp"
#include "rotary.hpp"
#include "validate.hpp"

namespace flashdl {

namespace {

using namespace validate;

struct Cache {
  bool paged = false;
  int64_t capacity = 0;   // keys a sequence can hold
  int64_t page_size = 0;  // paged: rows per page
  int64_t num_pages = 0;  // paged: pages in the cache
  int64_t seqlen_new = 0;
  std::vector<int32_t> used;     // cache positions per sequence after the append (end of keys)
  std::vector<int32_t> visible;  // keys the kernel sees: used - leftpad (Params.seqused_k)
  std::vector<int32_t> batch_idx, leftpad;  // copies of the host arrays (empty: not given)
  std::vector<int32_t> seqlens;             // cache_seqlens, read
};

std::string at(const char* name, int64_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

void check_no_collision(const Cache& c, const TensorView& block_table);

// The layout checks of the cache and the new keys, the lengths and the page table; returns the
// cache's geometry and the per-sequence key counts after the append.
Cache check_cache(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                  const TensorView& cache_seqlens, const TensorView& k_new, const TensorView& v_new,
                  const TensorView& block_table, const KvCacheExtras& x) {
  check_rank("q", q, 4, "(batch, seqlen_q, nheads, headdim)");
  const int64_t batch = q.shape[0];
  Cache c;
  c.paged = block_table.defined();
  const char* clay = c.paged ? "(num_pages, page_size, nheads_kv, headdim) (paged)"
                             : "(batch, seqlen_cache, nheads_kv, headdim)";
  check_rank("k_cache", k_cache, 4, clay);
  check_rank("v_cache", v_cache, 4, clay);
  check_shape("v_cache", v_cache,
              {k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]},
              "(the shape of k_cache)");
  if (c.paged) {
    check_host_int32("block_table", block_table, 2, "(batch, max_pages_per_sequence)");
    check_last_dim_contiguous("block_table", block_table);
    if (block_table.shape[0] != batch)
      fail(ErrorKind::value, "block_table: expected " + std::to_string(batch) +
                                 " rows (the batch of q), got shape " + shape_str(block_table));
    c.num_pages = k_cache.shape[0];
    c.page_size = k_cache.shape[1];
    if (c.page_size < 1)
      fail(ErrorKind::value,
           "k_cache: expected pages of at least one row, got shape " + shape_str(k_cache));
    c.capacity = block_table.shape[1] * c.page_size;
  } else if (x.cache_batch_idx.defined()) {
    check_host_int32("cache_batch_idx", x.cache_batch_idx, 1, "(batch,)");
    check_shape("cache_batch_idx", x.cache_batch_idx, {batch},
                "(batch,): the cache row of each sequence");
    c.capacity = k_cache.shape[1];
  } else {
    // Sequence b reads (and appends to) cache row b, as flash-attn without cache_batch_idx: a
    // cache preallocated for a larger batch is fine, its rows from the batch of q on untouched.
    if (k_cache.shape[0] < batch)
      fail(ErrorKind::value, "k_cache: " + std::to_string(k_cache.shape[0]) +
                                 " cache rows for the batch of q, " + std::to_string(batch) +
                                 "; expected at least one row per sequence (a paged cache "
                                 "needs block_table; other rows, cache_batch_idx)");
    c.capacity = k_cache.shape[1];
  }
  if (c.paged && x.cache_batch_idx.defined())
    fail(ErrorKind::value,
         "cache_batch_idx: not supported with a paged cache (block_table "
         "already names each sequence's pages); expected None");

  // What the core's checks would report under the names k and v, named as this call's arguments.
  if (k_cache.shape[3] != q.shape[3])
    fail(ErrorKind::value, "k_cache: headdim " + std::to_string(k_cache.shape[3]) +
                               " does not match the headdim of q, " + std::to_string(q.shape[3]));
  const int64_t hk = k_cache.shape[2];
  if (hk == 0 ? q.shape[2] != 0 : q.shape[2] % hk != 0)
    fail(ErrorKind::value, "k_cache: nheads_kv " + std::to_string(hk) +
                               " must divide nheads of q, " + std::to_string(q.shape[2]));
  check_storage("k_cache", k_cache, q.dtype, "the dtype of q", q.device);
  check_storage("v_cache", v_cache, q.dtype, "the dtype of q", q.device);

  if (k_new.defined() != v_new.defined())
    fail(ErrorKind::value, std::string(k_new.defined() ? "v" : "k") +
                               ": expected both k and v (the new keys and values) or neither");
  if (k_new.defined()) {
    const char* nlay = "(batch, seqlen_new, nheads_kv, headdim)";
    check_rank("k", k_new, 4, nlay);
    check_rank("v", v_new, 4, nlay);
    check_shape("k", k_new, {batch, k_new.shape[1], k_cache.shape[2], k_cache.shape[3]},
                "(batch of q, seqlen_new, nheads_kv and headdim of k_cache)");
    check_shape("v", v_new, {batch, k_new.shape[1], k_cache.shape[2], k_cache.shape[3]},
                "(the shape of k)");
    check_storage("k", k_new, k_cache.dtype, "the dtype of k_cache", q.device);
    check_storage("v", v_new, k_cache.dtype, "the dtype of k_cache", q.device);
    c.seqlen_new = k_new.shape[1];
  }

  check_host_int32("cache_seqlens", cache_seqlens, 1, "(batch,)");
  check_shape("cache_seqlens", cache_seqlens, {batch}, "(batch,): tokens in each sequence's cache");
  if (x.cache_leftpad.defined()) {
    check_host_int32("cache_leftpad", x.cache_leftpad, 1, "(batch,)");
    check_shape("cache_leftpad", x.cache_leftpad, {batch},
                "(batch,): the first visible cache position of each sequence");
  }
  c.used.resize(static_cast<size_t>(batch));
  c.seqlens.resize(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = host_int32(cache_seqlens, b);
    c.seqlens[b] = static_cast<int32_t>(len);
    if (len < 0)
      fail(ErrorKind::value, "cache_seqlens: expected lengths >= 0, got " + at("cache_seqlens", b) +
                                 " = " + std::to_string(len));
    if (len + c.seqlen_new > c.capacity)
      fail(ErrorKind::value,
           "cache_seqlens: " + at("cache_seqlens", b) + " = " + std::to_string(len) +
               (c.seqlen_new ? " plus " + std::to_string(c.seqlen_new) + " new tokens" : "") +
               " exceeds the cache's capacity of " + std::to_string(c.capacity) +
               (c.paged ? " (the pages of block_table: max_pages_per_sequence x page_size)"
                        : " (seqlen_cache)") +
               "; nothing was written");
    c.used[b] = static_cast<int32_t>(len + c.seqlen_new);
    if (x.cache_leftpad.defined()) {
      const int64_t pad = host_int32(x.cache_leftpad, b);
      if (pad < 0 || pad > len)
        fail(ErrorKind::value, "cache_leftpad: expected 0 <= " + at("cache_leftpad", b) +
                                   " <= cache_seqlens[" + std::to_string(b) +
                                   "] = " + std::to_string(len) + ", got " + std::to_string(pad) +
                                   "; nothing was written");
      c.leftpad.push_back(static_cast<int32_t>(pad));
    }
    if (x.cache_batch_idx.defined()) {
      const int64_t row = host_int32(x.cache_batch_idx, b);
      if (row < 0 || row >= k_cache.shape[0])
        fail(ErrorKind::value, "cache_batch_idx: " + at("cache_batch_idx", b) + " = " +
                                   std::to_string(row) + " is not a row of k_cache (0.." +
                                   std::to_string(k_cache.shape[0] - 1) + "); nothing was written");
      c.batch_idx.push_back(static_cast<int32_t>(row));
    }
    if (!c.paged) continue;
    for (int64_t page = 0; page * c.page_size < c.used[b]; ++page) {
      const int64_t id = host_int32(block_table, b, page);
      if (id < 0 || id >= c.num_pages)
        fail(ErrorKind::value, "block_table: block_table[" + std::to_string(b) + ", " +
                                   std::to_string(page) + "] = " + std::to_string(id) +
                                   " is not a page of k_cache (0.." +
                                   std::to_string(c.num_pages - 1) + "); nothing was written");
    }
  }
  c.visible = c.used;
  for (size_t b = 0; b < c.leftpad.size(); ++b) c.visible[b] -= c.leftpad[b];
  check_no_collision(c, block_table);
  return c;
}

// Two sequences appending to one cache slot would leave it holding whichever was written last:
// refused, before anything is written (duplicate cache_batch_idx entries, or pages of
// block_table shared where both sequences append).
void check_no_collision(const Cache& c, const TensorView& block_table) {
  if (c.seqlen_new == 0) return;
  if (!c.batch_idx.empty()) {
    std::vector<std::pair<int32_t, size_t>> rows;
    for (size_t b = 0; b < c.batch_idx.size(); ++b) rows.emplace_back(c.batch_idx[b], b);
    std::sort(rows.begin(), rows.end());
    for (size_t i = 1; i < rows.size(); ++i)
      if (rows[i].first == rows[i - 1].first)
        fail(ErrorKind::value,
             "cache_batch_idx: " + at("cache_batch_idx", static_cast<int64_t>(rows[i - 1].second)) +
                 " and " + at("cache_batch_idx", static_cast<int64_t>(rows[i].second)) +
                 " are both " + std::to_string(rows[i].first) +
                 ", and both sequences append k and v to that cache row; expected distinct "
                 "rows; nothing was written");
  }
  if (!c.paged) return;
  // (page, row in page, sequence) of every slot written.
  std::vector<std::array<int64_t, 3>> slots;
  for (size_t b = 0; b < c.used.size(); ++b)
    for (int64_t pos = c.used[b] - c.seqlen_new; pos < c.used[b]; ++pos)
      slots.push_back({host_int32(block_table, static_cast<int64_t>(b), pos / c.page_size),
                       pos % c.page_size, static_cast<int64_t>(b)});
  std::sort(slots.begin(), slots.end());
  for (size_t i = 1; i < slots.size(); ++i)
    if (slots[i][0] == slots[i - 1][0] && slots[i][1] == slots[i - 1][1])
      fail(ErrorKind::value, "block_table: sequences " + std::to_string(slots[i - 1][2]) + " and " +
                                 std::to_string(slots[i][2]) + " both append to row " +
                                 std::to_string(slots[i][1]) + " of page " +
                                 std::to_string(slots[i][0]) +
                                 "; expected the pages written to be distinct; nothing was "
                                 "written");
}

// The cache seen as the dense (batch, capacity, nheads_kv, headdim) k or v the core's checks and
// make_params expect. A paged cache has no such layout: its stand-in repeats one row (strides 0),
// so that the core's overlap checks see memory the cache really has (the whole cache is checked
// separately), and forward_kvcache then puts the page strides into Params.
// With cache_batch_idx the rows are not the batch of q: the stand-in repeats row 0 (batch stride
// 0) and forward_kvcache puts the real stride into Params.
TensorView as_dense(const TensorView& cache, int64_t batch, int64_t capacity, bool paged,
                    bool indexed) {
  TensorView r = cache;
  r.shape = {batch, capacity, cache.shape[2], cache.shape[3]};
  if (paged) r.strides[0] = r.strides[1] = 0;
  if (indexed) r.strides[0] = 0;
  return r;
}

}  // namespace

void forward_kvcache(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                     const TensorView& cache_seqlens, const TensorView& k_new,
                     const TensorView& v_new, const TensorView& block_table, const TensorView& out,
                     const TensorView& lse, const Options& options, const KvCacheExtras& extras) {
  const Cache c = check_cache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                              extras);
  const Rotary rot = check_rotary(extras, q, c.seqlens, c.seqlen_new, c.capacity, options);
  const int64_t batch = q.shape[0];
  const bool indexed = !c.batch_idx.empty();
  const TensorView k4 = as_dense(k_cache, batch, c.capacity, c.paged, indexed),
                   v4 = as_dense(v_cache, batch, c.capacity, c.paged, indexed);
  const Shapes s = check_attention_args(q, k4, v4, out, lse, options);
  check_score_mods(options, s, q.device, {{"out", &out}, {"lse", &lse}});
  // Sinks: the CPU kernel and the CUDA decode kernel add each row's sink once (after the key
  // splits merge on the CPU; to split 0's partial on CUDA, which the combine carries). A bias or
  // boolean mask is (batch or 1, nheads or 1, seqlen_q or 1, capacity): key j of sequence b
  // reads column j + cache_leftpad[b], the key's row in the sequence's cache (its position;
  // capacity: seqlen_cache, or max_pages * page_size for a paged cache).
  if (options.sinks.defined() || options.bias.defined() || options.mask.defined())
    check_extras(options, s, q.device, {{"out", &out}, {"lse", &lse}});
  if (options.dbias.defined())
    fail(ErrorKind::value, "dbias: attention over a KV cache has no backward; expected None");
  if (options.dropout_p != 0.0f)
    fail(ErrorKind::value,
         "dropout_p: attention over a KV cache is for inference, expected 0, "
         "got " +
             num_str(options.dropout_p));
  if (options.block_mask.defined())
    fail(ErrorKind::value, "block_mask: not supported with a KV cache; expected None");
  if (options.num_splits < 0)
    fail(ErrorKind::value, "num_splits: expected >= 0 (0: chosen from the shape), got " +
                               std::to_string(options.num_splits));
  // The caches are written through and read after the new rows: no output may overlap them, nor
  // may the new rows overlap the caches they are copied into.
  for (auto [name, t] :
       {NamedView{"k_cache", &k_cache}, {"v_cache", &v_cache}, {"k", &k_new}, {"v", &v_new}}) {
    if (!t->defined()) continue;
    check_no_overlap("out", out, name, *t);
    check_no_overlap("lse", lse, name, *t);
  }
  if (k_new.defined()) {
    for (auto [name, t] : {NamedView{"k", &k_new},
                           {"v", &v_new},
                           {"q", &q},
                           {"bias", &options.bias},
                           {"mask", &options.mask}}) {
      if (!t->defined()) continue;
      check_no_overlap("k_cache", k_cache, name, *t);
      check_no_overlap("v_cache", v_cache, name, *t);
    }
    check_no_overlap("v_cache", v_cache, "k_cache", k_cache);
    check_no_self_overlap("k_cache", k_cache);
    check_no_self_overlap("v_cache", v_cache);
  }

  for (auto [name, t] :
       {NamedView{"rotary_cos", &extras.rotary_cos}, {"rotary_sin", &extras.rotary_sin}}) {
    if (!t->defined()) continue;
    check_no_overlap("out", out, name, *t);
    check_no_overlap("lse", lse, name, *t);
    if (k_new.defined()) {
      check_no_overlap("k_cache", k_cache, name, *t);
      check_no_overlap("v_cache", v_cache, name, *t);
    }
  }
  Params p = make_params(q, k4, v4, out, lse, options, s);
  p.seqused_k = c.visible.data();
  if (indexed) {
    p.cache_batch_idx = c.batch_idx.data();
    p.k_batch_stride = k_cache.strides[0];
    p.v_batch_stride = v_cache.strides[0];
  }
  if (!c.leftpad.empty()) p.cache_leftpad = c.leftpad.data();
  if (c.paged) {
    p.k_batch_stride = k_cache.strides[0];
    p.k_row_stride = k_cache.strides[1];
    p.v_batch_stride = v_cache.strides[0];
    p.v_row_stride = v_cache.strides[1];
    p.block_table = static_cast<const int32_t*>(block_table.data);
    p.block_table_batch_stride = block_table.strides[0];
    p.page_size = c.page_size;
  }
  p.num_splits = options.num_splits;
  if (s.batch == 0) return;
  // The backend (cpu/kvcache.cpp, cuda/kvcache.cu) rotates, appends and attends; every check has
  // passed, so the cache may now be written.
  KvAppend a;
  if (k_new.defined()) {
    a.k_ptr = k_new.data;
    a.v_ptr = v_new.data;
    a.seqlen_new = c.seqlen_new;
    a.k_batch_stride = k_new.strides[0];
    a.k_row_stride = k_new.strides[1];
    a.k_head_stride = k_new.strides[2];
    a.v_batch_stride = v_new.strides[0];
    a.v_row_stride = v_new.strides[1];
    a.v_head_stride = v_new.strides[2];
  }
  if (rot.on) {
    a.rotary_cos = extras.rotary_cos.data;
    a.rotary_sin = extras.rotary_sin.data;
    a.rotary_cos_stride = extras.rotary_cos.strides[0];
    a.rotary_sin_stride = extras.rotary_sin.strides[0];
    a.rotary_dim = rot.dim;
    a.rotary_interleaved = rot.interleaved;
    a.rotary_per_row_q = rot.per_row_q;
    a.cache_seqlens = c.seqlens.data();
  }
  dispatch_kvcache(p, a);
}

}  // namespace flashdl
