// The CUDA varlen path (forward_varlen, backward_varlen: one launch for the packed batch) against
// the CPU float64 reference run on each sequence alone: out, lse, dq, dk, dv by flash-attn's rule
// (cuda_harness.hpp, backward_oracle.hpp), for both dtypes, fa1, fa2 and deterministic fa2, plain,
// causal and windowed, GQA, with cu_seqlens on the host and on the device. The batch mixes an empty
// query sequence, one row, a sequence with fewer keys than queries and one with more. Then the fa2
// forward of every sequence must equal, bit for bit, the same sequence run alone as a dense batch
// of one (the same tiles from each sequence's first row). Outputs are poisoned with NaN first:
// rows of no sequence must stay untouched. Exit code 77 (skipped) when there is no CUDA device.
// Command line (cli.hpp): --quick (for compute-sanitizer), --filter SUBSTR, --no-race, --cpu.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "backward_oracle.hpp"
#include "cli.hpp"
#include "cuda_harness.hpp"
#include "flashdl/api.hpp"

using namespace cuda_test;
using flashdl::DType;
using flashdl::Schedule;

namespace {

const std::vector<int32_t> kLensQ = {17, 0, 100, 1, 130};
const std::vector<int32_t> kLensK = {40, 9, 100, 300, 70};
constexpr int64_t kHeads = 4, kHeadsKv = 2;

struct Variant {
  const char* name;
  Schedule schedule;
  bool deterministic;
};
const Variant kVariants[] = {{"fa1", Schedule::fa1, false},
                             {"fa2", Schedule::fa2, false},
                             {"fa2(det)", Schedule::fa2, true}};

struct Mask {
  const char* name;
  bool causal;
  int64_t left, right;
};
const Mask kMasks[] = {{"full", false, -1, -1},
                       {"causal", true, -1, -1},
                       {"window(24,3)", false, 24, 3}};

std::vector<int32_t> offsets(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu(1, 0);
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}

Shape shape_of(int64_t sq, int64_t sk, int64_t d, const Mask& m) {
  return Shape{1, sq, sk, kHeads, kHeadsKv, d, m.left, m.causal ? 0 : m.right};
}

flashdl::Options options_of(const Mask& m) {
  flashdl::Options o;
  o.causal = m.causal;
  o.window_left = m.left;
  o.window_right = m.right;
  return o;
}

// One sequence: its inputs and the oracle of it run alone.
struct Sequence {
  int64_t sq, sk;
  BwdInputs in;
  BwdOracle ref;
  std::vector<double> lowp_out;
  Grads lowp;
};

// Rows [row0, row0 + rows) of a packed (total, heads, d) array as a logical (1, rows, heads, d).
std::vector<double> rows_of(const std::vector<double>& packed, int64_t row0, int64_t rows,
                            int64_t heads, int64_t d) {
  return std::vector<double>(packed.begin() + row0 * heads * d,
                             packed.begin() + (row0 + rows) * heads * d);
}

template <typename U>
void append(std::vector<U>& dst, const std::vector<U>& src) {
  dst.insert(dst.end(), src.begin(), src.end());
}

std::vector<uint16_t> bits_of(const std::vector<float>& x, DType dt) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = to_bits(x[i], dt);
  return b;
}

std::vector<double> values_of(const std::vector<uint16_t>& b, DType dt) {
  std::vector<double> x(b.size());
  for (size_t i = 0; i < b.size(); ++i) x[i] = from_bits(b[i], dt);
  return x;
}

flashdl::TensorView packed_view(const Buffer& buf, DType dt, int64_t rows, int64_t heads,
                                int64_t d) {
  return flashdl::TensorView{buf.ptr, dt, buf.device(), 3, {rows, heads, d}, {heads * d, d, 1}};
}

// poisoned: sequences whose keys and values are all NaN or +-Inf (plant_nonfinite at each key; a
// packed key tile of another sequence reaches into them): every other sequence must still match
// its oracle, the poisoned sequences' rows that see a key must get the non-finite values (the test
// plants what it says), and their checks and the bitwise fa2 comparison are skipped.
int run_case_set(const Target& t, const Cli& cli, DType dt, int64_t d, const Mask& mask,
                 std::mt19937& rng, const std::vector<int64_t>& poisoned = {}) {
  const std::vector<int32_t> cu_q = offsets(kLensQ), cu_k = offsets(kLensK);
  const int64_t total_q = cu_q.back(), total_k = cu_k.back(), batch = int64_t(kLensQ.size());
  int64_t max_q = 0, max_k = 0;
  for (size_t b = 0; b < kLensQ.size(); ++b) {
    max_q = std::max<int64_t>(max_q, kLensQ[b]);
    max_k = std::max<int64_t>(max_k, kLensK[b]);
  }
  // The sequences, each with its oracle; the packed inputs and saved tensors.
  std::vector<Sequence> seqs;
  std::vector<float> q, k, v, dout, out_saved, lse_saved(size_t(kHeads * total_q), 0.0f);
  for (int64_t b = 0; b < batch; ++b) {
    Sequence s{kLensQ[size_t(b)], kLensK[size_t(b)], {}, {}, {}, {}};
    const Shape sh = shape_of(s.sq, s.sk, d, mask);
    s.in = BwdInputs{random_values(s.sq * kHeads * d, rng), random_values(s.sk * kHeadsKv * d, rng),
                     random_values(s.sk * kHeadsKv * d, rng),
                     random_values(s.sq * kHeads * d, rng)};
    s.ref = reference_backward(sh, options_of(mask), s.in, true);
    naive_lowp(sh, s.in.q, s.in.k, s.in.v, dt, s.lowp_out);
    std::vector<float> out_f(s.ref.out.size());
    for (size_t i = 0; i < out_f.size(); ++i) out_f[i] = round_to(float(s.ref.out[i]), dt);
    s.lowp = naive_lowp_backward(sh, s.in, out_f, dt);
    append(q, s.in.q);
    append(k, s.in.k);
    append(v, s.in.v);
    append(dout, s.in.dout);
    append(out_saved, out_f);
    for (int64_t h = 0; h < kHeads; ++h)  // lse (1, h, sq) -> packed (h, total_q)
      for (int64_t i = 0; i < s.sq; ++i)
        lse_saved[size_t(h * total_q + cu_q[size_t(b)] + i)] = s.ref.lse[size_t(h * s.sq + i)];
    seqs.push_back(std::move(s));
  }
  auto is_poisoned = [&](int64_t b) {
    return std::find(poisoned.begin(), poisoned.end(), b) != poisoned.end();
  };
  for (const int64_t b : poisoned) {  // every key of sequence b, in the packed k and v
    const Shape packed{1, 1, total_k, kHeads, kHeadsKv, d, -1, -1};
    std::vector<int64_t> keys;
    for (int64_t j = cu_k[size_t(b)]; j < cu_k[size_t(b) + 1]; ++j) keys.push_back(j);
    plant_nonfinite(packed, keys, k, v);
  }

  const bool host = t.host;
  Buffer bq(q.size() * 2, host), bk(k.size() * 2, host), bv(v.size() * 2, host),
      bdo(dout.size() * 2, host), bos(out_saved.size() * 2, host), bls(lse_saved.size() * 4, host);
  bq.upload(bits_of(q, dt));
  bk.upload(bits_of(k, dt));
  bv.upload(bits_of(v, dt));
  bdo.upload(bits_of(dout, dt));
  bos.upload(bits_of(out_saved, dt));
  bls.upload(lse_saved);
  Buffer dev_cu_q(cu_q.size() * 4, host), dev_cu_k(cu_k.size() * 4, host);
  dev_cu_q.upload(cu_q);
  dev_cu_k.upload(cu_k);
  const auto cu_len = int64_t(cu_q.size());
  const auto host_cu_q = flashdl::make_view(const_cast<int32_t*>(cu_q.data()), DType::int32,
                                            {cu_len});
  const auto host_cu_k = flashdl::make_view(const_cast<int32_t*>(cu_k.data()), DType::int32,
                                            {cu_len});

  int failures = 0;
  for (const Variant& var : kVariants)
    for (const bool cu_on_device : {false, true}) {
      char label_buf[200];
      std::snprintf(label_buf, sizeof label_buf, "varlen %s %s d=%lld %s h=%lld/%lld cu_seqlens=%s",
                    var.name, dt == DType::float16 ? "float16" : "bfloat16", (long long)d,
                    mask.name, (long long)kHeads, (long long)kHeadsKv,
                    cu_on_device ? "device" : "host");
      std::string label = label_buf;
      if (!poisoned.empty()) {
        label = "masked NaN/Inf in the keys of sequence";
        for (const int64_t b : poisoned) label += " " + std::to_string(b);
        label += std::string(" ") + label_buf;
      }
      if (!cli.selected(label)) continue;
      if (host && cu_on_device) continue;  // the CPU backend takes host cu_seqlens only
      failures += run_case(label, [&] {
        flashdl::Options o = options_of(mask);
        o.schedule = var.schedule;
        o.deterministic = var.deterministic;
        o.stream = t.stream;
        const auto cq = cu_on_device
                            ? flashdl::TensorView{dev_cu_q.ptr, DType::int32, dev_cu_q.device(), 1,
                                                  {cu_len},     {1}}
                            : host_cu_q;
        const auto ck = cu_on_device
                            ? flashdl::TensorView{dev_cu_k.ptr, DType::int32, dev_cu_k.device(), 1,
                                                  {cu_len},     {1}}
                            : host_cu_k;
        // One spare row after the packed rows: it belongs to no sequence and must stay NaN.
        Buffer out((size_t(total_q + 1) * kHeads * d) * 2, host),
            lse(size_t(kHeads * (total_q + 1)) * 4, host);
        Buffer dq((size_t(total_q + 1) * kHeads * d) * 2, host),
            dk((size_t(total_k + 1) * kHeadsKv * d) * 2, host),
            dv((size_t(total_k + 1) * kHeadsKv * d) * 2, host);
        for (Buffer* b : {&out, &lse, &dq, &dk, &dv}) b->poison();
        const auto lse_view = flashdl::TensorView{lse.ptr, DType::float32,    lse.device(),
                                                  2,       {kHeads, total_q}, {total_q + 1, 1}};
        flashdl::forward_varlen(packed_view(bq, dt, total_q, kHeads, d),
                                packed_view(bk, dt, total_k, kHeadsKv, d),
                                packed_view(bv, dt, total_k, kHeadsKv, d), cq, ck, max_q, max_k,
                                packed_view(out, dt, total_q, kHeads, d), lse_view, o);
        flashdl::backward_varlen(
            packed_view(bdo, dt, total_q, kHeads, d), packed_view(bq, dt, total_q, kHeads, d),
            packed_view(bk, dt, total_k, kHeadsKv, d), packed_view(bv, dt, total_k, kHeadsKv, d),
            packed_view(bos, dt, total_q, kHeads, d),
            flashdl::TensorView{
                bls.ptr, DType::float32, bls.device(), 2, {kHeads, total_q}, {total_q, 1}},
            cq, ck, max_q, max_k, packed_view(dq, dt, total_q, kHeads, d),
            packed_view(dk, dt, total_k, kHeadsKv, d), packed_view(dv, dt, total_k, kHeadsKv, d),
            o);
        t.sync();
        const std::vector<uint16_t> out_b = out.download<uint16_t>(),
                                    dq_b = dq.download<uint16_t>(), dk_b = dk.download<uint16_t>(),
                                    dv_b = dv.download<uint16_t>();
        const std::vector<float> lse_h = lse.download<float>();
        const std::vector<double> out_all = values_of(out_b, dt), dq_all = values_of(dq_b, dt),
                                  dk_all = values_of(dk_b, dt), dv_all = values_of(dv_b, dt);
        bool ok = true;
        std::string why;
        double worst = 0.0;
        const double eps = dt == DType::float16 ? 1e-3 : 8e-3;
        bool seen = poisoned.empty();
        for (int64_t b = 0; b < batch; ++b) {
          const Sequence& s = seqs[size_t(b)];
          const int64_t q0 = cu_q[size_t(b)], k0 = cu_k[size_t(b)];
          const std::vector<double> o_b = rows_of(out_all, q0, s.sq, kHeads, d);
          if (is_poisoned(b)) {
            seen |= any_nan(o_b) || max_abs(o_b) == INFINITY;
            continue;
          }
          const double err = max_abs_diff(o_b, s.ref.out);
          const double tol = 2.0 * max_abs_diff(s.lowp_out, s.ref.out) + eps;
          worst = std::max(worst, err);
          if (!(err <= tol)) ok = false, why += " [out of sequence " + std::to_string(b) + "]";
          for (int64_t h = 0; h < kHeads; ++h)
            for (int64_t i = 0; i < s.sq; ++i) {
              const float want = s.ref.lse[size_t(h * s.sq + i)];
              const float got = lse_h[size_t(h * (total_q + 1) + q0 + i)];
              const bool good = std::isinf(want) ? got == want
                                                 : std::fabs(double(got) - want) <=
                                                       1e-3 + 1e-4 * std::fabs(want);
              if (!good) ok = false, why += " [lse of sequence " + std::to_string(b) + "]";
            }
          const GradError eq = grad_error(rows_of(dq_all, q0, s.sq, kHeads, d), s.ref.dq, s.lowp.dq,
                                          dt);
          const GradError ek = grad_error(rows_of(dk_all, k0, s.sk, kHeadsKv, d), s.ref.dk,
                                          s.lowp.dk, dt);
          const GradError ev = grad_error(rows_of(dv_all, k0, s.sk, kHeadsKv, d), s.ref.dv,
                                          s.lowp.dv, dt);
          if (!eq.ok() || !ek.ok() || !ev.ok())
            ok = false, why += " [gradients of sequence " + std::to_string(b) + "]";
        }
        // The spare rows: no sequence's, never written.
        auto spare_untouched = [](const std::vector<uint16_t>& x, int64_t from) {
          for (size_t i = size_t(from); i < x.size(); ++i)
            if (x[i] != 0xffff) return false;
          return true;
        };
        if (!spare_untouched(out_b, total_q * kHeads * d) ||
            !spare_untouched(dq_b, total_q * kHeads * d) ||
            !spare_untouched(dk_b, total_k * kHeadsKv * d) ||
            !spare_untouched(dv_b, total_k * kHeadsKv * d))
          ok = false, why += " [wrote past the packed rows]";
        for (int64_t h = 0; h < kHeads; ++h)
          if (float_to_bits(lse_h[size_t(h * (total_q + 1) + total_q)]) != 0xffffffffu)
            ok = false, why += " [wrote past lse's rows]";

        // fa2 forward: each sequence bitwise equal to itself run alone.
        if (!seen) ok = false, why += " [no row saw the planted values]";
        if (var.schedule == Schedule::fa2 && !host && poisoned.empty()) {
          for (int64_t b = 0; b < batch; ++b) {
            const Sequence& s = seqs[size_t(b)];
            if (s.sq == 0) continue;
            const int64_t q0 = cu_q[size_t(b)], k0 = cu_k[size_t(b)];
            Buffer aq(size_t(s.sq * kHeads * d) * 2, host),
                ak(size_t(s.sk * kHeadsKv * d) * 2, host),
                av(size_t(s.sk * kHeadsKv * d) * 2, host), ao(size_t(s.sq * kHeads * d) * 2, host),
                al(size_t(kHeads * s.sq) * 4, host);
            aq.upload(bits_of(s.in.q, dt));
            ak.upload(bits_of(s.in.k, dt));
            av.upload(bits_of(s.in.v, dt));
            flashdl::forward(flashdl::TensorView{aq.ptr,
                                                 dt,
                                                 aq.device(),
                                                 4,
                                                 {1, s.sq, kHeads, d},
                                                 {s.sq * kHeads * d, kHeads * d, d, 1}},
                             flashdl::TensorView{ak.ptr,
                                                 dt,
                                                 ak.device(),
                                                 4,
                                                 {1, s.sk, kHeadsKv, d},
                                                 {s.sk * kHeadsKv * d, kHeadsKv * d, d, 1}},
                             flashdl::TensorView{av.ptr,
                                                 dt,
                                                 av.device(),
                                                 4,
                                                 {1, s.sk, kHeadsKv, d},
                                                 {s.sk * kHeadsKv * d, kHeadsKv * d, d, 1}},
                             flashdl::TensorView{ao.ptr,
                                                 dt,
                                                 ao.device(),
                                                 4,
                                                 {1, s.sq, kHeads, d},
                                                 {s.sq * kHeads * d, kHeads * d, d, 1}},
                             flashdl::TensorView{al.ptr,
                                                 DType::float32,
                                                 al.device(),
                                                 3,
                                                 {1, kHeads, s.sq},
                                                 {kHeads * s.sq, s.sq, 1}},
                             o);
            t.sync();
            const std::vector<uint16_t> alone = ao.download<uint16_t>();
            if (std::memcmp(alone.data(), out_b.data() + q0 * kHeads * d, alone.size() * 2) != 0)
              ok = false,
              why += " [fa2 out of sequence " + std::to_string(b) + " differs from it alone]";
            (void)k0;
          }
        }
        std::printf("%s %s | out err %.2e%s\n", ok ? "ok  " : "FAIL", label.c_str(), worst,
                    why.c_str());
        return ok;
      });
    }
  return failures;
}

// ---- paged varlen (block_table, seqused_k; forward only) -----------------------------------------
// Keys and values in a shuffled page pool whose unused slots are NaN; the paged call must equal,
// bit for bit, the contiguous call on the keys each sequence uses (out and lse), leave the pool
// as it was, and (on CUDA) agree with the CPU backend's paged call. A page table with two pages swapped between sequences
// must change the result: the comparison sees the page mapping.
struct PagedCase {
  const char* name;
  DType dt;
  int64_t d;
  std::vector<int32_t> lens_q, lens_k, used;  // used empty: no seqused_k
  int64_t page_size;                          // 0: contiguous k, v with seqused_k
  bool causal;
  int64_t window_left;
  Schedule schedule;
  int64_t pad;  // extra elements after each head row of the pool (3: misaligned rows)
};

int run_paged_case(const Target& t, const Cli& cli, const PagedCase& c, std::mt19937& rng) {
  const std::string label = std::string("paged varlen ") + c.name;
  if (!cli.selected(label)) return 0;
  return run_case(label, [&] {
    const bool host = t.host, paged = c.page_size > 0;
    const int64_t batch = int64_t(c.lens_q.size()), d = c.d, hk = kHeadsKv, h = kHeads;
    const std::vector<int32_t> keys = c.used.empty() ? c.lens_k : c.used;
    const std::vector<int32_t> cu_q = offsets(c.lens_q), cu_k = offsets(c.lens_k),
                               cu_used = offsets(keys);
    const int64_t total_q = cu_q.back(), total_k = cu_k.back(), total_used = cu_used.back();
    int64_t max_q = 0, max_k = 0;
    for (int64_t b = 0; b < batch; ++b) {
      max_q = std::max<int64_t>(max_q, c.lens_q[size_t(b)]);
      max_k = std::max<int64_t>(max_k, c.lens_k[size_t(b)]);
    }
    // The keys and values of every sequence (lens_k rows each), and those it uses, packed.
    const std::vector<uint16_t> q = bits_of(random_values(total_q * h * d, rng), c.dt),
                                kall = bits_of(random_values(total_k * hk * d, rng), c.dt),
                                vall = bits_of(random_values(total_k * hk * d, rng), c.dt);
    std::vector<uint16_t> kc, vc;
    for (int64_t b = 0; b < batch; ++b) {
      const auto from = size_t(cu_k[size_t(b)] * hk * d), n = size_t(keys[size_t(b)] * hk * d);
      kc.insert(kc.end(), kall.begin() + long(from), kall.begin() + long(from + n));
      vc.insert(vc.end(), vall.begin() + long(from), vall.begin() + long(from + n));
    }
    // The pool: pages of page_size rows (head rows d + pad apart), ids shuffled, two spare pages,
    // NaN wherever no key is; table columns past a sequence's pages hold an id no page has.
    const int64_t ps = paged ? c.page_size : 1, hs = d + c.pad;
    std::vector<int64_t> npages(static_cast<size_t>(batch));
    int64_t num_pages = 2, max_pages = 1;
    for (int64_t b = 0; b < batch; ++b) {
      npages[size_t(b)] = (c.lens_k[size_t(b)] + ps - 1) / ps;
      num_pages += npages[size_t(b)];
      max_pages = std::max(max_pages, npages[size_t(b)] + 1);
    }
    std::vector<int32_t> ids(static_cast<size_t>(num_pages));
    for (int64_t i = 0; i < num_pages; ++i) ids[size_t(i)] = int32_t(i);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int32_t> table(size_t(batch * max_pages), int32_t(num_pages + 5));
    const int64_t rows = paged ? num_pages * ps : total_k;
    std::vector<uint16_t> kp(size_t(rows * hk * hs), 0xffff), vp(kp);
    int64_t next = 0;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t pg = 0; pg < npages[size_t(b)]; ++pg)
        table[size_t(b * max_pages + pg)] = ids[size_t(next++)];
      for (int64_t j = 0; j < c.lens_k[size_t(b)]; ++j) {
        const int64_t row = paged ? table[size_t(b * max_pages + j / ps)] * ps + j % ps
                                  : cu_k[size_t(b)] + j;
        for (int64_t hh = 0; hh < hk; ++hh)
          for (int64_t e = 0; e < d; ++e) {
            const size_t src = size_t(((cu_k[size_t(b)] + j) * hk + hh) * d + e);
            kp[size_t((row * hk + hh) * hs + e)] = kall[src];
            vp[size_t((row * hk + hh) * hs + e)] = vall[src];
          }
      }
    }
    flashdl::Options o;
    o.causal = c.causal;
    o.window_left = c.window_left;
    o.schedule = c.schedule;

    // One forward_varlen call on `on_host` (or the target), paged or on the used keys packed.
    struct Result {
      std::vector<uint16_t> out;
      std::vector<float> lse;
    };
    auto call = [&](bool on_host, bool use_pages, const std::vector<int32_t>& tab) {
      Buffer bq(q.size() * 2, on_host), bo(q.size() * 2 + 2, on_host),
          bl(size_t(h * total_q) * 4 + 4, on_host);
      const std::vector<uint16_t>& ks = use_pages ? kp : kc;
      const std::vector<uint16_t>& vs = use_pages ? vp : vc;
      Buffer bk(ks.size() * 2 + 2, on_host), bv(vs.size() * 2 + 2, on_host);
      bq.upload(q);
      bk.upload(ks);
      bv.upload(vs);
      bo.poison();
      bl.poison();
      flashdl::Options oo = o;
      oo.stream = on_host ? nullptr : t.stream;
      std::vector<int32_t> cq = cu_q, ck = use_pages ? cu_k : cu_used, used = c.used, tb = tab;
      const auto ln = int64_t(cq.size());
      const auto qv = packed_view(bq, c.dt, total_q, h, d);
      const auto ov = packed_view(bo, c.dt, total_q, h, d);
      const auto lv = flashdl::TensorView{bl.ptr, DType::float32, bl.device(),
                                          2,      {h, total_q},   {total_q, 1}};
      const auto cqv = flashdl::make_view(cq.data(), DType::int32, {ln});
      const auto ckv = flashdl::make_view(ck.data(), DType::int32, {ln});
      flashdl::PagedKv pk;
      flashdl::TensorView kv, vv;
      if (use_pages) {
        const int64_t d0 = paged ? num_pages : total_k;
        kv = paged
                 ? flashdl::TensorView{bk.ptr,
                                       c.dt,
                                       bk.device(),
                                       4,
                                       {num_pages, ps, hk, d},
                                       {ps * hk * hs, hk * hs, hs, 1}}
                 : flashdl::TensorView{bk.ptr, c.dt, bk.device(), 3, {d0, hk, d}, {hk * hs, hs, 1}};
        vv = kv;
        vv.data = bv.ptr;
        if (paged) pk.block_table = flashdl::make_view(tb.data(), DType::int32, {batch, max_pages});
        if (!used.empty()) pk.seqused_k = flashdl::make_view(used.data(), DType::int32, {batch});
      } else {
        kv = packed_view(bk, c.dt, total_used, hk, d);
        vv = packed_view(bv, c.dt, total_used, hk, d);
      }
      flashdl::forward_varlen(qv, kv, vv, cqv, ckv, max_q, max_k, ov, lv, oo, pk);
      if (!on_host) t.sync();
      // The pool (or k, v) as it was: the call only reads it.
      for (auto [buf, want] : {std::pair{&bk, &ks}, {&bv, &vs}}) {
        const std::vector<uint16_t> now = buf->download<uint16_t>();
        if (std::memcmp(now.data(), want->data(), want->size() * 2) != 0)
          throw std::runtime_error("the call changed k or v");
      }
      Result r{bo.download<uint16_t>(), bl.download<float>()};
      // The spare element after out and lse: never written.
      if (r.out.back() != 0xffff || float_to_bits(r.lse.back()) != 0xffffffffu)
        throw std::runtime_error("wrote past out or lse");
      return r;
    };
    const Result pag = call(host, true, table), con = call(host, false, table);
    bool ok = true;
    std::string why;
    if (std::memcmp(pag.out.data(), con.out.data(), pag.out.size() * 2) != 0)
      ok = false, why += " [out differs from the contiguous call]";
    if (std::memcmp(pag.lse.data(), con.lse.data(), pag.lse.size() * 4) != 0)
      ok = false, why += " [lse differs from the contiguous call]";
    double worst = 0.0;
    if (!host) {  // the CPU backend's paged call on the same inputs
      const Result cpu = call(true, true, table);
      const double eps = c.dt == DType::float16 ? 2e-3 : 1.6e-2;
      for (size_t i = 0; i + 1 < cpu.out.size(); ++i) {
        const double a = from_bits(pag.out[i], c.dt), b = from_bits(cpu.out[i], c.dt);
        const double err = std::fabs(a - b);
        worst = std::max(worst, err);
        if (!(err <= eps * (1.0 + std::fabs(b)))) {
          ok = false, why += " [out differs from the CPU backend at " + std::to_string(i) + "]";
          break;
        }
      }
      for (size_t i = 0; i + 1 < cpu.lse.size(); ++i) {
        const float a = pag.lse[i], b = cpu.lse[i];
        const bool good = std::isinf(b) ? a == b
                                        : std::fabs(double(a) - b) <= 1e-3 + 1e-4 * std::fabs(b);
        if (!good) {
          ok = false, why += " [lse differs from the CPU backend at " + std::to_string(i) + "]";
          break;
        }
      }
    }
    // Two sequences with query rows trade their last pages: the result must change.
    if (paged) {
      int64_t a = -1, b2 = -1;
      for (int64_t b = 0; b < batch; ++b)
        if (c.lens_q[size_t(b)] > 0 && keys[size_t(b)] > 0) (a < 0 ? a : b2) = b;
      if (a >= 0 && b2 >= 0) {
        std::vector<int32_t> swapped = table;
        std::swap(swapped[size_t(a * max_pages + (keys[size_t(a)] - 1) / ps)],
                  swapped[size_t(b2 * max_pages + (keys[size_t(b2)] - 1) / ps)]);
        const Result wrong = call(host, true, swapped);
        if (std::memcmp(wrong.out.data(), con.out.data(), wrong.out.size() * 2) == 0)
          ok = false, why += " [swapped pages gave the same out: the check is blind]";
      } else {
        ok = false, why += " [case needs two sequences with queries and keys]";
      }
    }
    std::printf("%s %s | vs CPU max err %.2e%s\n", ok ? "ok  " : "FAIL", label.c_str(), worst,
                why.c_str());
    return ok;
  });
}

// Device tables are refused by name (the tables are read on the host, as the KV cache's are).
int run_paged_refusals(const Target& t, const Cli& cli) {
  const std::string label = "paged varlen refuses device tables";
  if (t.host || !cli.selected(label)) return 0;
  return run_case(label, [&] {
    const int64_t d = 64;
    Buffer bq(4 * kHeads * d * 2, false), bk(2 * 4 * kHeadsKv * d * 2, false),
        bo(4 * kHeads * d * 2, false), bl(kHeads * 4 * 4, false), bt(8, false), bcu(8, false);
    std::vector<int32_t> cu = {0, 4}, tab = {0}, used = {4};
    bt.upload(tab);
    bcu.upload(cu);
    const auto qv = packed_view(bq, DType::float16, 4, kHeads, d);
    const flashdl::TensorView kv{
        bk.ptr, DType::float16,      bk.device(),
        4,      {2, 4, kHeadsKv, d}, {4 * kHeadsKv * d, kHeadsKv * d, d, 1}};
    const auto ov = packed_view(bo, DType::float16, 4, kHeads, d);
    const flashdl::TensorView lv{bl.ptr, DType::float32, bl.device(), 2, {kHeads, 4}, {4, 1}};
    const auto host_cu = flashdl::make_view(cu.data(), DType::int32, {2});
    const flashdl::TensorView dev_cu{bcu.ptr, DType::int32, bcu.device(), 1, {2}, {1}};
    flashdl::Options o;
    o.stream = t.stream;
    auto refused = [&](const flashdl::TensorView& cq, const flashdl::PagedKv& pk,
                       const char* name) {
      try {
        flashdl::forward_varlen(qv, kv, kv, cq, host_cu, 4, 4, ov, lv, o, pk);
      } catch (const flashdl::Error& e) {
        const bool good = e.kind() == flashdl::ErrorKind::value &&
                          std::string(e.what()).rfind(name, 0) == 0;
        if (!good) std::printf("     unexpected error: %s\n", e.what());
        return good;
      }
      std::printf("     %s on the device was accepted\n", name);
      return false;
    };
    flashdl::PagedKv dev_table, host_table;
    dev_table.block_table = flashdl::TensorView{bt.ptr, DType::int32, bt.device(),
                                                2,      {1, 1},       {1, 1}};
    host_table.block_table = flashdl::make_view(tab.data(), DType::int32, {1, 1});
    const bool ok = refused(host_cu, dev_table, "block_table") &&
                    refused(dev_cu, host_table, "cu_seqlens_q");
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", label.c_str());
    return ok;
  });
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(2024);
  return test_main(argc, argv, [&](const Target& t, const Cli& cli) {
    int failures = 0;
    for (const DType dt : {DType::float16, DType::bfloat16})
      for (const int64_t d : {64, 128})
        for (const Mask& m : kMasks) {
          if (cli.quick && (d != 64 || (dt == DType::bfloat16 && !m.causal))) continue;
          failures += run_case_set(t, cli, dt, d, m, rng);
        }
    // NaN and Inf in the keys of an empty query sequence (1) and of the one-row sequence (3), which
    // the key tiles of sequences 0 and 2 reach into.
    for (const DType dt : {DType::float16, DType::bfloat16})
      for (const Mask& m : kMasks) {
        if (cli.quick && (dt == DType::bfloat16 || !m.causal)) continue;
        failures += run_case_set(t, cli, dt, 64, m, rng, {1, 3});
      }
    const Schedule fa2 = Schedule::fa2, fa1 = Schedule::fa1;
    const DType f16 = DType::float16, bf16 = DType::bfloat16;
    // Chunked prefill: new rows against the keys already in the pages, causal bottom-right; an
    // empty query sequence, one with no keys, pages smaller than a key tile.
    const PagedCase quick{"float16 d=64 pages of 16 causal",
                          f16,
                          64,
                          {17, 0, 30, 1},
                          {40, 9, 70, 0},
                          {},
                          16,
                          true,
                          -1,
                          fa2,
                          0};
    std::vector<PagedCase> paged_cases{quick};
    if (!cli.quick) {
      paged_cases.push_back({"bfloat16 d=128 pages of 256 full",
                             bf16,
                             128,
                             {64, 3, 100},
                             {300, 600, 100},
                             {},
                             256,
                             false,
                             -1,
                             fa2,
                             0});
      paged_cases.push_back({"float16 d=64 pages of 1 window(24,0) fa1",
                             f16,
                             64,
                             {20, 5},
                             {50, 7},
                             {},
                             1,
                             true,
                             24,
                             fa1,
                             0});
      paged_cases.push_back({"bfloat16 d=64 pages of 48 seqused_k causal misaligned",
                             bf16,
                             64,
                             {30, 10, 4},
                             {200, 60, 96},
                             {150, 0, 96},
                             48,
                             true,
                             -1,
                             fa2,
                             3});
      paged_cases.push_back({"float16 d=128 seqused_k only causal",
                             f16,
                             128,
                             {12, 40, 2},
                             {90, 45, 0},
                             {70, 45, 0},
                             0,
                             true,
                             -1,
                             fa2,
                             0});
    }
    for (const PagedCase& c : paged_cases) failures += run_paged_case(t, cli, c, rng);
    failures += run_paged_refusals(t, cli);
    return failures;
  });
}
