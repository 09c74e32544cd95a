// Block-sparse varlen: forward_varlen / backward_varlen with a per-sequence rank-4 mask
// (nseq, nheads, nblocks_q, nblocks_k), nblocks from max_seqlen, give exactly what each sequence
// run alone through forward / backward with its own mask plane gives (blocks counted from the
// sequence's start). Sequences with no queries and with no keys are among them, and max_seqlen
// exceeds every length so the mask has blocks no sequence reaches.
#include <cstdint>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "check.hpp"
#include "flashdl/api.hpp"

using namespace flashdl_test;
using flashdl::Options;
using flashdl::Schedule;
using flashdl::TensorView;

namespace {

constexpr int64_t kH = 4, kHk = 2, kD = 16, kBq = 8, kBk = 6, kMaxQ = 45, kMaxK = 40;
const std::vector<int64_t> kLenQ{23, 0, 40, 9}, kLenK{31, 9, 17, 0};

int64_t nblocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

// Rows [r0, r0 + n) of a packed (total, heads, d) array as a batch-1 (1, n, heads, d) view.
TensorView rows_as_batch1(const Array& a, int64_t r0, int64_t n) {
  const TensorView& t = a.view();
  TensorView v = t;
  v.data = static_cast<unsigned char*>(t.data) +
           r0 * t.strides[0] * static_cast<int64_t>(flashdl::dtype_size(t.dtype));
  v.rank = 4;
  v.shape = {1, n, t.shape[1], t.shape[2]};
  v.strides = {n * t.strides[0], t.strides[0], t.strides[1], t.strides[2]};
  return v;
}

// Plane s of the (nseq, heads, nbq, nbk) mask, cut to the blocks of an sq x sk sequence.
TensorView mask_plane(const Array& mask, int64_t s, int64_t sq, int64_t sk) {
  TensorView v = mask.view();
  v.data = static_cast<unsigned char*>(v.data) + s * v.strides[0];
  v.shape = {1, kH, nblocks(sq, kBq), nblocks(sk, kBk)};
  return v;
}

// Packed values [first, first + count) of `packed` equal `alone` element for element.
bool same_values(const std::vector<double>& packed, int64_t first,
                 const std::vector<double>& alone) {
  for (size_t i = 0; i < alone.size(); ++i)
    if (!(packed[first + i] == alone[i])) return false;
  return true;
}

struct Packed {
  Array q, k, v, dout, out, lse, dq, dk, dv;
};

Packed make_packed(DType dt, int64_t tq, int64_t tk) {
  Packed p{Array(dt, {tq, kH, kD}),  Array(dt, {tk, kHk, kD}, Layout{{1, 0}, 3, -1}),
           Array(dt, {tk, kHk, kD}), Array(dt, {tq, kH, kD}),
           Array(dt, {tq, kH, kD}),  Array(DType::float32, {kH, tq}),
           Array(dt, {tq, kH, kD}),  Array(dt, {tk, kHk, kD}),
           Array(dt, {tk, kHk, kD})};
  Rng rng(static_cast<uint64_t>(tq * 131 + tk));
  p.q.fill_random(rng, 2.0);
  p.k.fill_random(rng, 2.0);
  p.v.fill_random(rng, 1.0);
  p.dout.fill_random(rng, 1.0);
  for (Array* a : {&p.out, &p.lse, &p.dq, &p.dk, &p.dv}) a->poison();
  return p;
}

void check_sequences(const Packed& pk, const Array& mask, const std::vector<int32_t>& cu_q,
                     const std::vector<int32_t>& cu_k, const Options& o) {
  const DType dt = pk.q.dtype();
  const auto out = pk.out.values(), lse = pk.lse.values();
  const auto dq = pk.dq.values(), dk = pk.dk.values(), dv = pk.dv.values();
  const int64_t tq = cu_q.back();
  for (size_t s = 0; s + 1 < cu_q.size(); ++s) {
    const int64_t q0 = cu_q[s], sq = cu_q[s + 1] - q0, k0 = cu_k[s], sk = cu_k[s + 1] - k0;
    Options os = o;
    os.block_mask = mask_plane(mask, static_cast<int64_t>(s), sq, sk);
    Array out1(dt, {1, sq, kH, kD}), lse1(DType::float32, {1, kH, sq});
    Array dq1(dt, {1, sq, kH, kD}), dk1(dt, {1, sk, kHk, kD}), dv1(dt, {1, sk, kHk, kD});
    const TensorView q = rows_as_batch1(pk.q, q0, sq), dout = rows_as_batch1(pk.dout, q0, sq);
    const TensorView k = rows_as_batch1(pk.k, k0, sk), v = rows_as_batch1(pk.v, k0, sk);
    flashdl::forward(q, k, v, out1.view(), lse1.view(), os);
    flashdl::backward(dout, q, k, v, out1.view(), lse1.view(), dq1.view(), dk1.view(), dv1.view(),
                      os);
    const std::string seq = "sequence " + std::to_string(s) + ": ";
    CHECK_MSG(same_values(out, q0 * kH * kD, out1.values()), seq + "out differs");
    CHECK_MSG(same_values(dq, q0 * kH * kD, dq1.values()), seq + "dq differs");
    CHECK_MSG(same_values(dk, k0 * kHk * kD, dk1.values()), seq + "dk differs");
    CHECK_MSG(same_values(dv, k0 * kHk * kD, dv1.values()), seq + "dv differs");
    const std::vector<double> l1 = lse1.values();
    bool lse_same = true;
    for (int64_t h = 0; h < kH; ++h)
      for (int64_t i = 0; i < sq; ++i)
        lse_same = lse_same && lse[h * tq + q0 + i] == l1[h * sq + i];
    CHECK_MSG(lse_same, seq + "lse differs");
  }
}

void test_varlen() {
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (size_t s = 0; s < kLenQ.size(); ++s) {
    cu_q.push_back(static_cast<int32_t>(cu_q.back() + kLenQ[s]));
    cu_k.push_back(static_cast<int32_t>(cu_k.back() + kLenK[s]));
  }
  const auto nseq = static_cast<int64_t>(kLenQ.size());
  const TensorView tcq = flashdl::make_view(cu_q.data(), DType::int32, {nseq + 1});
  const TensorView tck = flashdl::make_view(cu_k.data(), DType::int32, {nseq + 1});
  // Per-sequence planes with padded rows; about 60% of the blocks set.
  Array mask(DType::boolean, {nseq, kH, nblocks(kMaxQ, kBq), nblocks(kMaxK, kBk)},
             Layout{{}, 3, -1});
  Rng rng(77);
  std::vector<double> flags(static_cast<size_t>(mask.numel()));
  for (double& f : flags) f = rng.uniform() < 0.6 ? 1.0 : 0.0;
  mask.assign(flags);
  for (DType dt : {DType::float32, DType::bfloat16, DType::float64})
    for (Schedule sch : {Schedule::fa1, Schedule::fa2, Schedule::reference})
      for (bool causal : {false, true}) {
        context() = std::string("varlen ") + flashdl::schedule_name(sch) + " " +
                    flashdl::dtype_name(dt) + (causal ? " causal" : "");
        Options o;
        o.schedule = sch;
        o.causal = causal;
        o.sram_bytes = sch == Schedule::fa1 ? 1024 : 0;
        o.block_mask = mask.view();
        o.block_size_q = kBq;
        o.block_size_k = kBk;
        Packed pk = make_packed(dt, cu_q.back(), cu_k.back());
        const auto mask0 = mask.byte_copy();
        flashdl::forward_varlen(pk.q.view(), pk.k.view(), pk.v.view(), tcq, tck, kMaxQ, kMaxK,
                                pk.out.view(), pk.lse.view(), o);
        flashdl::backward_varlen(pk.dout.view(), pk.q.view(), pk.k.view(), pk.v.view(),
                                 pk.out.view(), pk.lse.view(), tcq, tck, kMaxQ, kMaxK, pk.dq.view(),
                                 pk.dk.view(), pk.dv.view(), o);
        CHECK_MSG(mask.byte_copy() == mask0, "the mask was written");
        check_sequences(pk, mask, cu_q, cu_k, o);
      }
}

}  // namespace

int main() {
  run_test("block sparse varlen: equals each sequence alone with its plane", test_varlen);
  return finish();
}
