// The CUDA kernels' attention extras (Options::bias with dbias, Options::mask, Options::sinks with
// dsinks; issue 28) against the CPU float64 reference schedule run on the same inputs converted to
// float64, by flash-attn's rule: the CUDA error (max |x - ref|) is at most twice (forward) or
// three times (backward) the error of the CPU fa2 kernel on the same 16-bit inputs, plus one unit
// of the storage type's rounding times max |ref|. Covers fa1, fa2 and deterministic fa2, float16
// and bfloat16, causal and windowed, GQA, bias in float32, float16 and bfloat16, full-size and
// broadcast (size-1 axes, a stride-0 head axis, a transposed view), masks with rows that keep
// nothing, NaN and Inf in K and V at keys only the mask hides, sinks with dsinks, the varlen
// packed layout, and an all-true mask equal to no mask bit for bit on the fa2 shared-memory
// softmax path (FLASHDL_CUDA_FA2_SMEM_SOFTMAX=1, set and unset here), and deterministic=True:
// a full-size dbias repeating bit for bit, a broadcast one summed by a kernel of its own (fa1 and
// fa2; bitwise across runs; oracle cases above). Outputs start as NaN.
// Exit code 77 (skipped) when there is no CUDA device.
// Command line (cli.hpp): --quick, --filter SUBSTR, --no-race, --cpu.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
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
using flashdl::TensorView;

namespace {

// ---- arrays: logical values in double, stored in any dtype and strided layout ----------------------
double load(DType dt, const unsigned char* p) {
  switch (dt) {
    case DType::float16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return fp16_to_float(h);
    }
    case DType::bfloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return bf16_to_float(h);
    }
    case DType::float32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::float64: {
      double f;
      std::memcpy(&f, p, 8);
      return f;
    }
    case DType::boolean: return *p != 0 ? 1.0 : 0.0;
    default: return NAN;
  }
}

void store(DType dt, unsigned char* p, double x) {
  switch (dt) {
    case DType::float16:
    case DType::bfloat16: {
      const uint16_t h = to_bits(float(x), dt);
      std::memcpy(p, &h, 2);
      return;
    }
    case DType::float32: {
      const float f = float(x);
      std::memcpy(p, &f, 4);
      return;
    }
    case DType::float64: std::memcpy(p, &x, 8); return;
    case DType::boolean: *p = x != 0.0 ? 1 : 0; return;
    default: return;
  }
}

// A strided array: the buffer's bytes on the host (for the CPU runs) and a copy on the target.
struct Arr {
  DType dt = DType::float32;
  int rank = 0;
  int64_t shape[4] = {}, strides[4] = {};
  int64_t span = 0;  // elements
  std::vector<unsigned char> host;
  std::unique_ptr<Buffer> dev;

  Arr() = default;
  Arr(DType d, std::vector<int64_t> sh, std::vector<int64_t> st, int64_t sp, bool target_host)
      : dt(d), rank(int(sh.size())), span(sp) {
    for (int a = 0; a < rank; ++a) {
      shape[a] = sh[a];
      strides[a] = st[a];
    }
    const size_t bytes = size_t(span) * flashdl::dtype_size(dt);
    host.assign(bytes, 0xff);  // NaN in every float format; gaps stay so
    dev = std::make_unique<Buffer>(bytes, target_host);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int a = 0; a < rank; ++a) n *= shape[a];
    return n;
  }
  // Offset of logical element e (row-major over shape).
  int64_t offset(int64_t e) const {
    int64_t off = 0;
    for (int a = rank - 1; a >= 0; --a) {
      off += (e % shape[a]) * strides[a];
      e /= shape[a];
    }
    return off;
  }
  void set(int64_t e, double x) { store(dt, host.data() + offset(e) * flashdl::dtype_size(dt), x); }
  double get_host(int64_t e) const {
    return load(dt, host.data() + offset(e) * flashdl::dtype_size(dt));
  }
  void upload() { dev->upload(host); }
  void poison_host() { std::fill(host.begin(), host.end(), 0xff); }
  std::vector<double> values_host() const {
    std::vector<double> v(static_cast<size_t>(numel()), 0.0);
    for (int64_t e = 0; e < numel(); ++e) v[size_t(e)] = get_host(e);
    return v;
  }
  std::vector<double> values_dev() const {
    const auto bytes = dev->download<unsigned char>();
    std::vector<double> v(static_cast<size_t>(numel()), 0.0);
    for (int64_t e = 0; e < numel(); ++e)
      v[size_t(e)] = load(dt, bytes.data() + offset(e) * flashdl::dtype_size(dt));
    return v;
  }
  // ref: the host bytes, for the CPU reference runs; else the target's copy.
  TensorView view(bool ref) const {
    TensorView t;
    t.data = ref ? const_cast<unsigned char*>(host.data()) : dev->ptr;
    t.dtype = dt;
    t.device = ref ? flashdl::Device{} : dev->device();
    t.rank = rank;
    for (int a = 0; a < rank; ++a) {
      t.shape[a] = shape[a];
      t.strides[a] = strides[a];
    }
    return t;
  }
};

Arr contiguous(DType dt, std::vector<int64_t> sh, bool target_host) {
  std::vector<int64_t> st(sh.size());
  int64_t n = 1;
  for (int a = int(sh.size()) - 1; a >= 0; --a) {
    st[size_t(a)] = n;
    n *= sh[size_t(a)];
  }
  return Arr(dt, sh, st, n, target_host);
}

// The same logical values in another dtype (contiguous, host only is enough for the references).
Arr converted(const Arr& a, DType dt) {
  Arr b = contiguous(dt, std::vector<int64_t>(a.shape, a.shape + a.rank), true);
  for (int64_t e = 0; e < a.numel(); ++e) b.set(e, a.get_host(e));
  return b;
}

// ---- cases ------------------------------------------------------------------------------------------
// How the bias (or mask) broadcasts: full (b, h, sq, sk); heads1 (1, h, 1, sk); batch1 (1, 1, sq,
// sk) stored transposed (the key axis outermost); h0: (b, h, sq, sk) with a head stride of 0
// (forward only: dbias needs size-1 axes).
enum class Bcast { none, full, heads1, batch1_transposed, h0 };
const char* bcast_name(Bcast b) {
  switch (b) {
    case Bcast::none: return "none";
    case Bcast::full: return "full";
    case Bcast::heads1: return "(1,h,1,sk)";
    case Bcast::batch1_transposed: return "(1,1,sq,sk)T";
    case Bcast::h0: return "h-stride0";
  }
  return "?";
}

struct Case {
  DType dt;
  Schedule sched;
  bool det;
  int64_t b, sq, sk, h, hk, d;
  bool causal;
  int64_t wl, wr;
  Bcast bias;
  DType bias_dt;
  Bcast mask;
  bool sinks;
  bool backward;
  bool nonfinite;  // NaN / Inf in K and V at keys only the mask hides
};

std::string label_of(const Case& c) {
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%s %s%s b=%lld sq=%lld sk=%lld h=%lld/%lld d=%lld%s%s bias=%s(%s) mask=%s%s%s%s",
                flashdl::dtype_name(c.dt), flashdl::schedule_name(c.sched), c.det ? "(det)" : "",
                (long long)c.b, (long long)c.sq, (long long)c.sk, (long long)c.h, (long long)c.hk,
                (long long)c.d, c.causal ? " causal" : "", c.wl >= 0 ? " window" : "",
                bcast_name(c.bias), flashdl::dtype_name(c.bias_dt), bcast_name(c.mask),
                c.sinks ? " sinks" : "", c.backward ? " bwd" : "", c.nonfinite ? " nonfinite" : "");
  return buf;
}

// The (b, h, sq, sk) array of a bias or mask broadcast as `bc`.
Arr extra_array(Bcast bc, DType dt, const Case& c, bool target_host) {
  switch (bc) {
    case Bcast::full: return contiguous(dt, {c.b, c.h, c.sq, c.sk}, target_host);
    case Bcast::heads1: return contiguous(dt, {1, c.h, 1, c.sk}, target_host);
    case Bcast::batch1_transposed:  // storage (1, 1, sk, sq)
      return Arr(dt, {1, 1, c.sq, c.sk}, {c.sq * c.sk, c.sq * c.sk, 1, c.sq}, c.sq * c.sk,
                 target_host);
    case Bcast::h0:
      return Arr(dt, {c.b, c.h, c.sq, c.sk}, {c.sq * c.sk, 0, c.sk, 1}, c.b * c.sq * c.sk,
                 target_host);
    default: return Arr();
  }
}

struct Errs {
  double err = 0, base = 0, ref_max = 0;
};

bool within(const char* name, const std::vector<double>& got, const std::vector<double>& lowp,
            const std::vector<double>& ref, double factor, double eps, std::string& why) {
  const double e = max_abs_diff(got, ref), b = max_abs_diff(lowp, ref), m = max_abs(ref);
  const double tol = factor * b + eps * (m > 1.0 ? m : 1.0);
  if (e <= tol) return true;
  char buf[200];
  std::snprintf(buf, sizeof buf, " %s: err %.3g > tol %.3g (cpu err %.3g, max|ref| %.3g)", name, e,
                tol, b, m);
  why += buf;
  return false;
}

// lse: rows with -inf in the reference must be -inf; elsewhere within tolerance.
bool lse_ok(const std::vector<double>& got, const std::vector<double>& lowp,
            const std::vector<double>& ref, std::string& why) {
  std::vector<double> g, l, r;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i]) && ref[i] < 0) {
      if (!(std::isinf(got[i]) && got[i] < 0)) {
        why += " lse: an empty row's lse is not -inf";
        return false;
      }
      continue;
    }
    g.push_back(got[i]);
    l.push_back(lowp[i]);
    r.push_back(ref[i]);
  }
  return within("lse", g, l, r, 2.0, 1e-4, why);
}

bool run_one(const Case& c, const Target& t, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(-128, 128);  // multiples of 1/64 in [-2, 2]
  const bool th = t.host;
  Arr q = contiguous(c.dt, {c.b, c.sq, c.h, c.d}, th),
      k = contiguous(c.dt, {c.b, c.sk, c.hk, c.d}, th),
      v = contiguous(c.dt, {c.b, c.sk, c.hk, c.d}, th),
      dout = contiguous(c.dt, {c.b, c.sq, c.h, c.d}, th);
  for (Arr* a : {&q, &k, &v, &dout})
    for (int64_t e = 0; e < a->numel(); ++e) a->set(e, u(rng) / 64.0);
  Arr bias = extra_array(c.bias, c.bias_dt, c, th);
  if (c.bias != Bcast::none) {  // multiples of 1/16 in [-3, 3]: exact in every dtype
    std::uniform_int_distribution<int> ub(-48, 48);
    for (int64_t e = 0; e < bias.numel(); ++e) bias.set(e, ub(rng) / 16.0);
  }
  Arr mask = extra_array(c.mask, DType::boolean, c, th);
  std::vector<int64_t> hidden_keys;  // keys no row sees through the mask (non-finite tests)
  if (c.mask != Bcast::none) {
    const int64_t rows = mask.shape[2], cols = mask.shape[3];
    std::bernoulli_distribution keep(0.6);
    for (int64_t e = 0; e < mask.numel(); ++e) {
      const int64_t i = (e / cols) % rows, j = e % cols;
      bool x = keep(rng);
      if (i % 7 == 3) x = false;                       // rows that keep nothing
      if (j == 5 || (j >= 40 && j < 48)) x = false;    // keys no row keeps
      if (c.sk > 64 && j >= 64 && j < 128) x = false;  // a whole key block hidden: skipped
      mask.set(e, x ? 1.0 : 0.0);
    }
    hidden_keys = {5, 41, 47};
  }
  if (c.nonfinite) {
    for (int64_t b = 0; b < c.b; ++b)
      for (int64_t hk = 0; hk < c.hk; ++hk)
        for (size_t n = 0; n < hidden_keys.size(); ++n) {
          const int64_t j = hidden_keys[n];
          if (j >= c.sk) continue;
          const int64_t base = ((b * c.sk + j) * c.hk + hk) * c.d;
          v.set(base + 0, NAN);
          v.set(base + 1, INFINITY);
          k.set(base + (j % c.d), n % 2 ? -INFINITY : NAN);
        }
  }
  Arr sinks = c.sinks ? contiguous(DType::float32, {c.h}, th) : Arr();
  if (c.sinks)
    for (int64_t h = 0; h < c.h; ++h) sinks.set(h, 0.5 * double(h % 3) - 0.25);
  for (Arr* a : {&q, &k, &v, &dout, &bias, &mask, &sinks})
    if (a->rank > 0) a->upload();

  flashdl::Options o;
  o.causal = c.causal;
  o.window_left = c.wl;
  o.window_right = c.wr;
  o.deterministic = c.det;
  auto with_extras = [&](flashdl::Options x, const Arr* b, const Arr* m, const Arr* s,
                         bool on_host) {
    if (b != nullptr && b->rank > 0) x.bias = b->view(on_host);
    if (m != nullptr && m->rank > 0) x.mask = m->view(on_host);
    if (s != nullptr && s->rank > 0) x.sinks = s->view(on_host);
    return x;
  };

  // float64 reference and the CPU fa2 on the 16-bit inputs.
  Arr q64 = converted(q, DType::float64), k64 = converted(k, DType::float64),
      v64 = converted(v, DType::float64), do64 = converted(dout, DType::float64);
  Arr bias64 = c.bias != Bcast::none ? converted(bias, DType::float64) : Arr();
  Arr mask_c = c.mask != Bcast::none ? converted(mask, DType::boolean) : Arr();
  Arr out64 = contiguous(DType::float64, {c.b, c.sq, c.h, c.d}, true),
      lse64 = contiguous(DType::float32, {c.b, c.h, c.sq}, true);
  flashdl::Options oref = with_extras(o, &bias64, &mask_c, &sinks, true);
  oref.schedule = Schedule::reference;
  flashdl::forward(q64.view(true), k64.view(true), v64.view(true), out64.view(true),
                   lse64.view(true), oref);
  Arr outc = contiguous(c.dt, {c.b, c.sq, c.h, c.d}, true),
      lsec = contiguous(DType::float32, {c.b, c.h, c.sq}, true);
  flashdl::Options ocpu = with_extras(o, &bias, &mask, &sinks, true);
  ocpu.schedule = Schedule::fa2;
  flashdl::forward(q.view(true), k.view(true), v.view(true), outc.view(true), lsec.view(true),
                   ocpu);

  // The call under test.
  Arr out = contiguous(c.dt, {c.b, c.sq, c.h, c.d}, th),
      lse = contiguous(DType::float32, {c.b, c.h, c.sq}, th);
  out.dev->poison();
  lse.dev->poison();
  flashdl::Options ot = with_extras(o, &bias, &mask, &sinks, false);
  ot.schedule = c.sched;
  ot.stream = t.stream;
  flashdl::forward(q.view(false), k.view(false), v.view(false), out.view(false), lse.view(false),
                   ot);
  t.sync();
  std::string why;
  const double eps = c.dt == DType::float16 ? 1.0 / 1024 : 1.0 / 128;
  bool ok = within("out", out.values_dev(), outc.values_host(), out64.values_host(), 2.0, eps, why);
  ok = lse_ok(lse.values_dev(), lsec.values_host(), lse64.values_host(), why) && ok;

  if (c.backward && ok) {
    // The reference's backward takes its own out and lse (float64 out).
    Arr dq64 = contiguous(DType::float64, {c.b, c.sq, c.h, c.d}, true),
        dk64 = contiguous(DType::float64, {c.b, c.sk, c.hk, c.d}, true),
        dv64 = contiguous(DType::float64, {c.b, c.sk, c.hk, c.d}, true);
    Arr dbias64 = c.bias != Bcast::none
                      ? contiguous(DType::float64, std::vector<int64_t>(bias.shape, bias.shape + 4),
                                   true)
                      : Arr();
    Arr dsinks64 = c.sinks ? contiguous(DType::float32, {c.h}, true) : Arr();
    flashdl::Options bref = oref;
    if (dbias64.rank > 0) bref.dbias = dbias64.view(true);
    if (c.sinks) bref.dsinks = dsinks64.view(true);
    flashdl::backward(do64.view(true), q64.view(true), k64.view(true), v64.view(true),
                      out64.view(true), lse64.view(true), dq64.view(true), dk64.view(true),
                      dv64.view(true), bref);
    Arr dqc = contiguous(c.dt, {c.b, c.sq, c.h, c.d}, true),
        dkc = contiguous(c.dt, {c.b, c.sk, c.hk, c.d}, true),
        dvc = contiguous(c.dt, {c.b, c.sk, c.hk, c.d}, true);
    Arr dbiasc = c.bias != Bcast::none
                     ? contiguous(c.bias_dt, std::vector<int64_t>(bias.shape, bias.shape + 4), true)
                     : Arr();
    Arr dsinksc = c.sinks ? contiguous(DType::float32, {c.h}, true) : Arr();
    flashdl::Options bcpu = ocpu;
    if (dbiasc.rank > 0) bcpu.dbias = dbiasc.view(true);
    if (c.sinks) bcpu.dsinks = dsinksc.view(true);
    flashdl::backward(dout.view(true), q.view(true), k.view(true), v.view(true), outc.view(true),
                      lsec.view(true), dqc.view(true), dkc.view(true), dvc.view(true), bcpu);

    Arr dq = contiguous(c.dt, {c.b, c.sq, c.h, c.d}, th),
        dk = contiguous(c.dt, {c.b, c.sk, c.hk, c.d}, th),
        dv = contiguous(c.dt, {c.b, c.sk, c.hk, c.d}, th);
    Arr dbias = c.bias != Bcast::none
                    ? contiguous(c.bias_dt, std::vector<int64_t>(bias.shape, bias.shape + 4), th)
                    : Arr();
    Arr dsinks = c.sinks ? contiguous(DType::float32, {c.h}, th) : Arr();
    for (Arr* a : {&dq, &dk, &dv, &dbias, &dsinks})
      if (a->rank > 0) a->dev->poison();
    flashdl::Options bt = ot;
    if (dbias.rank > 0) bt.dbias = dbias.view(false);
    if (c.sinks) bt.dsinks = dsinks.view(false);
    flashdl::backward(dout.view(false), q.view(false), k.view(false), v.view(false),
                      out.view(false), lse.view(false), dq.view(false), dk.view(false),
                      dv.view(false), bt);
    t.sync();
    ok = within("dq", dq.values_dev(), dqc.values_host(), dq64.values_host(), 3.0, eps, why) && ok;
    ok = within("dk", dk.values_dev(), dkc.values_host(), dk64.values_host(), 3.0, eps, why) && ok;
    ok = within("dv", dv.values_dev(), dvc.values_host(), dv64.values_host(), 3.0, eps, why) && ok;
    if (dbias.rank > 0)
      ok = within("dbias", dbias.values_dev(), dbiasc.values_host(), dbias64.values_host(), 3.0,
                  c.bias_dt == DType::float32 ? eps : 2 * eps, why) &&
           ok;
    if (c.sinks)
      ok = within("dsinks", dsinks.values_dev(), dsinksc.values_host(), dsinks64.values_host(), 3.0,
                  eps, why) &&
           ok;
  }
  std::printf("%s %s%s\n", ok ? "ok  " : "FAIL", label_of(c).c_str(), why.c_str());
  return ok;
}

// An all-true mask gives the results of no mask bit for bit (fa2, shared-memory softmax: the path
// every masked call takes; sinks and bias off).
bool run_all_true(const Target& t, DType dt, bool causal) {
  Case c{dt, Schedule::fa2, false,          2,           70,    150,   4,    2, 64, causal, -1,
         -1, Bcast::none,   DType::float32, Bcast::none, false, false, false};
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> u(-128, 128);
  const bool th = t.host;
  Arr q = contiguous(dt, {c.b, c.sq, c.h, c.d}, th), k = contiguous(dt, {c.b, c.sk, c.hk, c.d}, th),
      v = contiguous(dt, {c.b, c.sk, c.hk, c.d}, th);
  for (Arr* a : {&q, &k, &v}) {
    for (int64_t e = 0; e < a->numel(); ++e) a->set(e, u(rng) / 64.0);
    a->upload();
  }
  Arr mask = contiguous(DType::boolean, {1, c.h, c.sq, c.sk}, th);
  for (int64_t e = 0; e < mask.numel(); ++e) mask.set(e, 1.0);
  mask.upload();
  setenv("FLASHDL_CUDA_FA2_SMEM_SOFTMAX", "1", 1);
  std::vector<double> res[2][2];
  for (int with = 0; with < 2; ++with) {
    Arr out = contiguous(dt, {c.b, c.sq, c.h, c.d}, th),
        lse = contiguous(DType::float32, {c.b, c.h, c.sq}, th);
    out.dev->poison();
    flashdl::Options o;
    o.causal = causal;
    o.schedule = Schedule::fa2;
    o.stream = t.stream;
    if (with) o.mask = mask.view(false);
    flashdl::forward(q.view(false), k.view(false), v.view(false), out.view(false), lse.view(false),
                     o);
    t.sync();
    res[with][0] = out.values_dev();
    res[with][1] = lse.values_dev();
  }
  unsetenv("FLASHDL_CUDA_FA2_SMEM_SOFTMAX");
  const bool ok = std::memcmp(res[0][0].data(), res[1][0].data(), res[0][0].size() * 8) == 0 &&
                  std::memcmp(res[0][1].data(), res[1][1].data(), res[0][1].size() * 8) == 0;
  std::printf("%s all-true mask == no mask bitwise %s%s\n", ok ? "ok  " : "FAIL",
              flashdl::dtype_name(dt), causal ? " causal" : "");
  return ok;
}

// Varlen (one launch for the packed batch): the bias and mask in the packed layout (nheads or 1,
// total_q or 1, max_seqlen_k), row r the packed query row, columns from its sequence's first key;
// cu_seqlens on the device. Against the CPU varlen reference (float64) and fa2, forward and
// backward with dbias and dsinks.
bool run_varlen(const Target& t, DType dt, Schedule sched, bool det, int bias_mode, bool causal,
                uint32_t seed) {
  const std::vector<int32_t> lq = {17, 0, 100, 1, 60}, lk = {40, 9, 100, 130, 70};
  std::vector<int32_t> cq(1, 0), ck(1, 0);
  for (size_t i = 0; i < lq.size(); ++i) {
    cq.push_back(cq.back() + lq[i]);
    ck.push_back(ck.back() + lk[i]);
  }
  const int64_t tq = cq.back(), tk = ck.back(), h = 4, hk = 2, d = 64, msq = 100, msk = 130;
  const bool th = t.host;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(-128, 128);
  Arr q = contiguous(dt, {tq, h, d}, th), k = contiguous(dt, {tk, hk, d}, th),
      v = contiguous(dt, {tk, hk, d}, th), dout = contiguous(dt, {tq, h, d}, th);
  for (Arr* a : {&q, &k, &v, &dout})
    for (int64_t e = 0; e < a->numel(); ++e) a->set(e, u(rng) / 64.0);
  // bias_mode 0: (h, 1, msk) float32; 1: (1, tq, msk) bfloat16; 2: (h, tq, msk) float16 (full).
  Arr bias = bias_mode == 0   ? contiguous(DType::float32, {h, 1, msk}, th)
             : bias_mode == 1 ? contiguous(DType::bfloat16, {1, tq, msk}, th)
                              : contiguous(DType::float16, {h, tq, msk}, th);
  std::uniform_int_distribution<int> ub(-48, 48);
  for (int64_t e = 0; e < bias.numel(); ++e) bias.set(e, ub(rng) / 16.0);
  Arr mask = contiguous(DType::boolean, {h, tq, msk}, th);
  std::bernoulli_distribution keep(0.7);
  for (int64_t e = 0; e < mask.numel(); ++e) {
    const int64_t r = (e / msk) % tq;
    mask.set(e, (r % 11 != 4 && keep(rng)) ? 1.0 : 0.0);
  }
  Arr sinks = contiguous(DType::float32, {h}, th);
  for (int64_t i = 0; i < h; ++i) sinks.set(i, 0.3 * double(i) - 0.4);
  Arr cuq = contiguous(DType::int32, {int64_t(cq.size())}, th),
      cuk = contiguous(DType::int32, {int64_t(ck.size())}, th);
  std::memcpy(cuq.host.data(), cq.data(), cq.size() * 4);
  std::memcpy(cuk.host.data(), ck.data(), ck.size() * 4);
  for (Arr* a : {&q, &k, &v, &dout, &bias, &mask, &sinks, &cuq, &cuk}) a->upload();

  flashdl::Options o;
  o.causal = causal;
  o.deterministic = det;
  auto with = [&](flashdl::Options x, const Arr& b, bool on_host) {
    x.bias = b.view(on_host);
    x.mask = mask.view(on_host);
    x.sinks = sinks.view(on_host);
    return x;
  };
  struct Run {
    Arr out, lse, dq, dk, dv, dbias, dsinks;
  };
  auto run = [&](DType rdt, Schedule s, bool ref, const Arr& qq, const Arr& kk, const Arr& vv,
                 const Arr& dd, const Arr& bb) {
    Run r{contiguous(rdt, {tq, h, d}, ref || th),
          contiguous(DType::float32, {h, tq}, ref || th),
          contiguous(rdt, {tq, h, d}, ref || th),
          contiguous(rdt, {tk, hk, d}, ref || th),
          contiguous(rdt, {tk, hk, d}, ref || th),
          contiguous(bb.dt, std::vector<int64_t>(bb.shape, bb.shape + 3), ref || th),
          contiguous(DType::float32, {h}, ref || th)};
    if (!ref)
      for (Arr* a : {&r.out, &r.lse, &r.dq, &r.dk, &r.dv, &r.dbias, &r.dsinks}) a->dev->poison();
    flashdl::Options x = with(o, bb, ref);
    x.schedule = s;
    x.stream = ref ? nullptr : t.stream;
    flashdl::forward_varlen(qq.view(ref), kk.view(ref), vv.view(ref), cuq.view(ref), cuk.view(ref),
                            msq, msk, r.out.view(ref), r.lse.view(ref), x);
    x.dbias = r.dbias.view(ref);
    x.dsinks = r.dsinks.view(ref);
    flashdl::backward_varlen(dd.view(ref), qq.view(ref), kk.view(ref), vv.view(ref),
                             r.out.view(ref), r.lse.view(ref), cuq.view(ref), cuk.view(ref), msq,
                             msk, r.dq.view(ref), r.dk.view(ref), r.dv.view(ref), x);
    return r;
  };
  Arr q64 = converted(q, DType::float64), k64 = converted(k, DType::float64),
      v64 = converted(v, DType::float64), do64 = converted(dout, DType::float64),
      b64 = converted(bias, DType::float64);
  Run ref = run(DType::float64, Schedule::reference, true, q64, k64, v64, do64, b64);
  Run cpu = run(dt, Schedule::fa2, true, q, k, v, dout, bias);
  Run got = run(dt, sched, false, q, k, v, dout, bias);
  t.sync();
  const double eps = dt == DType::float16 ? 1.0 / 1024 : 1.0 / 128;
  std::string why;
  auto host_vals = [](const Arr& a) { return a.values_host(); };
  bool ok = within("out", got.out.values_dev(), host_vals(cpu.out), host_vals(ref.out), 2.0, eps,
                   why);
  ok = lse_ok(got.lse.values_dev(), host_vals(cpu.lse), host_vals(ref.lse), why) && ok;
  ok = within("dq", got.dq.values_dev(), host_vals(cpu.dq), host_vals(ref.dq), 3.0, eps, why) && ok;
  ok = within("dk", got.dk.values_dev(), host_vals(cpu.dk), host_vals(ref.dk), 3.0, eps, why) && ok;
  ok = within("dv", got.dv.values_dev(), host_vals(cpu.dv), host_vals(ref.dv), 3.0, eps, why) && ok;
  ok = within("dbias", got.dbias.values_dev(), host_vals(cpu.dbias), host_vals(ref.dbias), 3.0,
              2 * eps, why) &&
       ok;
  ok = within("dsinks", got.dsinks.values_dev(), host_vals(cpu.dsinks), host_vals(ref.dsinks), 3.0,
              eps, why) &&
       ok;
  std::printf("%s varlen %s %s%s bias=%s%s%s\n", ok ? "ok  " : "FAIL", flashdl::dtype_name(dt),
              flashdl::schedule_name(sched), det ? "(det)" : "",
              bias_mode == 0   ? "(h,1,msk)"
              : bias_mode == 1 ? "(1,tq,msk)bf16"
                               : "(h,tq,msk)f16",
              causal ? " causal" : "", why.c_str());
  return ok;
}

// deterministic=True: with a full-size bias, dbias and dsinks repeat bit for bit; with a bias
// broadcast over the batch, heads and rows, fa1's and fa2's dbias (a kernel of its own,
// fa2_dbias.cuh) repeat bit for bit and equal the non-deterministic sum (atomics) within float32
// rounding.
bool run_determinism(const Target& t) {
  const bool th = t.host;
  const int64_t b = 1, sq = 40, sk = 90, h = 2, hk = 1, d = 32;
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> u(-128, 128);
  Arr q = contiguous(DType::float16, {b, sq, h, d}, th),
      k = contiguous(DType::float16, {b, sk, hk, d}, th),
      v = contiguous(DType::float16, {b, sk, hk, d}, th),
      dout = contiguous(DType::float16, {b, sq, h, d}, th);
  Arr full = contiguous(DType::float32, {b, h, sq, sk}, th),
      small = contiguous(DType::float32, {1, h, 1, sk}, th);
  Arr sinks = contiguous(DType::float32, {h}, th);
  for (Arr* a : {&q, &k, &v, &dout, &full, &small, &sinks}) {
    for (int64_t e = 0; e < a->numel(); ++e) a->set(e, u(rng) / 64.0);
    a->upload();
  }
  Arr out = contiguous(DType::float16, {b, sq, h, d}, th),
      lse = contiguous(DType::float32, {b, h, sq}, th);
  flashdl::Options o;
  o.schedule = Schedule::fa2;
  o.deterministic = true;
  o.stream = t.stream;
  o.sinks = sinks.view(false);
  bool ok = true;
  std::string why;
  auto broadcast_dbias = [&](Schedule sched, bool det) {
    flashdl::Options x = o;
    x.schedule = sched;
    x.deterministic = det;
    x.bias = small.view(false);
    flashdl::forward(q.view(false), k.view(false), v.view(false), out.view(false), lse.view(false),
                     x);
    t.sync();
    Arr dq = contiguous(DType::float16, {b, sq, h, d}, th),
        dk = contiguous(DType::float16, {b, sk, hk, d}, th),
        dv = contiguous(DType::float16, {b, sk, hk, d}, th),
        db = contiguous(DType::float32, {1, h, 1, sk}, th);
    x.dbias = db.view(false);
    flashdl::backward(dout.view(false), q.view(false), k.view(false), v.view(false),
                      out.view(false), lse.view(false), dq.view(false), dk.view(false),
                      dv.view(false), x);
    t.sync();
    return db.values_dev();
  };
  // A broadcast bias: fa1 and fa2 leave dbias to a kernel of its own (fa2_dbias.cuh), bitwise
  // across runs and the atomics' sum within rounding.
  for (const Schedule sched : {Schedule::fa1, Schedule::fa2}) {
    const std::string name = flashdl::schedule_name(sched);
    const std::vector<double> a = broadcast_dbias(sched, true), c = broadcast_dbias(sched, true),
                              atomics = broadcast_dbias(sched, false);
    if (std::memcmp(a.data(), c.data(), a.size() * 8) != 0) {
      ok = false;
      why += " " + name + "'s broadcast dbias differs between two deterministic runs";
    }
    const double err = max_abs_diff(a, atomics), scale = max_abs(atomics);
    if (!(err <= 1e-5 * scale + 1e-6) || !(scale > 0)) {
      ok = false;
      why += " " + name + "'s deterministic broadcast dbias is off the atomic sum by " +
             std::to_string(err) + " (max |dbias| " + std::to_string(scale) + ")";
    }
  }
  std::vector<double> first[2];
  for (int rep = 0; rep < 2; ++rep) {
    flashdl::Options x = o;
    x.bias = full.view(false);
    flashdl::forward(q.view(false), k.view(false), v.view(false), out.view(false), lse.view(false),
                     x);
    Arr dq = contiguous(DType::float16, {b, sq, h, d}, th),
        dk = contiguous(DType::float16, {b, sk, hk, d}, th),
        dv = contiguous(DType::float16, {b, sk, hk, d}, th),
        db = contiguous(DType::float32, {b, h, sq, sk}, th),
        ds = contiguous(DType::float32, {h}, th);
    x.dbias = db.view(false);
    x.dsinks = ds.view(false);
    flashdl::backward(dout.view(false), q.view(false), k.view(false), v.view(false),
                      out.view(false), lse.view(false), dq.view(false), dk.view(false),
                      dv.view(false), x);
    t.sync();
    const auto a = db.values_dev(), c = ds.values_dev();
    if (rep == 0) {
      first[0] = a;
      first[1] = c;
    } else if (std::memcmp(a.data(), first[0].data(), a.size() * 8) != 0 ||
               std::memcmp(c.data(), first[1].data(), c.size() * 8) != 0) {
      ok = false;
      why += " dbias or dsinks differ between two deterministic runs";
    }
  }
  std::printf("%s deterministic dbias/dsinks%s\n", ok ? "ok  " : "FAIL", why.c_str());
  return ok;
}

// Batch 0: nothing to compute, but dsinks and a dbias broadcast over the batch are written (zeros).
bool run_batch0(const Target& t) {
  const bool th = t.host;
  const int64_t sq = 9, sk = 12, h = 2, d = 32;
  Arr q = contiguous(DType::bfloat16, {0, sq, h, d}, th),
      k = contiguous(DType::bfloat16, {0, sk, h, d}, th),
      v = contiguous(DType::bfloat16, {0, sk, h, d}, th),
      o = contiguous(DType::bfloat16, {0, sq, h, d}, th),
      lse = contiguous(DType::float32, {0, h, sq}, th);
  Arr bias = contiguous(DType::float16, {1, h, sq, sk}, th),
      dbias = contiguous(DType::float16, {1, h, sq, sk}, th);
  Arr sinks = contiguous(DType::float32, {h}, th), dsinks = contiguous(DType::float32, {h}, th);
  for (int64_t e = 0; e < bias.numel(); ++e) bias.set(e, 0.5);
  for (int64_t e = 0; e < h; ++e) sinks.set(e, 1.0);
  bias.upload();
  sinks.upload();
  dbias.dev->poison();
  dsinks.dev->poison();
  flashdl::Options x;
  x.schedule = Schedule::fa2;
  x.stream = t.stream;
  x.bias = bias.view(false);
  x.dbias = dbias.view(false);
  x.sinks = sinks.view(false);
  x.dsinks = dsinks.view(false);
  flashdl::backward(o.view(false), q.view(false), k.view(false), v.view(false), o.view(false),
                    lse.view(false), q.view(false), k.view(false), v.view(false), x);
  t.sync();
  bool ok = true;
  for (double z : dbias.values_dev()) ok = ok && z == 0.0;
  for (double z : dsinks.values_dev()) ok = ok && z == 0.0;
  std::printf("%s batch 0: dbias and dsinks zero\n", ok ? "ok  " : "FAIL");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  return test_main(argc, argv, [&](const Target& t, const Cli& cli) {
    std::vector<Case> cases;
    const DType f16 = DType::float16, bf16 = DType::bfloat16, f32 = DType::float32;
    // The quick set: one case per feature and kernel.
    cases.push_back({f16, Schedule::fa2, false, 2, 70, 150, 4, 2, 64, false, -1, -1, Bcast::none,
                     f32, Bcast::none, true, true, false});
    cases.push_back({bf16, Schedule::fa1, false, 2, 70, 150, 4, 2, 64, true, -1, -1, Bcast::none,
                     f32, Bcast::none, true, true, false});
    cases.push_back({f16, Schedule::fa2, false, 2, 70, 150, 4, 2, 64, false, -1, -1, Bcast::full,
                     f16, Bcast::none, false, false, false});
    cases.push_back({bf16, Schedule::fa2, false, 2, 70, 150, 4, 2, 64, true, -1, -1, Bcast::heads1,
                     f32, Bcast::full, true, false, false});
    cases.push_back({f16, Schedule::fa1, false, 2, 70, 150, 4, 2, 64, false, 30, 10,
                     Bcast::batch1_transposed, bf16, Bcast::heads1, false, false, false});
    cases.push_back({f16, Schedule::fa2, false, 2, 70, 150, 4, 2, 64, false, -1, -1, Bcast::h0, f32,
                     Bcast::full, false, false, true});
    cases.push_back({bf16, Schedule::fa1, false, 1, 40, 150, 2, 1, 64, false, -1, -1, Bcast::none,
                     f32, Bcast::full, false, false, true});
    // Backward with dbias: full-size (direct: each element once, deterministic too) and broadcast
    // (atomics into the float32 accumulator), with masks, sinks and NaN at hidden keys.
    cases.push_back({f16, Schedule::fa2, false, 2, 70, 150, 4, 2, 64, false, -1, -1, Bcast::full,
                     f32, Bcast::full, true, true, false});
    cases.push_back({bf16, Schedule::fa2, true, 2, 70, 150, 4, 2, 64, true, -1, -1, Bcast::full,
                     bf16, Bcast::heads1, false, true, false});
    cases.push_back({f16, Schedule::fa2, false, 2, 70, 150, 4, 2, 64, false, 30, 10, Bcast::heads1,
                     f16, Bcast::none, false, true, false});
    cases.push_back({bf16, Schedule::fa1, false, 2, 70, 150, 4, 2, 64, false, -1, -1,
                     Bcast::batch1_transposed, f32, Bcast::full, true, true, true});
    cases.push_back({f16, Schedule::fa2, true, 1, 40, 150, 2, 1, 64, false, -1, -1, Bcast::none,
                     f32, Bcast::full, false, true, true});
    // deterministic=True with a broadcast bias: dbias by fa2's own kernel (fa2_dbias.cuh)
    cases.push_back({f16, Schedule::fa2, true, 2, 70, 150, 4, 2, 64, true, -1, -1, Bcast::heads1,
                     f32, Bcast::full, true, true, false});
    cases.push_back({bf16, Schedule::fa2, true, 2, 70, 150, 4, 2, 64, false, 30, 10,
                     Bcast::batch1_transposed, bf16, Bcast::none, false, true, true});
    cases.push_back({bf16, Schedule::fa1, true, 2, 70, 150, 4, 2, 64, true, -1, -1, Bcast::heads1,
                     f32, Bcast::full, true, true, false});
    if (!cli.quick) {
      for (Schedule s : {Schedule::fa1, Schedule::fa2})
        for (DType dt : {f16, bf16})
          for (Bcast m : {Bcast::none, Bcast::full, Bcast::batch1_transposed})
            cases.push_back({dt, s, false, 2, 100, 200, 4, 1, 128, true, -1, -1, Bcast::full, dt, m,
                             true, true, false});
      for (bool det : {false, true})
        cases.push_back({f16, Schedule::fa2, det, 2, 129, 257, 4, 4, 96, false, 50, 50, Bcast::full,
                         f32, Bcast::heads1, true, true, true});
      cases.push_back({bf16, Schedule::fa1, false, 3, 129, 90, 6, 2, 32, true, -1, -1,
                       Bcast::heads1, bf16, Bcast::batch1_transposed, true, true, false});
      cases.push_back({f16, Schedule::fa2, true, 2, 100, 200, 4, 1, 128, false, -1, -1,
                       Bcast::heads1, f16, Bcast::heads1, true, true, false});
      cases.push_back({bf16, Schedule::fa2, true, 3, 129, 90, 6, 2, 256, true, -1, -1,
                       Bcast::heads1, f32, Bcast::batch1_transposed, false, true, false});
    }
    int failures = 0;
    uint32_t seed = 1;
    for (const Case& c : cases) {
      const std::string label = label_of(c);
      ++seed;
      if (!cli.selected(label)) continue;
      failures += run_case(label, [&] { return run_one(c, t, seed); });
    }
    struct V {
      DType dt;
      Schedule s;
      bool det;
      int bias;
      bool causal;
    };
    std::vector<V> vcases = {{f16, Schedule::fa2, false, 0, true},
                             {bf16, Schedule::fa1, false, 1, false},
                             {f16, Schedule::fa2, true, 2, true},
                             {bf16, Schedule::fa2, true, 0, false}};
    if (!cli.quick) {
      vcases.push_back({bf16, Schedule::fa2, false, 1, false});
      vcases.push_back({f16, Schedule::fa1, false, 0, true});
      vcases.push_back({bf16, Schedule::fa2, false, 2, false});
      vcases.push_back({f16, Schedule::fa2, true, 1, true});
    }
    for (const V& vc : vcases) {
      const std::string label = std::string("varlen ") + flashdl::dtype_name(vc.dt) + " " +
                                flashdl::schedule_name(vc.s) + (vc.det ? "(det)" : "") +
                                (vc.bias == 0   ? " bias(h,1,msk)"
                                 : vc.bias == 1 ? " bias(1,tq,msk)"
                                                : " bias(h,tq,msk)") +
                                (vc.causal ? " causal" : "");
      ++seed;
      if (!cli.selected(label)) continue;
      failures += run_case(label, [&] {
        return run_varlen(t, vc.dt, vc.s, vc.det, vc.bias, vc.causal, seed);
      });
    }
    if (cli.selected("batch 0")) failures += run_case("batch 0", [&] { return run_batch0(t); });
    if (!t.host && cli.selected("deterministic"))
      failures += run_case("deterministic dbias/dsinks", [&] { return run_determinism(t); });
    if (!t.host && cli.selected("all-true")) {
      failures += run_case("all-true f16", [&] { return run_all_true(t, f16, false); });
      failures += run_case("all-true bf16 causal", [&] { return run_all_true(t, bf16, true); });
    }
    return failures;
  });
}
