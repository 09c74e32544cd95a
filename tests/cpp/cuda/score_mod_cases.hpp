// The score modifiers of the CUDA tests (Options::softcap, Options::alibi_slopes): which ones a
// case turns on, the slopes in each layout the core accepts ((nheads,), (batch, nheads), and
// (batch, nheads) with padded rows), held in host memory for the CPU float64 reference and on the
// target for the call under test, and the same modifiers for the naive algorithms of the
// tolerance rule (cuda_harness.hpp's ScoreMods).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cuda_harness.hpp"
#include "flashdl/api.hpp"

namespace cuda_test {

// heads: (nheads,); batch_heads: (batch, nheads); strided: (batch, nheads) with rows of nheads + 3.
enum class Alibi { none, heads, batch_heads, strided };

inline const char* alibi_name(Alibi a) {
  switch (a) {
    case Alibi::none: return "none";
    case Alibi::heads: return "(h)";
    case Alibi::batch_heads: return "(b,h)";
    case Alibi::strided: return "(b,h)/strided";
  }
  return "?";
}

struct ModSpec {
  double softcap;  // 0: off
  Alibi alibi;
};

inline std::string mod_label(const ModSpec& m) {
  char buf[80];
  std::snprintf(buf, sizeof buf, " softcap=%g alibi=%s", m.softcap, alibi_name(m.alibi));
  return buf;
}

// The slope of (batch b, head h): powers of two cycling over the heads, one of them 0 (that head
// gets no bias: the kernels' unmodified path, unless capped); per-batch layouts shift and scale
// them by batch.
inline float test_slope(Alibi a, int64_t b, int64_t h) {
  static const float base[4] = {0.5f, 0.125f, 0.0f, 0.03125f};
  if (a == Alibi::heads) return base[h % 4];
  return base[(h + b) % 4] * float(1 + b);
}

// One case's modifiers: the slopes in host memory and on the target, and the naive algorithms'
// view of them.
class ModArgs {
 public:
  ModArgs(bool target_host, const ModSpec& m, int64_t batch, int64_t nheads) {
    naive_.softcap = float(m.softcap);
    naive_.nheads = nheads;
    softcap_ = m.softcap;
    if (m.alibi == Alibi::none) return;
    naive_.slopes.resize(size_t(batch * nheads));
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < nheads; ++h)
        naive_.slopes[size_t(b * nheads + h)] = test_slope(m.alibi, b, h);
    if (m.alibi == Alibi::heads) {
      rank_ = 1;
      shape_[0] = nheads;
      strides_[0] = 1;
    } else {
      rank_ = 2;
      shape_[0] = batch;
      shape_[1] = nheads;
      strides_[0] = m.alibi == Alibi::strided ? nheads + 3 : nheads;
      strides_[1] = 1;
    }
    const int64_t rows = rank_ == 1 ? 1 : batch;
    // Gaps hold NaN: a kernel that read past a slope would spread it.
    host_.assign(size_t(rank_ == 1 ? nheads : rows * strides_[0]), bits_to_float(0xffffffffu));
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t h = 0; h < nheads; ++h)
        host_[size_t(b * (rank_ == 1 ? 0 : strides_[0]) + h)] = test_slope(m.alibi, b, h);
    target_ = std::make_unique<Buffer>(host_.size() * sizeof(float), target_host);
    target_->upload(host_);
  }

  const ScoreMods& naive() const { return naive_; }

  // `o` with the modifiers; the slopes in host memory (for the CPU reference) or on the target.
  flashdl::Options apply(flashdl::Options o, bool reference) const {
    o.softcap = softcap_;
    if (rank_ == 0) return o;
    flashdl::TensorView t;
    t.data = reference ? const_cast<float*>(host_.data()) : target_->ptr;
    t.dtype = flashdl::DType::float32;
    t.device = reference ? flashdl::Device{} : target_->device();
    t.rank = rank_;
    for (int i = 0; i < rank_; ++i) {
      t.shape[i] = shape_[i];
      t.strides[i] = strides_[i];
    }
    o.alibi_slopes = t;
    return o;
  }

 private:
  ScoreMods naive_;
  double softcap_ = 0.0;
  int rank_ = 0;  // 0: no ALiBi
  int64_t shape_[2] = {}, strides_[2] = {};
  std::vector<float> host_;
  std::unique_ptr<Buffer> target_;
};

}  // namespace cuda_test
