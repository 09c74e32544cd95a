// The XLA FFI handlers (python/xla_ffi.cpp) driven by hand-built call frames, as XLA builds them:
// the registration-time metadata query, results equal to the core's own call (leading axes folded
// into the batch, as jax.vmap hands them over), attributes of every scalar kind, and errors
// returned through the API's error constructor with the core's message, outputs untouched.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "flashdl/api.hpp"
#include "xla_ffi.hpp"

using namespace flashdl_test;
namespace A = flashdl::xla_abi;

namespace {

// The fake XLA: error_create records the last error; a distinct non-null pointer stands for it.
struct Recorded {
  int calls = 0;
  A::ErrorCode code = A::kOk;
  std::string message;
} g_error;
char g_error_token;

A::FfiError* record_error(A::ErrorCreateArgs* args) {
  ++g_error.calls;
  g_error.code = args->errc;
  g_error.message = args->message;
  return reinterpret_cast<A::FfiError*>(&g_error_token);
}

A::Api fake_api() {
  A::Api api{};
  api.struct_size = sizeof(A::Api);
  api.error_create = record_error;
  return api;
}

A::Handler* handler(const char* name) {
  for (const auto& t : flashdl::xla_ffi::targets())
    if (std::strcmp(t.name, name) == 0 && std::strcmp(t.platform, "cpu") == 0) return t.handler;
  return nullptr;
}

// One buffer of float32 values with its XLA descriptor.
struct Buf {
  std::vector<int64_t> dims;
  std::vector<float> values;
  A::Buffer desc{};
  Buf(std::vector<int64_t> d, uint32_t seed) : dims(std::move(d)) {
    int64_t n = 1;
    for (int64_t x : dims) n *= x;
    values.resize(static_cast<size_t>(n));
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist;
    for (float& x : values) x = seed ? dist(rng) : std::numeric_limits<float>::quiet_NaN();
    desc = {A::kBufferSize, nullptr, A::kF32, values.data(), static_cast<int64_t>(dims.size()),
            dims.data()};
  }
};

// Attributes, kept sorted by name as XLA sorts them.
struct Attrs {
  struct Entry {
    std::string name;
    A::AttrType type;
    A::Scalar scalar;
    A::ByteSpan text;
    bool b;
    int64_t i;
    int32_t i32;
    double d;
    float f;
    A::ByteSpan span;
  };
  std::vector<Entry> entries;
  std::vector<A::AttrType> types;
  std::vector<A::ByteSpan*> names;
  std::vector<void*> ptrs;

  Attrs& flag(const std::string& n, bool v) {
    return add(n, [&](Entry& e) {
      e.b = v;
      e.scalar = {A::kPred, nullptr};
    });
  }
  Attrs& i64(const std::string& n, int64_t v) {
    return add(n, [&](Entry& e) {
      e.i = v;
      e.scalar = {A::kS64, nullptr};
    });
  }
  Attrs& i32(const std::string& n, int32_t v) {
    return add(n, [&](Entry& e) {
      e.i32 = v;
      e.scalar = {A::kS32, nullptr};
    });
  }
  Attrs& f64(const std::string& n, double v) {
    return add(n, [&](Entry& e) {
      e.d = v;
      e.scalar = {A::kF64, nullptr};
    });
  }
  Attrs& f32(const std::string& n, float v) {
    return add(n, [&](Entry& e) {
      e.f = v;
      e.scalar = {A::kF32, nullptr};
    });
  }
  Attrs& str(const std::string& n, const char* v) {
    return add(n, [&](Entry& e) {
      e.type = A::kAttrString;
      e.text = {v, std::strlen(v)};
    });
  }

  template <typename F>
  Attrs& add(const std::string& n, F fill) {
    Entry e{};
    e.name = n;
    e.type = A::kAttrScalar;
    fill(e);
    entries.push_back(e);
    return *this;
  }

  A::Attrs build() {
    std::sort(entries.begin(), entries.end(),
              [](const Entry& a, const Entry& b) { return a.name < b.name; });
    types.clear(), names.clear(), ptrs.clear();
    for (Entry& e : entries) {
      e.span = {e.name.data(), e.name.size()};
      types.push_back(e.type);
      names.push_back(&e.span);
      if (e.type == A::kAttrString) {
        ptrs.push_back(&e.text);
        continue;
      }
      switch (e.scalar.dtype) {
        case A::kPred: e.scalar.value = &e.b; break;
        case A::kS64: e.scalar.value = &e.i; break;
        case A::kS32: e.scalar.value = &e.i32; break;
        case A::kF64: e.scalar.value = &e.d; break;
        default: e.scalar.value = &e.f; break;
      }
      ptrs.push_back(&e.scalar);
    }
    return {sizeof(A::Attrs), nullptr,      static_cast<int64_t>(entries.size()),
            types.data(),     names.data(), ptrs.data()};
  }
};

Attrs default_attrs(bool causal) {
  Attrs a;
  a.flag("causal", causal).f64("softmax_scale", std::nan("")).i64("window_left", -1);
  a.i64("window_right", -1).str("schedule", "fa2").f64("softcap", 0.0);
  return a;
}

// Calls `h` with the buffers and attributes as XLA would; returns its (possibly null) error.
A::FfiError* call(A::Handler* h, std::vector<Buf*> args, std::vector<Buf*> rets, Attrs& attrs,
                  A::ExecutionStage stage = A::kExecute) {
  static A::Api api = fake_api();
  std::vector<A::ArgType> at(args.size(), A::kArgBuffer);
  std::vector<A::RetType> rt(rets.size(), A::kRetBuffer);
  std::vector<void*> ap, rp;
  for (Buf* b : args) ap.push_back(&b->desc);
  for (Buf* b : rets) rp.push_back(&b->desc);
  A::CallFrame cf{};
  cf.struct_size = A::kCallFrameSize;
  cf.api = &api;
  cf.stage = stage;
  cf.args = {sizeof(A::Args), nullptr, static_cast<int64_t>(ap.size()), at.data(), ap.data()};
  cf.rets = {sizeof(A::Rets), nullptr, static_cast<int64_t>(rp.size()), rt.data(), rp.data()};
  cf.attrs = attrs.build();
  g_error = Recorded{};
  return h(&cf);
}

flashdl::TensorView view(Buf& b, std::vector<int64_t> shape) {
  flashdl::TensorView t;
  t.data = b.values.data();
  t.rank = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = stride;
    stride *= shape[i];
  }
  return t;
}

bool all_nan(const Buf& b) {
  for (float x : b.values)
    if (!std::isnan(x)) return false;
  return true;
}

void test_metadata_query() {
  for (const auto& t : flashdl::xla_ffi::targets()) {
    A::Metadata md{};
    md.struct_size = A::kMetadataSize;
    A::MetadataExtension ext{{A::kMetadataExtensionSize, A::kExtensionMetadata, nullptr}, &md};
    A::CallFrame cf{};
    cf.struct_size = A::kCallFrameSize;
    cf.extension_start = &ext.extension_base;  // api is null in this query, as XLA sends it
    context() = t.name;
    CHECK(t.handler(&cf) == nullptr);
    CHECK_EQ(md.api_version.major_version, A::kApiMajor);
    CHECK_EQ(md.api_version.minor_version, A::kApiMinor);
    CHECK_EQ(md.api_version.struct_size, A::kApiVersionSize);
    CHECK_EQ(md.traits, 0u);
  }
  CHECK(handler("flashdl_attention_fwd") && handler("flashdl_attention_bwd") &&
        handler("flashdl_attention_varlen_fwd") && handler("flashdl_attention_varlen_bwd"));
}

// A rank-5 call (a vmapped axis of 2 over batch 3) equals the core's rank-4 call on batch 6.
void test_forward_and_backward_fold_leading_axes() {
  Buf q({2, 3, 9, 4, 16}, 1), k({2, 3, 7, 2, 16}, 2), v({2, 3, 7, 2, 16}, 3);
  Buf out({2, 3, 9, 4, 16}, 0), lse({2, 3, 4, 9}, 0);
  Attrs a = default_attrs(true);
  CHECK(call(handler("flashdl_attention_fwd"), {&q, &k, &v}, {&out, &lse}, a) == nullptr);
  CHECK_EQ(g_error.calls, 0);
  Buf out_ref({6, 9, 4, 16}, 0), lse_ref({6, 4, 9}, 0);
  flashdl::Options o;
  o.causal = true;
  o.schedule = flashdl::Schedule::fa2;
  flashdl::forward(view(q, {6, 9, 4, 16}), view(k, {6, 7, 2, 16}), view(v, {6, 7, 2, 16}),
                   view(out_ref, {6, 9, 4, 16}), view(lse_ref, {6, 4, 9}), o);
  CHECK(out.values == out_ref.values);
  CHECK(lse.values == lse_ref.values);

  Buf dout({2, 3, 9, 4, 16}, 4), dq({2, 3, 9, 4, 16}, 0), dk({2, 3, 7, 2, 16}, 0),
      dv({2, 3, 7, 2, 16}, 0);
  Attrs b = default_attrs(true);
  b.flag("deterministic", false);
  CHECK(call(handler("flashdl_attention_bwd"), {&dout, &q, &k, &v, &out, &lse}, {&dq, &dk, &dv},
             b) == nullptr);
  Buf dq_ref({6, 9, 4, 16}, 0), dk_ref({6, 7, 2, 16}, 0), dv_ref({6, 7, 2, 16}, 0);
  flashdl::backward(view(dout, {6, 9, 4, 16}), view(q, {6, 9, 4, 16}), view(k, {6, 7, 2, 16}),
                    view(v, {6, 7, 2, 16}), view(out, {6, 9, 4, 16}), view(lse, {6, 4, 9}),
                    view(dq_ref, {6, 9, 4, 16}), view(dk_ref, {6, 7, 2, 16}),
                    view(dv_ref, {6, 7, 2, 16}), o);
  CHECK(dq.values == dq_ref.values && dk.values == dk_ref.values && dv.values == dv_ref.values);
}

// Integer and float attributes of any width XLA may pick; a scale that reaches the kernel.
void test_attribute_kinds() {
  Buf q({1, 5, 2, 8}, 5), k({1, 6, 2, 8}, 6), v({1, 6, 2, 8}, 7);
  Buf o1({1, 5, 2, 8}, 0), l1({1, 2, 5}, 0), o2({1, 5, 2, 8}, 0), l2({1, 2, 5}, 0);
  Attrs a;
  a.i32("causal", 1).f32("softmax_scale", 0.25f).i32("window_left", 2).i32("window_right", -1);
  a.str("schedule", "fa1").f32("softcap", 0.0f);
  CHECK(call(handler("flashdl_attention_fwd"), {&q, &k, &v}, {&o1, &l1}, a) == nullptr);
  Attrs b;
  b.flag("causal", true).f64("softmax_scale", 0.25).i64("window_left", 2).i64("window_right", -1);
  b.str("schedule", "fa1").f64("softcap", 0.0);
  CHECK(call(handler("flashdl_attention_fwd"), {&q, &k, &v}, {&o2, &l2}, b) == nullptr);
  CHECK(o1.values == o2.values && l1.values == l2.values);
  Attrs c = default_attrs(true);  // default scale 1/sqrt(8) differs from 0.25
  CHECK(call(handler("flashdl_attention_fwd"), {&q, &k, &v}, {&o2, &l2}, c) == nullptr);
  CHECK(o1.values != o2.values);
}

void expect_error(const char* what, A::FfiError* err, A::ErrorCode code, const std::string& starts,
                  const Buf& untouched) {
  context() = what;
  CHECK(err != nullptr);
  CHECK_EQ(g_error.calls, 1);
  CHECK_EQ(static_cast<int>(g_error.code), static_cast<int>(code));
  CHECK_MSG(g_error.message.rfind(starts, 0) == 0, g_error.message);
  CHECK(all_nan(untouched));
}

void test_errors_come_back_through_the_api() {
  Buf q({1, 5, 2, 8}, 5), k({1, 6, 2, 4}, 6), v({1, 6, 2, 8}, 7), k_ok({1, 6, 2, 8}, 6);
  Buf out({1, 5, 2, 8}, 0), lse({1, 2, 5}, 0);
  Attrs a = default_attrs(false);
  expect_error("headdim", call(handler("flashdl_attention_fwd"), {&q, &k, &v}, {&out, &lse}, a),
               A::kInvalidArgument, "k:", out);
  Attrs missing;
  missing.flag("causal", false).str("schedule", "fa2");
  expect_error("missing attribute",
               call(handler("flashdl_attention_fwd"), {&q, &k_ok, &v}, {&out, &lse}, missing),
               A::kInvalidArgument, "softmax_scale:", out);
  Attrs wrong_kind = default_attrs(false);
  wrong_kind.entries[0].type = A::kAttrString;  // "causal" sorts first
  expect_error("attribute kind",
               call(handler("flashdl_attention_fwd"), {&q, &k_ok, &v}, {&out, &lse}, wrong_kind),
               A::kInvalidArgument, "causal:", out);
  Attrs bad_schedule = default_attrs(false);
  for (auto& e : bad_schedule.entries)
    if (e.name == "schedule") e.text = {"fa3", 3};
  expect_error("schedule",
               call(handler("flashdl_attention_fwd"), {&q, &k_ok, &v}, {&out, &lse}, bad_schedule),
               A::kInvalidArgument, "schedule:", out);
  Attrs ok = default_attrs(false);
  expect_error("too few results",
               call(handler("flashdl_attention_fwd"), {&q, &k_ok, &v}, {&out}, ok),
               A::kInvalidArgument, "lse:", out);
  // Stages other than execute do nothing.
  CHECK(call(handler("flashdl_attention_fwd"), {&q, &k_ok, &v}, {&out, &lse}, ok, A::kPrepare) ==
        nullptr);
  CHECK(all_nan(out));
}

void test_varlen() {
  // sequences of 3 and 5 queries over 4 and 6 keys; int32 offsets as XLA's S32 buffers
  Buf q({8, 2, 8}, 8), k({10, 1, 8}, 9), v({10, 1, 8}, 10), out({8, 2, 8}, 0), lse({2, 8}, 0);
  std::vector<int32_t> cq = {0, 3, 8}, ck = {0, 4, 10};
  std::vector<int64_t> cdim = {3};
  Buf cu_q({3}, 0), cu_k({3}, 0);
  cu_q.desc = {A::kBufferSize, nullptr, A::kS32, cq.data(), 1, cdim.data()};
  cu_k.desc = {A::kBufferSize, nullptr, A::kS32, ck.data(), 1, cdim.data()};
  Attrs a = default_attrs(true);
  a.i64("max_seqlen_q", 5).i64("max_seqlen_k", 6);
  CHECK(call(handler("flashdl_attention_varlen_fwd"), {&q, &k, &v, &cu_q, &cu_k}, {&out, &lse},
             a) == nullptr);
  // sequence 1 alone, through the dense handler
  Buf q1({1, 5, 2, 8}, 0), k1({1, 6, 1, 8}, 0), v1({1, 6, 1, 8}, 0), o1({1, 5, 2, 8}, 0),
      l1({1, 2, 5}, 0);
  std::copy(q.values.begin() + 3 * 16, q.values.end(), q1.values.begin());
  std::copy(k.values.begin() + 4 * 8, k.values.end(), k1.values.begin());
  std::copy(v.values.begin() + 4 * 8, v.values.end(), v1.values.begin());
  Attrs d = default_attrs(true);
  CHECK(call(handler("flashdl_attention_fwd"), {&q1, &k1, &v1}, {&o1, &l1}, d) == nullptr);
  CHECK(std::equal(o1.values.begin(), o1.values.end(), out.values.begin() + 3 * 16));
  Attrs small = default_attrs(true);
  small.i64("max_seqlen_q", 4).i64("max_seqlen_k", 6);
  Buf out2({8, 2, 8}, 0);
  expect_error("max_seqlen_q",
               call(handler("flashdl_attention_varlen_fwd"), {&q, &k, &v, &cu_q, &cu_k},
                    {&out2, &lse}, small),
               A::kInvalidArgument, "max_seqlen_q:", out2);
}

// A Buf whose descriptor points at integer values (S32 or U32), as test_varlen's offsets.
template <typename T>
void as_ints(Buf& b, std::vector<T>& values, std::vector<int64_t>& dims, A::DataType dtype) {
  b.desc = {A::kBufferSize, nullptr, dtype, values.data(), static_cast<int64_t>(dims.size()),
            dims.data()};
}

// Dropout: the seed arrives as a uint32 (2,) buffer (low, high word) after the fixed arguments;
// the result is flashdl::forward's with that seed. A missing or mistyped seed names `seed`.
void test_dropout_seed_buffer() {
  Buf q({2, 7, 2, 8}, 11), k({2, 9, 1, 8}, 12), v({2, 9, 1, 8}, 13);
  Buf out({2, 7, 2, 8}, 0), lse({2, 2, 7}, 0), out_ref({2, 7, 2, 8}, 0), lse_ref({2, 2, 7}, 0);
  const uint64_t seed = 0x0123456789ABCDEFull;
  std::vector<uint32_t> w = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  std::vector<int32_t> bad = {1, 2};
  std::vector<int64_t> two = {2};
  Buf words({2}, 0), wrong({2}, 0);
  as_ints(words, w, two, A::kU32);
  as_ints(wrong, bad, two, A::kS32);
  Attrs a = default_attrs(false);
  a.f64("dropout_p", 0.3).i64("offset", 5);
  CHECK(call(handler("flashdl_attention_fwd"), {&q, &k, &v, &words}, {&out, &lse}, a) == nullptr);
  flashdl::Options o;
  o.schedule = flashdl::Schedule::fa2;
  o.dropout_p = 0.3f;
  o.seed = seed;
  o.offset = 5;
  flashdl::forward(view(q, {2, 7, 2, 8}), view(k, {2, 9, 1, 8}), view(v, {2, 9, 1, 8}),
                   view(out_ref, {2, 7, 2, 8}), view(lse_ref, {2, 2, 7}), o);
  CHECK(out.values == out_ref.values && lse.values == lse_ref.values);
  Buf out2({2, 7, 2, 8}, 0);
  Attrs b = default_attrs(false);
  b.f64("dropout_p", 0.3).i64("offset", 5);
  expect_error("no seed", call(handler("flashdl_attention_fwd"), {&q, &k, &v}, {&out2, &lse}, b),
               A::kInvalidArgument, "seed:", out2);
  Attrs c = default_attrs(false);
  c.f64("dropout_p", 0.3).i64("offset", 5);
  expect_error("seed dtype",
               call(handler("flashdl_attention_fwd"), {&q, &k, &v, &wrong}, {&out2, &lse}, c),
               A::kInvalidArgument, "seed:", out2);

  // A shard of a sharded call (flashdl.jax): (low, high, batch offset, head offset) and the
  // attribute dropout_nheads_total give flashdl::forward with the slice options; a (3,) buffer
  // names `seed`, a head range past dropout_nheads_total names it.
  std::vector<uint32_t> w4 = {w[0], w[1], 3, 4};
  std::vector<int64_t> four = {4}, three = {3};
  Buf words4({4}, 0), words3({3}, 0);
  as_ints(words4, w4, four, A::kU32);
  as_ints(words3, w4, three, A::kU32);
  Attrs e = default_attrs(false);
  e.f64("dropout_p", 0.3).i64("offset", 5).i64("dropout_nheads_total", 7);
  Buf out4({2, 7, 2, 8}, 0), lse4({2, 2, 7}, 0);
  CHECK(call(handler("flashdl_attention_fwd"), {&q, &k, &v, &words4}, {&out4, &lse4}, e) ==
        nullptr);
  o.dropout_batch_offset = 3;
  o.dropout_head_offset = 4;
  o.dropout_nheads_total = 7;
  flashdl::forward(view(q, {2, 7, 2, 8}), view(k, {2, 9, 1, 8}), view(v, {2, 9, 1, 8}),
                   view(out_ref, {2, 7, 2, 8}), view(lse_ref, {2, 2, 7}), o);
  CHECK(out4.values == out_ref.values && lse4.values == lse_ref.values);
  CHECK(out4.values != out.values);  // the offsets select another mask
  Attrs f = default_attrs(false);
  f.f64("dropout_p", 0.3).i64("offset", 5).i64("dropout_nheads_total", 7);
  expect_error("seed (3,)",
               call(handler("flashdl_attention_fwd"), {&q, &k, &v, &words3}, {&out2, &lse}, f),
               A::kInvalidArgument, "seed:", out2);
  Attrs g = default_attrs(false);
  g.f64("dropout_p", 0.3).i64("offset", 5).i64("dropout_nheads_total", 5);
  expect_error("dropout_nheads_total",
               call(handler("flashdl_attention_fwd"), {&q, &k, &v, &words4}, {&out2, &lse}, g),
               A::kInvalidArgument, "dropout_nheads_total:", out2);
}

// The KV cache with an append into result caches that XLA did not alias with the arguments: the
// handler copies the caches over first, so the argument caches stay as they were; merge_states
// of two partial results equals flashdl::merge_states.
void test_kvcache_and_merge() {
  Buf q({2, 1, 2, 8}, 21), kc({2, 6, 1, 8}, 22), vc({2, 6, 1, 8}, 23), kn({2, 1, 1, 8}, 24),
      vn({2, 1, 1, 8}, 25);
  std::vector<int32_t> u = {2, 5};
  std::vector<int64_t> two = {2};
  Buf used({2}, 0);
  as_ints(used, u, two, A::kS32);
  Buf out({2, 1, 2, 8}, 0), lse({2, 2, 1}, 0), kc_out({2, 6, 1, 8}, 0), vc_out({2, 6, 1, 8}, 0);
  const std::vector<float> kc0 = kc.values, vc0 = vc.values;
  Attrs a = default_attrs(true);
  a.flag("has_new", true).i64("num_splits", 0);
  CHECK(call(handler("flashdl_attention_kvcache"), {&q, &kc, &vc, &used, &kn, &vn},
             {&out, &lse, &kc_out, &vc_out}, a) == nullptr);
  CHECK(kc.values == kc0 && vc.values == vc0);
  std::vector<float> kc_ref = kc0, vc_ref = vc0;
  Buf out_ref({2, 1, 2, 8}, 0), lse_ref({2, 2, 1}, 0), kr({2, 6, 1, 8}, 0), vr({2, 6, 1, 8}, 0);
  kr.values = kc_ref, vr.values = vc_ref;
  kr.desc.data = kr.values.data(), vr.desc.data = vr.values.data();
  flashdl::Options o;
  o.causal = true;
  int32_t used_ref[2] = {2, 5};
  flashdl::TensorView tu;
  tu.data = used_ref, tu.dtype = flashdl::DType::int32, tu.rank = 1, tu.shape[0] = 2,
  tu.strides[0] = 1;
  flashdl::forward_kvcache(view(q, {2, 1, 2, 8}), view(kr, {2, 6, 1, 8}), view(vr, {2, 6, 1, 8}),
                           tu, view(kn, {2, 1, 1, 8}), view(vn, {2, 1, 1, 8}), {},
                           view(out_ref, {2, 1, 2, 8}), view(lse_ref, {2, 2, 1}), o);
  CHECK(out.values == out_ref.values && lse.values == lse_ref.values);
  CHECK(kc_out.values == kr.values && vc_out.values == vr.values);

  Buf o1({1, 3, 2, 8}, 31), l1({1, 2, 3}, 32), o2({1, 3, 2, 8}, 33), l2({1, 2, 3}, 34);
  Buf mo({1, 3, 2, 8}, 0), ml({1, 2, 3}, 0), ro({1, 3, 2, 8}, 0), rl({1, 2, 3}, 0);
  Attrs none;
  CHECK(call(handler("flashdl_merge_states"), {&o1, &o2, &l1, &l2}, {&mo, &ml}, none) == nullptr);
  flashdl::merge_states({view(o1, {1, 3, 2, 8}), view(o2, {1, 3, 2, 8})},
                        {view(l1, {1, 2, 3}), view(l2, {1, 2, 3})}, view(ro, {1, 3, 2, 8}),
                        view(rl, {1, 2, 3}));
  CHECK(mo.values == ro.values && ml.values == rl.values);
}

}  // namespace

int main() {
  run_test("metadata query", test_metadata_query);
  run_test("forward and backward fold leading axes", test_forward_and_backward_fold_leading_axes);
  run_test("attribute kinds", test_attribute_kinds);
  run_test("errors come back through the API", test_errors_come_back_through_the_api);
  run_test("varlen", test_varlen);
  run_test("dropout seed buffer", test_dropout_seed_buffer);
  run_test("kvcache and merge_states", test_kvcache_and_merge);
  return finish();
}
