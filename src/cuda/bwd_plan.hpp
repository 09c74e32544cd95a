// Tile sizes and shared-memory layouts of the CUDA backward kernels (host side, no CUDA headers,
// so the planning is unit-tested on machines without a GPU: tests/cpp/test_cuda_plan.cpp).
//
// fa2: one CTA per (key block of Bc keys, kv head, batch), 8 warps. K_j and V_j stay in shared
// memory; the Q, dO, lse and D of each query block (Br rows) stream through `stages` buffers.
// Each warp owns a 16-key band and a slice of the head dim of dK_j and dV_j, in registers
// (bands = Bc / 16 warps along keys, 8 / bands along the head dim).
// fa1: Algorithm 4 as written, one CTA per (batch, kv head), tiles from the on-chip budget.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "fa1_plan.hpp"
#include "flashdl/error.hpp"
#include "flashdl/detail/tiles.hpp"

namespace flashdl::cuda {

constexpr int kBwdWarps = 8;
constexpr int kBwdThreads = kBwdWarps * 32;

struct Fa2BwdConfig {
  int block_m;  // Br: query rows per streamed block
  int block_n;  // Bc: keys per CTA
  int stages;   // buffers for the streamed Q, dO, lse, D (2: the next block loads during this one)
  int band_frags = 1;  // 16-key fragments in each warp's band of dK_j / dV_j (1 or 2)
  // P and dS only, as T, where S and dP go (the main kernel with S/dP in registers): Br x (Bc + 8)
  // elements of T each instead of Br x (Bc + 4) floats. Not for a layout the deterministic dQ
  // pass uses (it holds float S and dP there).
  bool p_only = false;
};

constexpr std::size_t align128(std::size_t x) { return (x + 127) / 128 * 128; }

// Shared memory of the fa2 backward, in bytes from the start of the dynamic allocation.
struct Fa2BwdLayout {
  int ld_qkv;  // head_dim + 8 elements of T: Q, dO, K, V tiles
  int ld_s;    // Bc + 4 floats: S and dP; P and dS (elements of T) overwrite them in place
  int ld_p;    // elements of T a row of P and dS: 2 ld_s (in place over S, dP) or Bc + 8 (p_only)
  std::size_t off_k, off_v, off_q, off_do, off_s, off_dp, off_l2, off_d, bytes;
  std::size_t q_stage_bytes, stat_stage_bytes;  // one stage of Q (or dO), of lse2 (or D)
};

// q_stages: buffers for Q/dO/lse/D (the main kernel streams query blocks); the deterministic dQ
// pass streams key blocks with a single buffer and uses the same layout with q_stages = 1.
constexpr Fa2BwdLayout fa2_bwd_layout(int head_dim, Fa2BwdConfig c, int q_stages,
                                      int elem_bytes = 2) {
  Fa2BwdLayout L{};
  L.ld_qkv = head_dim + 8;
  L.ld_s = c.block_n + 4;
  const std::size_t kv = align128(std::size_t(c.block_n) * L.ld_qkv * elem_bytes);
  L.q_stage_bytes = align128(std::size_t(c.block_m) * L.ld_qkv * elem_bytes);
  L.stat_stage_bytes = align128(std::size_t(c.block_m) * sizeof(float));
  L.ld_p = c.p_only ? c.block_n + 8 : 2 * L.ld_s;
  const std::size_t s = align128(c.p_only ? std::size_t(c.block_m) * L.ld_p * elem_bytes
                                          : std::size_t(c.block_m) * L.ld_s * sizeof(float));
  L.off_k = 0;
  L.off_v = L.off_k + kv;
  L.off_q = L.off_v + kv;
  L.off_do = L.off_q + q_stages * L.q_stage_bytes;
  L.off_s = L.off_do + q_stages * L.q_stage_bytes;
  L.off_dp = L.off_s + s;
  L.off_l2 = L.off_dp + s;
  L.off_d = L.off_l2 + q_stages * L.stat_stage_bytes;
  L.bytes = L.off_d + q_stages * L.stat_stage_bytes;
  return L;
}

// The tiles used where the device allows (sized for the A100's 163 KiB and the H100's 227 KiB),
// and the fallback for parts with 99 KiB per block (sm_86, sm_89, sm_120). d = 256 keeps 32 keys
// per CTA: with 64, dK and dV take 128 registers a thread and the main kernel spilled (ptxas,
// sm_90: 255 registers, 28 bytes of spill stores).
constexpr Fa2BwdConfig fa2_bwd_config(int head_dim) {
  return head_dim <= 128   ? Fa2BwdConfig{64, 64, 2}
         : head_dim <= 192 ? Fa2BwdConfig{32, 64, 2}
                           : Fa2BwdConfig{32, 32, 2};
}
constexpr Fa2BwdConfig fa2_bwd_fallback(int head_dim) {
  return head_dim <= 96    ? Fa2BwdConfig{64, 64, 1}
         : head_dim <= 128 ? Fa2BwdConfig{32, 64, 1}
                           : Fa2BwdConfig{32, 32, 1};
}

// The dense calls' tiles (no dropout, block mask, score modifier, bias or mask: BwdCall::dense)
// where the device has the shared memory (203 KiB at d 128: sm_90's 227 KiB, not the A100's 163):
// 64 queries x 128 keys, FlashAttention-2's own at d 128. Against 64 x 64 each HMMA carries half
// the Q / dO copies, barriers, dQ atomics and per-pair setup (SASS model, sm_90 float16, cycles
// per HMMA: d 64 22.1 -> 17.9, d 128 17.3 -> 15.2). Not for the other calls: their per-pair
// features spill with these tiles (ptxas sm_90 float16 d 128: 255 registers and 3,820 bytes of
// spill loads with a bias, 1,808 with dropout or a block mask; the dense kernel 254 and none).
// Up to d 64, 128 x 128 (FlashAttention-2's there) with P and dS alone in shared memory (p_only:
// 178 KiB at d 64; float S and dP would take 245) and each warp's S/dP in two chunks of 64 rows
// (the registers of 64 x 128): per HMMA half the barriers and per-pair setup again, fewer dQ
// fragment loads (SASS model, d 64: 16.2 -> 14.8). Head dims above 128 keep the standard tiles.
constexpr Fa2BwdConfig fa2_bwd_dense_config(int head_dim) {
  return head_dim <= 64    ? Fa2BwdConfig{128, 128, 2, 2, true}
         : head_dim <= 128 ? Fa2BwdConfig{64, 128, 2, 2}
                           : fa2_bwd_config(head_dim);
}

// The warp grid over dK_j / dV_j: Bc / (16 band_frags) key bands; the rest of the 8 warps split
// the head dim. Bands of 32 keys (band_frags 2, the dense tiles) against 16: per 16 query rows a
// warp loads 4 fragments of P / dS and 2 x (its head-dim slice) of dO / Q instead of 2 and twice
// the slice, for the same products (64 x 128 tiles: 10 -> 8 LDSM per 16 HMMA at d 64, 18 -> 12
// per 32 at d 128).
constexpr int fa2_bwd_key_bands(Fa2BwdConfig c) { return c.block_n / (16 * c.band_frags); }
constexpr int fa2_bwd_dim_splits(Fa2BwdConfig c) { return kBwdWarps / fa2_bwd_key_bands(c); }

// True when the warp grid covers dK_j and dV_j exactly with whole 16 x 16 tiles.
constexpr bool fa2_bwd_config_valid(int head_dim, Fa2BwdConfig c) {
  return (c.band_frags == 1 || c.band_frags == 2) && c.block_n % (16 * c.band_frags) == 0 &&
         c.block_m % 16 == 0 && c.block_n % 16 == 0 && c.block_m >= 16 && c.block_n >= 16 &&
         kBwdWarps % fa2_bwd_key_bands(c) == 0 && head_dim % 16 == 0 &&
         (head_dim / 16) % fa2_bwd_dim_splits(c) == 0 && (c.stages == 1 || c.stages == 2);
}

// Bytes both fa2 backward kernels need (the main kernel's layout is the larger one).
constexpr std::size_t fa2_bwd_smem_bytes(int head_dim, Fa2BwdConfig c) {
  return fa2_bwd_layout(head_dim, c, c.stages).bytes;
}

enum class Fa2BwdVariant { standard, fallback, none };

inline Fa2BwdVariant pick_fa2_bwd(int head_dim, int smem_optin) {
  const auto optin = static_cast<std::size_t>(smem_optin);
  if (fa2_bwd_smem_bytes(head_dim, fa2_bwd_config(head_dim)) <= optin)
    return Fa2BwdVariant::standard;
  if (fa2_bwd_smem_bytes(head_dim, fa2_bwd_fallback(head_dim)) <= optin)
    return Fa2BwdVariant::fallback;
  return Fa2BwdVariant::none;
}

// Workspace of the fa2 backward, in floats: lse2 and D for every (batch, head, row), then the
// float32 dQ accumulator (not in deterministic mode, where the dQ pass writes dq directly).
struct Fa2BwdWorkspace {
  int64_t stats;  // batch * nheads * seqlen_q
  int64_t dq;     // stats * head_dim, or 0
  int64_t floats() const { return 2 * stats + dq; }
};

inline Fa2BwdWorkspace fa2_bwd_workspace(int64_t batch, int64_t nheads, int64_t seqlen_q,
                                         int head_dim, bool deterministic) {
  const int64_t stats = batch * nheads * seqlen_q;
  return Fa2BwdWorkspace{stats, deterministic ? 0 : stats * head_dim};
}

// ---- fa1 (Algorithm 4) ------------------------------------------------------------------------
// K_j, V_j (T) and dK_j, dV_j (float) stay for a whole key block; Q_i, dO_i (T), S/P and dP/dS
// (float, the T values in place), dS K_j (float), lse2 and D per query block.
struct Fa1BwdLayout {
  int Br, Bc;
  int ld_kv;  // head_dim + 8 elements of T
  int ld_s;   // Bc + 4 floats
  int ld_o;   // head_dim + 4 floats: dK_j, dV_j, dS K_j
  unsigned off_k, off_v, off_dk, off_dv, off_q, off_do, off_s, off_dp, off_dq, off_l2, off_d, bytes;
};

inline Fa1BwdLayout fa1_bwd_layout(int br, int bc, int head_dim, int elem_bytes) {
  Fa1BwdLayout L{};
  L.Br = br;
  L.Bc = bc;
  L.ld_kv = head_dim + 8;
  L.ld_s = bc + 4;
  L.ld_o = head_dim + 4;
  auto a = [](std::size_t x) { return static_cast<unsigned>(align128(x)); };
  const unsigned kv = a(std::size_t(bc) * L.ld_kv * elem_bytes);
  const unsigned dkv = a(std::size_t(bc) * L.ld_o * sizeof(float));
  const unsigned q = a(std::size_t(br) * L.ld_kv * elem_bytes);
  const unsigned s = a(std::size_t(br) * L.ld_s * sizeof(float));
  const unsigned stat = a(std::size_t(br) * sizeof(float));
  L.off_k = 0;
  L.off_v = L.off_k + kv;
  L.off_dk = L.off_v + kv;
  L.off_dv = L.off_dk + dkv;
  L.off_q = L.off_dv + dkv;
  L.off_do = L.off_q + q;
  L.off_s = L.off_do + q;
  L.off_dp = L.off_s + s;
  L.off_dq = L.off_dp + s;
  L.off_l2 = L.off_dq + a(std::size_t(br) * L.ld_o * sizeof(float));
  L.off_d = L.off_l2 + stat;
  L.bytes = L.off_d + stat;
  return L;
}

// Algorithm 4, line 2 (the forward's rule, detail::fa1_tiles), rounded to whole 16 x 16 tiles and
// shrunk as plan_fa1 does until the layout fits the device.
inline Fa1BwdLayout plan_fa1_backward(int64_t sram_bytes, int64_t seqlen_q, int64_t seqlen_k,
                                      int head_dim, int elem_bytes, int smem_optin) {
  return plan_fa1_tiles(sram_bytes, seqlen_q, seqlen_k, head_dim, elem_bytes, smem_optin,
                        "fa1 backward", [&](int br, int bc) {
                          return fa1_bwd_layout(br, bc, head_dim, elem_bytes);
                        });
}

}  // namespace flashdl::cuda
