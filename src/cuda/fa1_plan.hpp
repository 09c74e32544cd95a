// FA-1 tile sizes and shared-memory layout from the device's shared memory (host side).
//
// Algorithm 1, line 1: Bc = ceil(M / 4d), Br = min(Bc, d), with M the on-chip budget in elements of
// the storage type: Params.sram_bytes when given, else the device's opt-in shared memory per block.
// The rule counts only the Q, K, V and O blocks; on the GPU the score block S (float, P in place),
// the float P V block and two per-row factors live in shared memory as well. So the rule's sizes are
// rounded down to whole 16 x 16 tensor-core tiles (at least one), capped by the problem's extents,
// and then Bc is shrunk 16 rows at a time (Br = min(Br, Bc) with it) until the layout fits the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "flashdl/error.hpp"
#include "flashdl/detail/tiles.hpp"

namespace flashdl::cuda {

struct Fa1Layout {
  int Br, Bc;  // query rows and key rows per block
  int ld_kv;   // kHeadDim + 8, elements of T: the K, V and Q tiles
  int ld_s;    // Bc + 4 floats: S; P (elements of T) overwrites S in place with stride 2 * ld_s
  int ld_o;    // kHeadDim + 4 floats: P V of the current block pair
  unsigned off_k, off_v, off_q, off_s, off_o, off_scale, bytes;
};

inline Fa1Layout fa1_layout(int br, int bc, int head_dim, int elem_bytes) {
  auto align = [](std::size_t x) { return static_cast<unsigned>((x + 127) / 128 * 128); };
  Fa1Layout L{};
  L.Br = br;
  L.Bc = bc;
  L.ld_kv = head_dim + 8;
  L.ld_s = bc + 4;
  L.ld_o = head_dim + 4;
  const std::size_t kv = std::size_t(bc) * L.ld_kv * elem_bytes;
  L.off_k = 0;
  L.off_v = L.off_k + align(kv);
  L.off_q = L.off_v + align(kv);
  L.off_s = L.off_q + align(std::size_t(br) * L.ld_kv * elem_bytes);
  L.off_o = L.off_s + align(std::size_t(br) * L.ld_s * sizeof(float));
  L.off_scale = L.off_o + align(std::size_t(br) * L.ld_o * sizeof(float));
  L.bytes = L.off_scale + align(2 * std::size_t(br) * sizeof(float));
  return L;
}

// The rule's sizes rounded to whole 16 x 16 tiles (at least one) and capped by the problem's
// extents; then Bc shrinks 16 rows at a time (Br = min(Br, Bc) with it) until layout(br, bc),
// any struct with a `bytes` field, fits the device. Shared by the forward and the backward.
template <typename LayoutFn>
auto plan_fa1_tiles(int64_t sram_bytes, int64_t seqlen_q, int64_t seqlen_k, int head_dim,
                    int elem_bytes, int smem_optin, const char* kernel, LayoutFn layout) {
  const int64_t budget = sram_bytes > 0 ? sram_bytes : smem_optin;
  const detail::Fa1Tiles rule = detail::fa1_tiles(budget / elem_bytes, head_dim);
  auto to_tile = [](int64_t rows, int64_t extent) {
    int64_t t = rows / 16 * 16;
    if (t < 16) t = 16;
    const int64_t cap = detail::round_up(extent > 0 ? extent : 1, 16);
    return static_cast<int>(t < cap ? t : cap);
  };
  int bc = to_tile(rule.Bc, seqlen_k);
  int br = to_tile(rule.Br, seqlen_q);
  for (;;) {
    const auto L = layout(br, bc);
    if (L.bytes <= static_cast<unsigned>(smem_optin)) return L;
    if (bc > 16) {
      bc -= 16;
      if (br > bc) br = bc;  // the rule's Br = min(Bc, d) for the shrunk Bc
    } else if (br > 16) {
      br -= 16;
    } else {
      throw Error(ErrorKind::unsupported,
                  std::string("q: the ") + kernel + " kernel for headdim " +
                      std::to_string(head_dim) + " needs " + std::to_string(L.bytes) +
                      " bytes of shared memory for its smallest tiles (16 x 16); the device "
                      "offers " +
                      std::to_string(smem_optin));
    }
  }
}

inline Fa1Layout plan_fa1(int64_t sram_bytes, int64_t seqlen_q, int64_t seqlen_k, int head_dim,
                          int elem_bytes, int smem_optin) {
  return plan_fa1_tiles(sram_bytes, seqlen_q, seqlen_k, head_dim, elem_bytes, smem_optin, "fa1",
                        [&](int br, int bc) { return fa1_layout(br, bc, head_dim, elem_bytes); });
}

}  // namespace flashdl::cuda
