// 64-bit indexing: every array the caller passes sits more than 2^31 elements from its base
// pointer. Each array of the call is a view whose widest stride is kWide = 2^31 + 64 elements
// (dense: the batch axis; varlen: the head axis; KV cache: the batch axis of a contiguous cache,
// and a paged pool whose used pages start past element 2^31), so any offset computed in 32 bits
// (signed or unsigned) lands elsewhere. Only the runs the view covers are uploaded: the rest of
// each span is never touched, so on the emulator and the CPU it is address space, not memory (a
// GPU allocates it: about 48 GiB for the largest case). The call must give, bit for bit, what
// the same call gives on compact arrays of the same values (the same kernels; only the
// addresses differ), and must not write outside its views' elements: forward, backward with a
// full-size bias and dBias, varlen, and the KV cache with an append (contiguous and paged, split
// and not). Non-deterministic backward gradients (float atomics) are compared within a few
// units in the last place instead. What this covers beyond the CPU's > 2^31-element test
// (tests/python/test_stress.py): the CUDA kernels' offsets of every caller array. The library's
// own buffers (the dQ accumulator, D and lse workspaces) are indexed by (batch, head, row) in
// int64 and sized by the element count, which stays small here.
// Command line (cli.hpp): --quick, --filter SUBSTR, --cpu (the CPU backend, host address space).
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cli.hpp"
#include "cuda_harness.hpp"
#include "flashdl/api.hpp"

using namespace cuda_test;
using flashdl::DType;
using flashdl::Schedule;

namespace {

constexpr int64_t kWide = (int64_t{1} << 31) + 64;  // elements: past int32 and, doubled, uint32

// A span of memory of `bytes`: cudaMalloc on the device, an untouched anonymous mapping on the
// host (MAP_NORESERVE: pages become memory only where written).
class Span {
 public:
  Span(size_t bytes, bool host) : bytes_(bytes), host_(host) {
    if (host_) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) {
        std::fprintf(stderr, "mmap of %zu bytes failed\n", bytes);
        std::exit(1);
      }
      ptr_ = p;
    } else {
      CUDA_TEST_CHECK(cudaMalloc(&ptr_, bytes));
    }
  }
  ~Span() {
    if (host_)
      munmap(ptr_, bytes_);
    else
      cudaFree(ptr_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  flashdl::Device device() const {
    return flashdl::Device{host_ ? flashdl::DeviceType::cpu : flashdl::DeviceType::cuda, 0};
  }
  char* bytes_at(int64_t offset) const { return static_cast<char*>(ptr_) + offset; }
  void put(int64_t offset, const void* src, size_t n) const {
    if (host_) {
      std::memcpy(bytes_at(offset), src, n);
      return;
    }
    CUDA_TEST_CHECK(cudaMemcpy(bytes_at(offset), src, n, cudaMemcpyHostToDevice));
  }
  void get(int64_t offset, void* dst, size_t n) const {
    if (host_) {
      std::memcpy(dst, bytes_at(offset), n);
      return;
    }
    CUDA_TEST_CHECK(cudaMemcpy(dst, bytes_at(offset), n, cudaMemcpyDeviceToHost));
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
  bool host_;
};

// A logical row-major array (rank <= 4) of U, either compact or "wide": axis `outer` gets the
// stride kWide and the other axes are row-major among themselves within one run per outer index.
// Runs and the elements just before and after them hold 0xff bytes (NaN) until written.
template <typename U>
class Array {
 public:
  Array(const Target& t, std::vector<int64_t> shape, bool wide, int outer = 0)
      : shape_(std::move(shape)), wide_(wide), outer_(outer) {
    const int rank = int(shape_.size());
    int64_t inner = 1;
    for (int a = rank - 1; a >= 0; --a) {
      if (wide_ && a == outer_) continue;
      strides_[a] = inner;
      inner *= shape_[size_t(a)];
    }
    if (!wide_) {
      run_ = inner;
      outer_count_ = 1;
      run_stride_ = 0;
    } else {
      strides_[outer_] = kWide;
      run_ = inner;
      outer_count_ = shape_[size_t(outer_)];
      run_stride_ = kWide;
    }
    // One spare element before and after every run (inside the span: the first run starts at
    // element 1), checked after the call.
    const int64_t last = outer_count_ > 0 ? (outer_count_ - 1) * run_stride_ : 0;
    span_ = std::make_unique<Span>(size_t(last + run_ + 2) * sizeof(U), t.host);
    for (int64_t o = 0; o < outer_count_; ++o) {
      const std::vector<unsigned char> poison((size_t(run_) + 2) * sizeof(U), 0xff);
      span_->put(o * run_stride_ * int64_t(sizeof(U)), poison.data(), poison.size());
    }
  }

  flashdl::TensorView view(DType dt) const {
    flashdl::TensorView v;
    v.data = span_->bytes_at(int64_t(sizeof(U)));  // element 1: element 0 is the spare
    v.dtype = dt;
    v.device = span_->device();
    v.rank = int(shape_.size());
    for (int a = 0; a < v.rank; ++a) {
      v.shape[a] = shape_[size_t(a)];
      v.strides[a] = strides_[a];
    }
    return v;
  }

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    return n;
  }

  // Writes the logical values x (row-major) into the runs.
  void upload(const std::vector<U>& x) const {
    for (int64_t o = 0; o < outer_count_; ++o) {
      std::vector<U> run = read_run(o);
      for_each(o,
               [&](int64_t logical, int64_t in_run) { run[size_t(in_run)] = x[size_t(logical)]; });
      span_->put((o * run_stride_ + 1) * int64_t(sizeof(U)), run.data(), run.size() * sizeof(U));
    }
  }

  // The logical values; `spares_ok` is cleared when an element next to a run was written.
  std::vector<U> download(bool& spares_ok) const {
    std::vector<U> x(static_cast<size_t>(numel()));
    for (int64_t o = 0; o < outer_count_; ++o) {
      std::vector<unsigned char> raw((size_t(run_) + 2) * sizeof(U));
      span_->get(o * run_stride_ * int64_t(sizeof(U)), raw.data(), raw.size());
      for (size_t i = 0; i < sizeof(U); ++i)
        spares_ok &= raw[i] == 0xff && raw[raw.size() - 1 - i] == 0xff;
      std::vector<U> run(static_cast<size_t>(run_));
      std::memcpy(run.data(), raw.data() + sizeof(U), size_t(run_) * sizeof(U));
      for_each(o,
               [&](int64_t logical, int64_t in_run) { x[size_t(logical)] = run[size_t(in_run)]; });
    }
    return x;
  }

 private:
  std::vector<U> read_run(int64_t o) const {
    std::vector<U> run(static_cast<size_t>(run_));
    span_->get((o * run_stride_ + 1) * int64_t(sizeof(U)), run.data(), run.size() * sizeof(U));
    return run;
  }
  // f(logical index, offset within run o) for every element whose outer index is o.
  template <typename F>
  void for_each(int64_t o, F&& f) const {
    const int rank = int(shape_.size());
    int64_t ext[4] = {1, 1, 1, 1}, st[4] = {0, 0, 0, 0};
    for (int a = 0; a < rank; ++a) ext[a] = shape_[size_t(a)], st[a] = strides_[a];
    int64_t logical = 0;
    for (int64_t i0 = 0; i0 < ext[0]; ++i0)
      for (int64_t i1 = 0; i1 < ext[1]; ++i1)
        for (int64_t i2 = 0; i2 < ext[2]; ++i2)
          for (int64_t i3 = 0; i3 < ext[3]; ++i3, ++logical) {
            const int64_t idx[4] = {i0, i1, i2, i3};
            if (wide_ && idx[outer_] != o) continue;
            int64_t off = 0;
            for (int a = 0; a < rank; ++a)
              if (!(wide_ && a == outer_)) off += idx[a] * st[a];
            f(logical, off);
          }
  }

  std::vector<int64_t> shape_;
  bool wide_;
  int outer_;
  int64_t strides_[4] = {0, 0, 0, 0};
  int64_t run_ = 0, outer_count_ = 0, run_stride_ = 0;
  std::unique_ptr<Span> span_;
};

using Half = Array<uint16_t>;
using Float = Array<float>;

std::vector<uint16_t> bits_of(const std::vector<float>& x, DType dt) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = to_bits(x[i], dt);
  return b;
}

// Equal bit for bit, or (exact == false) within `ulps` units of bfloat16/float16 at the largest
// magnitude: the summation order of float atomics.
struct Compare {
  bool ok = true;
  std::string why;
  void bits(const char* name, const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
    if (a != b) ok = false, why += std::string(" [") + name + " differs]";
  }
  void bits(const char* name, const std::vector<float>& a, const std::vector<float>& b) {
    if (a.size() != b.size() || std::memcmp(a.data(), b.data(), a.size() * 4) != 0)
      ok = false, why += std::string(" [") + name + " differs]";
  }
  void close(const char* name, const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
             DType dt, bool exact) {
    if (exact) return bits(name, a, b);
    double scale = 0.0, err = 0.0;
    for (size_t i = 0; i < b.size(); ++i) {
      const double x = from_bits(a[i], dt), y = from_bits(b[i], dt);
      scale = std::fmax(scale, std::fabs(y));
      const double e = std::fabs(x - y);
      err = std::isnan(e) ? INFINITY : std::fmax(err, e);
    }
    const double ulp = dt == DType::float16 ? 1.0 / 1024 : 1.0 / 128;
    if (!(err <= 4 * ulp * std::fmax(scale, 1.0)))
      ok = false, why += std::string(" [") + name + " off by " + std::to_string(err) + "]";
  }
  void nonzero(const char* name, const std::vector<uint16_t>& a, DType dt) {
    double m = 0.0;
    for (uint16_t x : a) m = std::fmax(m, std::fabs(double(from_bits(x, dt))));
    if (!(m > 0.0) || std::isnan(m))
      ok = false, why += std::string(" [") + name + " all zero or NaN]";
  }
};

struct Variant {
  const char* name;
  Schedule schedule;
  bool deterministic;
};
const Variant kVariants[] = {{"fa1", Schedule::fa1, false},
                             {"fa2", Schedule::fa2, false},
                             {"fa2(det)", Schedule::fa2, true}};

constexpr int64_t kB = 2, kH = 2, kHk = 1, kD = 64;

// ---- dense forward and backward (batch axis wide), optionally with a full-size bias ------------
struct DenseOut {
  std::vector<uint16_t> out, dq, dk, dv, dbias;
  std::vector<float> lse;
  bool spares_ok = true;
};

DenseOut run_dense(const Target& t, bool wide, DType dt, const Variant& var, bool causal, bool bias,
                   const std::vector<std::vector<uint16_t>>& in, int64_t sq, int64_t sk) {
  Half q(t, {kB, sq, kH, kD}, wide), k(t, {kB, sk, kHk, kD}, wide), v(t, {kB, sk, kHk, kD}, wide),
      dout(t, {kB, sq, kH, kD}, wide), out(t, {kB, sq, kH, kD}, wide),
      dq(t, {kB, sq, kH, kD}, wide), dk(t, {kB, sk, kHk, kD}, wide), dv(t, {kB, sk, kHk, kD}, wide),
      bs(t, {kB, kH, sq, sk}, wide), dbs(t, {kB, kH, sq, sk}, wide);
  Float lse(t, {kB, kH, sq}, wide);
  q.upload(in[0]);
  k.upload(in[1]);
  v.upload(in[2]);
  dout.upload(in[3]);
  if (bias) bs.upload(in[4]);
  flashdl::Options o;
  o.schedule = var.schedule;
  o.deterministic = var.deterministic;
  o.causal = causal;
  o.stream = t.stream;
  if (bias) o.bias = bs.view(dt);
  flashdl::forward(q.view(dt), k.view(dt), v.view(dt), out.view(dt), lse.view(DType::float32), o);
  if (bias) o.dbias = dbs.view(dt);
  flashdl::backward(dout.view(dt), q.view(dt), k.view(dt), v.view(dt), out.view(dt),
                    lse.view(DType::float32), dq.view(dt), dk.view(dt), dv.view(dt), o);
  t.sync();
  DenseOut r;
  r.out = out.download(r.spares_ok);
  r.lse = lse.download(r.spares_ok);
  r.dq = dq.download(r.spares_ok);
  r.dk = dk.download(r.spares_ok);
  r.dv = dv.download(r.spares_ok);
  if (bias) r.dbias = dbs.download(r.spares_ok);
  bool inputs_ok = true;  // inputs are never written
  inputs_ok &= q.download(inputs_ok) == in[0] && k.download(inputs_ok) == in[1] &&
               v.download(inputs_ok) == in[2] && dout.download(inputs_ok) == in[3];
  r.spares_ok &= inputs_ok;
  return r;
}

int dense_cases(const Target& t, const Cli& cli, std::mt19937& rng) {
  int failures = 0;
  const int64_t sq = 70, sk = 90;  // ragged tiles
  for (const DType dt : {DType::float16, DType::bfloat16})
    for (const Variant& var : kVariants)
      for (const bool causal : {false, true})
        for (const bool bias : {false, true}) {
          const bool in_quick = dt == DType::float16 && causal && (bias || var.deterministic);
          if (cli.quick && !in_quick) continue;
          char label[160];
          std::snprintf(label, sizeof label, "dense %s %s%s%s (1 << 31) + 64 batch stride",
                        var.name, dt == DType::float16 ? "float16" : "bfloat16",
                        causal ? " causal" : "", bias ? " bias+dbias" : "");
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&] {
            const std::vector<std::vector<uint16_t>> in = {
                bits_of(random_values(kB * sq * kH * kD, rng), dt),
                bits_of(random_values(kB * sk * kHk * kD, rng), dt),
                bits_of(random_values(kB * sk * kHk * kD, rng), dt),
                bits_of(random_values(kB * sq * kH * kD, rng), dt),
                bits_of(random_values(kB * kH * sq * sk, rng), dt)};
            const DenseOut a = run_dense(t, false, dt, var, causal, bias, in, sq, sk);
            const DenseOut w = run_dense(t, true, dt, var, causal, bias, in, sq, sk);
            Compare c;
            c.nonzero("out", a.out, dt);
            c.nonzero("dq", a.dq, dt);
            c.bits("out", w.out, a.out);
            c.bits("lse", w.lse, a.lse);
            // fa2 and fa1 sum dQ (and GQA's dK, dV) with float atomics unless deterministic.
            const bool exact = var.deterministic;
            c.close("dq", w.dq, a.dq, dt, exact);
            c.close("dk", w.dk, a.dk, dt, exact);
            c.close("dv", w.dv, a.dv, dt, exact);
            if (bias) c.close("dbias", w.dbias, a.dbias, dt, exact);
            if (!a.spares_ok || !w.spares_ok) c.ok = false, c.why += " [wrote outside a view]";
            std::printf("%s %s%s\n", c.ok ? "ok  " : "FAIL", label, c.why.c_str());
            return c.ok;
          });
        }
  return failures;
}

// ---- varlen (head axis wide: packed (total, heads, d) with head stride kWide) -------------------
const std::vector<int32_t> kCuQ = {0, 30, 30, 100}, kCuK = {0, 50, 61, 130};

struct VarlenOut {
  std::vector<uint16_t> out, dq, dk, dv;
  std::vector<float> lse;
  bool spares_ok = true;
};

VarlenOut run_varlen(const Target& t, bool wide, DType dt, const Variant& var,
                     const std::vector<std::vector<uint16_t>>& in) {
  const int64_t tq = kCuQ.back(), tk = kCuK.back(), n = int64_t(kCuQ.size());
  Half q(t, {tq, kH, kD}, wide, 1), k(t, {tk, kHk, kD}, wide, 1), v(t, {tk, kHk, kD}, wide, 1),
      dout(t, {tq, kH, kD}, wide, 1), out(t, {tq, kH, kD}, wide, 1), dq(t, {tq, kH, kD}, wide, 1),
      dk(t, {tk, kHk, kD}, wide, 1), dv(t, {tk, kHk, kD}, wide, 1);
  Float lse(t, {kH, tq}, wide, 0);
  q.upload(in[0]);
  k.upload(in[1]);
  v.upload(in[2]);
  dout.upload(in[3]);
  std::vector<int32_t> cq = kCuQ, ck = kCuK;
  const auto cu_q = flashdl::make_view(cq.data(), DType::int32, {n});
  const auto cu_k = flashdl::make_view(ck.data(), DType::int32, {n});
  flashdl::Options o;
  o.schedule = var.schedule;
  o.deterministic = var.deterministic;
  o.causal = true;
  o.stream = t.stream;
  flashdl::forward_varlen(q.view(dt), k.view(dt), v.view(dt), cu_q, cu_k, 70, 69, out.view(dt),
                          lse.view(DType::float32), o);
  flashdl::backward_varlen(dout.view(dt), q.view(dt), k.view(dt), v.view(dt), out.view(dt),
                           lse.view(DType::float32), cu_q, cu_k, 70, 69, dq.view(dt), dk.view(dt),
                           dv.view(dt), o);
  t.sync();
  VarlenOut r;
  r.out = out.download(r.spares_ok);
  r.lse = lse.download(r.spares_ok);
  r.dq = dq.download(r.spares_ok);
  r.dk = dk.download(r.spares_ok);
  r.dv = dv.download(r.spares_ok);
  return r;
}

int varlen_cases(const Target& t, const Cli& cli, std::mt19937& rng) {
  int failures = 0;
  const int64_t tq = kCuQ.back(), tk = kCuK.back();
  for (const DType dt : {DType::float16, DType::bfloat16})
    for (const Variant& var : kVariants) {
      if (cli.quick && (dt != DType::float16 || var.schedule != Schedule::fa2)) continue;
      char label[160];
      std::snprintf(label, sizeof label, "varlen %s %s causal (1 << 31) + 64 head stride", var.name,
                    dt == DType::float16 ? "float16" : "bfloat16");
      if (!cli.selected(label)) continue;
      failures += run_case(label, [&] {
        const std::vector<std::vector<uint16_t>> in = {
            bits_of(random_values(tq * kH * kD, rng), dt),
            bits_of(random_values(tk * kHk * kD, rng), dt),
            bits_of(random_values(tk * kHk * kD, rng), dt),
            bits_of(random_values(tq * kH * kD, rng), dt)};
        const VarlenOut a = run_varlen(t, false, dt, var, in);
        const VarlenOut w = run_varlen(t, true, dt, var, in);
        Compare c;
        c.nonzero("out", a.out, dt);
        c.bits("out", w.out, a.out);
        c.bits("lse", w.lse, a.lse);
        c.close("dq", w.dq, a.dq, dt, var.deterministic);
        c.close("dk", w.dk, a.dk, dt, var.deterministic);
        c.close("dv", w.dv, a.dv, dt, var.deterministic);
        if (!a.spares_ok || !w.spares_ok) c.ok = false, c.why += " [wrote outside a view]";
        std::printf("%s %s%s\n", c.ok ? "ok  " : "FAIL", label, c.why.c_str());
        return c.ok;
      });
    }
  return failures;
}

// ---- KV cache with an append: a contiguous cache (batch axis wide), or a paged pool whose pages
// start past element 2^31 ------------------------------------------------------------------------
constexpr int64_t kSq = 3, kNew = 2, kCache = 112, kPage = 16, kPagesUsed = 16;
const std::vector<int32_t> kLens = {37, 100};  // + kNew each: 39 and 102 keys

struct KvOut {
  std::vector<uint16_t> out, kc, vc;
  std::vector<float> lse;
  bool spares_ok = true;
};

// Paged: the pool (first_page + kPagesUsed pages) and the block table shifted by first_page.
KvOut run_kvcache(const Target& t, bool wide, bool paged, int64_t splits, DType dt,
                  const std::vector<std::vector<uint16_t>>& in) {
  Half q(t, {kB, kSq, kH, kD}, wide), kn(t, {kB, kNew, kHk, kD}, wide),
      vn(t, {kB, kNew, kHk, kD}, wide), out(t, {kB, kSq, kH, kD}, wide);
  Float lse(t, {kB, kH, kSq}, wide);
  const int64_t page_elems = kPage * kHk * kD;
  // Wide pool: the first used page starts past element 2^31 (+ one page).
  const int64_t first_page = wide ? (int64_t{1} << 31) / page_elems + 1 : 0;
  // Contiguous caches: (kB, kCache, kHk, kD), batch axis wide; paged: one run of the used pages.
  std::unique_ptr<Half> kc_c, vc_c;
  std::unique_ptr<Span> kpool, vpool;
  if (!paged) {
    kc_c = std::make_unique<Half>(t, std::vector<int64_t>{kB, kCache, kHk, kD}, wide);
    vc_c = std::make_unique<Half>(t, std::vector<int64_t>{kB, kCache, kHk, kD}, wide);
    kc_c->upload(in[3]);
    vc_c->upload(in[4]);
  } else {
    const size_t bytes = size_t((first_page + kPagesUsed) * page_elems) * 2;
    kpool = std::make_unique<Span>(bytes, t.host);
    vpool = std::make_unique<Span>(bytes, t.host);
    kpool->put(first_page * page_elems * 2, in[5].data(), in[5].size() * 2);
    vpool->put(first_page * page_elems * 2, in[6].data(), in[6].size() * 2);
  }
  auto pool_view = [&](const Span& s) {
    flashdl::TensorView v;
    v.data = s.bytes_at(0);
    v.dtype = dt;
    v.device = s.device();
    v.rank = 4;
    const int64_t shape[4] = {first_page + kPagesUsed, kPage, kHk, kD};
    const int64_t strides[4] = {page_elems, kHk * kD, kD, 1};
    for (int a = 0; a < 4; ++a) v.shape[a] = shape[a], v.strides[a] = strides[a];
    return v;
  };
  q.upload(in[0]);
  kn.upload(in[1]);
  vn.upload(in[2]);
  std::vector<int32_t> lens = kLens;
  // Sequence 0 takes pages 9, 2, 14 (39 keys); sequence 1 the other pages, out of order.
  const int64_t per = kPagesUsed - 3;
  std::vector<int32_t> table = {9, 2, 14, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const std::vector<int32_t> rest = {5, 0, 12, 7, 1, 3, 15, 4, 6, 8, 10, 11, 13};
  table.insert(table.end(), rest.begin(), rest.end());
  for (int32_t& p : table) p += int32_t(first_page);
  flashdl::Options o;
  o.causal = true;
  o.num_splits = splits;
  o.stream = t.stream;
  const flashdl::TensorView none{};
  flashdl::forward_kvcache(q.view(dt), paged ? pool_view(*kpool) : kc_c->view(dt),
                           paged ? pool_view(*vpool) : vc_c->view(dt),
                           flashdl::make_view(lens.data(), DType::int32, {kB}), kn.view(dt),
                           vn.view(dt),
                           paged ? flashdl::make_view(table.data(), DType::int32, {kB, per}) : none,
                           out.view(dt), lse.view(DType::float32), o);
  t.sync();
  KvOut r;
  r.out = out.download(r.spares_ok);
  r.lse = lse.download(r.spares_ok);
  if (!paged) {
    r.kc = kc_c->download(r.spares_ok);
    r.vc = vc_c->download(r.spares_ok);
  } else {
    r.kc.resize(in[5].size());
    r.vc.resize(in[6].size());
    kpool->get(first_page * page_elems * 2, r.kc.data(), r.kc.size() * 2);
    vpool->get(first_page * page_elems * 2, r.vc.data(), r.vc.size() * 2);
  }
  return r;
}

int kvcache_cases(const Target& t, const Cli& cli, std::mt19937& rng) {
  int failures = 0;
  for (const DType dt : {DType::float16, DType::bfloat16})
    for (const bool paged : {false, true})
      for (const int64_t splits : {int64_t{1}, int64_t{3}}) {
        if (cli.quick && (dt != DType::float16 || splits != 3)) continue;
        char label[160];
        std::snprintf(label, sizeof label, "kvcache %s %s num_splits=%lld append causal, %s",
                      paged ? "paged" : "contiguous", dt == DType::float16 ? "float16" : "bfloat16",
                      (long long)splits,
                      paged ? "pages past element 1 << 31" : "(1 << 31) + 64 batch stride");
        if (!cli.selected(label)) continue;
        failures += run_case(label, [&] {
          const int64_t pool = kPagesUsed * kPage * kHk * kD;
          const std::vector<std::vector<uint16_t>> in = {
              bits_of(random_values(kB * kSq * kH * kD, rng), dt),
              bits_of(random_values(kB * kNew * kHk * kD, rng), dt),
              bits_of(random_values(kB * kNew * kHk * kD, rng), dt),
              bits_of(random_values(kB * kCache * kHk * kD, rng), dt),
              bits_of(random_values(kB * kCache * kHk * kD, rng), dt),
              bits_of(random_values(pool, rng), dt),
              bits_of(random_values(pool, rng), dt)};
          const KvOut a = run_kvcache(t, false, paged, splits, dt, in);
          const KvOut w = run_kvcache(t, true, paged, splits, dt, in);
          Compare c;
          c.nonzero("out", a.out, dt);
          c.bits("out", w.out, a.out);
          c.bits("lse", w.lse, a.lse);
          c.bits("k_cache", w.kc, a.kc);
          c.bits("v_cache", w.vc, a.vc);
          if (a.kc == (paged ? in[5] : in[3])) c.ok = false, c.why += " [nothing appended]";
          if (!a.spares_ok || !w.spares_ok) c.ok = false, c.why += " [wrote outside a view]";
          std::printf("%s %s%s\n", c.ok ? "ok  " : "FAIL", label, c.why.c_str());
          return c.ok;
        });
      }
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  return test_main(argc, argv, [](const Target& t, const Cli& cli) {
    std::mt19937 rng(2031);
    int failures = 0;
    failures += dense_cases(t, cli, rng);
    failures += varlen_cases(t, cli, rng);
    failures += kvcache_cases(t, cli, rng);
    return failures;
  });
}
