// The tile table of the FA-2 forward, derived from register and shared-memory budgets: plain
// constexpr arithmetic, used by the kernel's traits (fa2_traits.cuh) and checked on the host by
// tests/cpp/test_cuda_plan.cpp (no CUDA headers here).
//
// A CTA has 4 warps; each warp owns 16 or 32 query rows (one or two 16-row fragments) and holds,
// in registers, its output accumulators (rows x d floats) and its scores (rows x kBlockN floats),
// spread over the warp's 32 lanes. The tile is the first of, in order of preference,
//   32 rows a warp (kBlockM 128) with kBlockN 64, then 32;  16 rows a warp (kBlockM 64) with 64, 32
// whose accumulators fit the register budget and whose shared memory leaves room for two CTAs per
// SM on an H100. Head dims whose tile needs more than the smallest sm_80+ opt-in (99 KiB) also get
// a variant with half the keys per block.
//
// Calls that need no shared-memory softmax (no dropout, block mask, score modifier, bias or mask:
// the dense and causal/windowed forward) run a register-only instantiation where it allows a
// larger tile (fa2_fwd_regs_tile): it carries no per-warp float score scratch, and its register
// count takes P as what it is, the scores' registers converted in place to 16-bit A operands.
#pragma once

#include <cstddef>

namespace flashdl::cuda {

constexpr int kFa2Warps = 4;
constexpr int kFa2Threads = kFa2Warps * 32;
// Registers per thread the tile's scores and output may take out of the 255 of
// __launch_bounds__(128, 2) (fa2_fwd_acc_regs); the rest holds K/V fragments, addresses and the
// softmax state. Set from ptxas (sm_80, sm_90): every tile of the table compiles without spills,
// and the next larger candidate (d = 96 with 64 keys: 224) spilled hundreds of bytes.
constexpr int kFa2AccRegBudget = 192;
// Two CTAs per SM on an H100 (228 KiB of shared memory per SM, 1 KiB reserved per CTA).
constexpr std::size_t kFa2TwoCtaSmem = 113 * 1024;
// The smallest opt-in shared memory per block among sm_80+ parts (sm_86, sm_89, sm_120: 99 KiB).
constexpr std::size_t kFa2SmallestOptin = 99 * 1024;

// The register layout of a 16 x 16 float accumulator fragment the register softmax assumes (and
// checks at kernel start: fragment.cuh, layout_holds): lane l's element i holds (acc_row(l, i),
// acc_col(l, i)), the layout of two m16n8 halves of the m16n8k16 instruction on sm_80 and sm_90.
// A row's 16 columns sit in the 4 lanes of a quad (l / 4 the same), 4 elements each.
constexpr int acc_row(int lane, int i) { return lane / 4 + 8 * ((i / 2) % 2); }
constexpr int acc_col(int lane, int i) { return (lane % 4) * 2 + i % 2 + 8 * (i / 4); }

// The shared-memory softmax (fa2::softmax_step): lanes 2r and 2r + 1 own row r of a 16-row band,
// alternate columns; at step k of cols_per_lane (a power of two) the lane reads column
// smem_softmax_col(lane, k, cols_per_lane). Rows 8 to 15 visit their column pairs rotated by one,
// so that with a row stride of 4 (mod 8) words the 32 loads of a step hit 32 banks.
constexpr int smem_softmax_col(int lane, int k, int cols_per_lane) {
  return 2 * ((k + lane / 16) % cols_per_lane) + lane % 2;
}

struct Fa2FwdTile {
  int row_frags;  // 16-row fragments per warp: 1 or 2
  int block_n;    // keys per K/V block (Bc)
};

constexpr bool operator==(Fa2FwdTile a, Fa2FwdTile b) {
  return a.row_frags == b.row_frags && a.block_n == b.block_n;
}

// Registers per thread for a warp's rows: the output accumulators (rows x d floats over 32 lanes)
// and the scores counted twice (rows x kBlockN floats, then P: the A operands, or the copy the
// shared-memory softmax holds while it writes P).
constexpr int fa2_fwd_acc_regs(int head_dim, Fa2FwdTile t) {
  return t.row_frags * 16 * (head_dim + 2 * t.block_n) / 32;
}

// The register-only kernel's count: the output accumulators and the scores once (P takes the
// scores' registers as they are converted, two 16-bit values per register).
constexpr int fa2_fwd_regs_acc_regs(int head_dim, Fa2FwdTile t) {
  return t.row_frags * 16 * (head_dim + t.block_n) / 32;
}

struct Fa2FwdLayout {
  int block_m;  // query rows per CTA (Br)
  int ld_qkv;   // row stride of Q, K, V (elements of T)
  int ld_s;     // row stride of the per-warp float scratch (shared-memory softmax, epilogue)
  std::size_t off_q, off_k, off_v;  // Q; K and V, two stages each
  std::size_t off_s;                // per warp 16 x ld_s floats (P as T in place, stride 2 ld_s)
  std::size_t off_rows;             // 16 x 16 floats, entry (r, c) = r: the accumulator row map
  std::size_t off_rowf;             // block_m floats: per-row factors of the epilogue
  std::size_t bytes;
};

constexpr std::size_t fa2_align128(std::size_t x) { return (x + 127) / 128 * 128; }

// elem_bytes: 2 (float16, bfloat16). Regions 128-byte aligned; strides padded by 8 elements (Q, K,
// V) and 4 floats (scratch) so consecutive rows start in different banks, and kept multiples of
// 16 bytes (wmma ldm) with every tile 32-byte aligned.
// regs_only: the register-only kernel's scratch holds no float scores, only a 16-row band of P as
// T (the slow P V of a masked block with a non-finite V) and the epilogue's 16 x 16 staging, so
// its row is half as wide.
constexpr Fa2FwdLayout fa2_fwd_layout(int head_dim, Fa2FwdTile t, int elem_bytes = 2,
                                      bool regs_only = false) {
  Fa2FwdLayout L{};
  L.block_m = kFa2Warps * 16 * t.row_frags;
  L.ld_qkv = head_dim + 8;
  const int cols = regs_only ? t.block_n / 2 : t.block_n;  // floats of a scratch row
  L.ld_s = (cols > 16 ? cols : 16) + 4;  // the epilogue stages 16 columns at a time
  const std::size_t kv = std::size_t(t.block_n) * L.ld_qkv * elem_bytes;
  L.off_q = 0;
  L.off_k = fa2_align128(std::size_t(L.block_m) * L.ld_qkv * elem_bytes);
  L.off_v = L.off_k + fa2_align128(2 * kv);
  L.off_s = L.off_v + fa2_align128(2 * kv);
  // The scratch also holds, at kernel start, the two 16 x 16 index tiles of the layout check
  // (float, then T): at least 1,536 bytes.
  const std::size_t s = std::size_t(kFa2Warps) * 16 * L.ld_s * 4;
  L.off_rows = L.off_s + fa2_align128(s > 1536 ? s : 1536);
  L.off_rowf = L.off_rows + fa2_align128(16 * 16 * 4);
  L.bytes = L.off_rowf + fa2_align128(std::size_t(L.block_m) * 4);
  return L;
}

constexpr bool fa2_fwd_tile_fits(int head_dim, Fa2FwdTile t, int elem_bytes = 2) {
  return fa2_fwd_acc_regs(head_dim, t) <= kFa2AccRegBudget &&
         fa2_fwd_layout(head_dim, t, elem_bytes).bytes <= kFa2TwoCtaSmem;
}

// The tile for a head dim (a multiple of 16, at most 256).
constexpr Fa2FwdTile fa2_fwd_tile(int head_dim, int elem_bytes = 2) {
  const Fa2FwdTile order[] = {{2, 64}, {2, 32}, {1, 64}, {1, 32}};
  for (const Fa2FwdTile& t : order)
    if (fa2_fwd_tile_fits(head_dim, t, elem_bytes)) return t;
  return {1, 16};
}

// The register-only kernel's tile: the first of 32 rows a warp with 128, 64 or 32 keys, then 16
// rows with 64 or 32, within the same budgets as fa2_fwd_tile counted as above. Where it is the
// general kernel's tile no register-only kernel is instantiated (fa2_fwd_has_regs).
constexpr bool fa2_fwd_regs_tile_fits(int head_dim, Fa2FwdTile t, int elem_bytes = 2) {
  return fa2_fwd_regs_acc_regs(head_dim, t) <= kFa2AccRegBudget &&
         fa2_fwd_layout(head_dim, t, elem_bytes, true).bytes <= kFa2TwoCtaSmem;
}

constexpr Fa2FwdTile fa2_fwd_regs_tile(int head_dim, int elem_bytes = 2) {
  const Fa2FwdTile order[] = {{2, 128}, {2, 64}, {2, 32}, {1, 64}, {1, 32}};
  for (const Fa2FwdTile& t : order)
    if (fa2_fwd_regs_tile_fits(head_dim, t, elem_bytes)) return t;
  return {1, 16};
}

constexpr bool fa2_fwd_has_regs(int head_dim, int elem_bytes = 2) {
  return !(fa2_fwd_regs_tile(head_dim, elem_bytes) == fa2_fwd_tile(head_dim, elem_bytes));
}

// Whether the tile needs more than the smallest sm_80+ opt-in, and so has a half-kBlockN variant.
constexpr bool fa2_fwd_has_small(int head_dim, int elem_bytes = 2) {
  return fa2_fwd_layout(head_dim, fa2_fwd_tile(head_dim, elem_bytes), elem_bytes).bytes >
         kFa2SmallestOptin;
}

constexpr Fa2FwdTile fa2_fwd_small_tile(int head_dim, int elem_bytes = 2) {
  const Fa2FwdTile t = fa2_fwd_tile(head_dim, elem_bytes);
  return {t.row_frags, t.block_n / 2};
}

}  // namespace flashdl::cuda
