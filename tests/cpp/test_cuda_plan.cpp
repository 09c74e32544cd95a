// Host-side checks of the CUDA launch planning, runnable on any machine (no GPU, no CUDA headers):
// the fa2 forward's tile table (register and shared-memory budgets, layouts, the register
// layout its softmax assumes, the bank pattern of its shared-memory softmax), the fa2 backward's
// tile configs, shared-memory layouts and variant choice per device limit, its
// workspace, the fa1 forward and backward tile plans, the block ranges the kernels loop over
// (against brute force over the window mask), the block-mask tile questions (cover, rows and keys
// to zero-fill), the varlen sequence offsets with their clamping, and the decode (KV cache) plan:
// layouts and variants, row chunks, the key splits against brute force, the split count and the
// workspace.
#include <algorithm>
#include <cstddef>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "cuda/bwd_plan.hpp"
#include "cuda/decode_plan.hpp"
#include "cuda/fa2_plan.hpp"
#include "cuda/fa1_plan.hpp"
#include "flashdl/detail/block_mask.hpp"
#include "flashdl/detail/block_range.hpp"
#include "flashdl/detail/sequence.hpp"

using namespace flashdl_test;
namespace fc = flashdl::cuda;
namespace fd = flashdl::detail;

namespace {

const int kHeadDims[] = {32, 64, 96, 128, 192, 256};
constexpr int kH100 = 227 * 1024, kA100 = 163 * 1024, kSmall = 99 * 1024;  // opt-in per block

// Regions in order, 128-byte aligned, each large enough for its tile, and the total in bounds.
void check_fa2_layout(int d, fc::Fa2BwdConfig c, int q_stages) {
  const fc::Fa2BwdLayout L = fc::fa2_bwd_layout(d, c, q_stages);
  const std::size_t kv = std::size_t(c.block_n) * L.ld_qkv * 2;
  const std::size_t q = std::size_t(c.block_m) * L.ld_qkv * 2;
  // S and dP as floats, or (p_only) P and dS alone as 2-byte elements.
  const std::size_t s = c.p_only ? std::size_t(c.block_m) * L.ld_p * 2
                                 : std::size_t(c.block_m) * L.ld_s * 4;
  const std::size_t offs[] = {L.off_k, L.off_v,  L.off_q,  L.off_do,
                              L.off_s, L.off_dp, L.off_l2, L.off_d};
  for (std::size_t o : offs) CHECK_EQ(o % 128, std::size_t(0));
  CHECK(L.off_v - L.off_k >= kv);
  CHECK(L.off_q - L.off_v >= kv);
  CHECK(L.q_stage_bytes >= q);
  CHECK(L.off_do - L.off_q >= q_stages * q);
  CHECK(L.off_s - L.off_do >= q_stages * q);
  CHECK(L.off_dp - L.off_s >= s);
  CHECK(L.off_l2 - L.off_dp >= s);
  CHECK(L.off_d - L.off_l2 >= std::size_t(q_stages) * c.block_m * 4);
  CHECK(L.bytes - L.off_d >= std::size_t(q_stages) * c.block_m * 4);
  // wmma: ld a multiple of 8 halves (16 bytes) and of 4 floats; P, dS in place need 2 * ld_s.
  CHECK_EQ(L.ld_qkv % 8, 0);
  CHECK_EQ(L.ld_s % 4, 0);
  CHECK_EQ(L.ld_p % 8, 0);
  CHECK_EQ(L.ld_p, c.p_only ? c.block_n + 8 : 2 * L.ld_s);
  CHECK(L.ld_p >= c.block_n);
  // The main kernel's start: the accumulator map's float tile (16 rows of ld_s) and a 16 x 16
  // code tile of 2-byte elements below it, in S's region.
  CHECK(L.off_dp - L.off_s >= std::size_t(16) * L.ld_s * 4 + 16 * 16 * 2);
  // A T row of P (Bc elements) fits in the float row of S it overwrites.
  CHECK(std::size_t(c.block_n) * 2 <= std::size_t(L.ld_s) * 4);
}

// The fa2 forward's tile per head dim: the first of the preference order within both budgets,
// laid out without overlap, with two CTAs per SM on an H100, and the half-kBlockN variant exactly
// where the tile exceeds the smallest opt-in.
void check_fa2_forward_layout(int d, fc::Fa2FwdTile t) {
  const fc::Fa2FwdLayout L = fc::fa2_fwd_layout(d, t);
  CHECK_EQ(L.block_m, 4 * 16 * t.row_frags);
  const std::size_t offs[] = {L.off_q, L.off_k, L.off_v, L.off_s, L.off_rows, L.off_rowf, L.bytes};
  for (std::size_t o : offs) CHECK_EQ(o % 128, std::size_t(0));
  const std::size_t kv = std::size_t(t.block_n) * L.ld_qkv * 2;
  CHECK(L.off_k - L.off_q >= std::size_t(L.block_m) * L.ld_qkv * 2);
  CHECK(L.off_v - L.off_k >= 2 * kv);
  CHECK(L.off_s - L.off_v >= 2 * kv);
  CHECK(L.off_rows - L.off_s >= std::size_t(4) * 16 * L.ld_s * 4);  // 16 rows of scratch a warp
  CHECK(L.off_rowf - L.off_rows >= std::size_t(16 * 16 * 4));       // the row-index tile
  CHECK(L.bytes - L.off_rowf >= std::size_t(L.block_m) * 4);        // a factor per row
  // wmma: ld a multiple of 8 halves and of 4 floats; P (T) in place over S needs 2 * ld_s; the
  // epilogue stages 16 columns; the layout check's index tiles (1,536 bytes) sit in K's stage 1,
  // 32-byte aligned.
  CHECK_EQ(L.ld_qkv % 8, 0);
  CHECK_EQ(L.ld_s % 4, 0);
  CHECK(L.ld_s >= t.block_n + 4 && L.ld_s >= 20);
  CHECK(std::size_t(t.block_n) * 2 <= std::size_t(L.ld_s) * 4);
  CHECK(kv >= 1536 && kv % 32 == 0);
}

void test_fa2_forward_tiles() {
  const int expect_rows[] = {128, 128, 128, 128, 64, 64};
  const int expect_n[] = {64, 64, 32, 32, 32, 32};
  const fc::Fa2FwdTile order[] = {{2, 64}, {2, 32}, {1, 64}, {1, 32}};
  for (int i = 0; i < 6; ++i) {
    const int d = kHeadDims[i];
    context() = "d=" + std::to_string(d);
    const fc::Fa2FwdTile t = fc::fa2_fwd_tile(d);
    const fc::Fa2FwdLayout L = fc::fa2_fwd_layout(d, t);
    CHECK_EQ(L.block_m, expect_rows[i]);
    CHECK_EQ(t.block_n, expect_n[i]);
    CHECK(fc::fa2_fwd_acc_regs(d, t) <= fc::kFa2AccRegBudget);
    CHECK(L.bytes <= fc::kFa2TwoCtaSmem);
    CHECK(2 * (L.bytes + 1024) <= std::size_t(228 * 1024));  // two CTAs per H100 SM
    for (const fc::Fa2FwdTile& o : order) {  // every preferred candidate before it misses a budget
      if (o.row_frags == t.row_frags && o.block_n == t.block_n) break;
      CHECK(!fc::fa2_fwd_tile_fits(d, o));
    }
    check_fa2_forward_layout(d, t);
    const bool small = L.bytes > fc::kFa2SmallestOptin;
    CHECK_EQ(fc::fa2_fwd_has_small(d), small);
    if (small) {
      const fc::Fa2FwdTile s = fc::fa2_fwd_small_tile(d);
      CHECK_EQ(s.row_frags, t.row_frags);
      CHECK_EQ(s.block_n, t.block_n / 2);
      CHECK(fc::fa2_fwd_layout(d, s).bytes <= fc::kFa2SmallestOptin);
      check_fa2_forward_layout(d, s);
    }
  }
  CHECK(fc::fa2_fwd_has_small(256));
  CHECK(!fc::fa2_fwd_has_small(128));
}

// The register-only forward's tile per head dim: FlashAttention-2's 128 x 128 at d <= 64 and
// 128 x 64 at d 96 and 128 (scores counted once: P takes their registers as 16-bit operands), in
// two CTAs' shared memory with the half-width scratch (a band of P as T; the epilogue's 16
// columns), the first of its preference order within both budgets; none where it is the general
// tile (d 192, 256: no second instantiation).
void test_fa2_forward_regs_tiles() {
  const int expect_rows[] = {128, 128, 128, 128, 64, 64};
  const int expect_n[] = {128, 128, 64, 64, 32, 32};
  const bool expect_has[] = {true, true, true, true, false, false};
  const fc::Fa2FwdTile order[] = {{2, 128}, {2, 64}, {2, 32}, {1, 64}, {1, 32}};
  for (int i = 0; i < 6; ++i) {
    const int d = kHeadDims[i];
    context() = "d=" + std::to_string(d);
    const fc::Fa2FwdTile t = fc::fa2_fwd_regs_tile(d);
    const fc::Fa2FwdLayout L = fc::fa2_fwd_layout(d, t, 2, true);
    CHECK_EQ(L.block_m, expect_rows[i]);
    CHECK_EQ(t.block_n, expect_n[i]);
    CHECK_EQ(fc::fa2_fwd_has_regs(d), expect_has[i]);
    CHECK(fc::fa2_fwd_regs_acc_regs(d, t) <= fc::kFa2AccRegBudget);
    CHECK(L.bytes <= fc::kFa2TwoCtaSmem);
    CHECK(2 * (L.bytes + 1024) <= std::size_t(228 * 1024));  // two CTAs per H100 SM
    for (const fc::Fa2FwdTile& o : order) {
      if (o == t) break;
      CHECK(!fc::fa2_fwd_regs_tile_fits(d, o));
    }
    // Regions apart and aligned as in the general layout; the scratch row holds a row of P as T
    // (2 ld_s halves >= Bc) and the epilogue's 16 columns, and is narrower than the general one.
    const std::size_t offs[] = {L.off_q,    L.off_k,    L.off_v, L.off_s,
                                L.off_rows, L.off_rowf, L.bytes};
    for (std::size_t o : offs) CHECK_EQ(o % 128, std::size_t(0));
    const std::size_t kv = std::size_t(t.block_n) * L.ld_qkv * 2;
    CHECK(L.off_v - L.off_k >= 2 * kv && L.off_s - L.off_v >= 2 * kv);
    CHECK(L.off_rows - L.off_s >= std::size_t(4) * 16 * L.ld_s * 4);
    CHECK_EQ(L.ld_s % 4, 0);
    CHECK(2 * L.ld_s >= t.block_n && L.ld_s >= 20);
    CHECK(L.ld_s < fc::fa2_fwd_layout(d, t).ld_s);
  }
}

// The accumulator layout the register softmax assumes: a bijection of the 16 x 16 tile onto
// (lane, element); a lane's elements with (i / 2) % 2 = h in row lane / 4 + 8 h; the 4 lanes of a
// quad (xor 1, 2: the softmax's shuffles) hold all 16 columns of their rows.
void test_fa2_register_layout() {
  int seen[16][16] = {};
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 8; ++i) {
      const int r = fc::acc_row(lane, i), c = fc::acc_col(lane, i);
      CHECK(r >= 0 && r < 16 && c >= 0 && c < 16);
      if (r < 0 || r >= 16 || c < 0 || c >= 16) continue;
      ++seen[r][c];
      CHECK_EQ(r, lane / 4 + 8 * ((i / 2) % 2));
    }
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) CHECK_EQ(seen[r][c], 1);
  for (int lane = 0; lane < 32; ++lane)
    for (int h = 0; h < 2; ++h) {
      int cols = 0;
      for (int q = 0; q < 4; ++q) {
        const int other = (lane & ~3) | q;  // lane ^ 1, lane ^ 2, lane ^ 3 and itself
        for (int j = 0; j < 4; ++j) {
          const int i = (j / 2) * 4 + h * 2 + j % 2;  // softmax_regs's elements of row half h
          CHECK_EQ(fc::acc_row(other, i), fc::acc_row(lane, i));
          cols |= 1 << fc::acc_col(other, i);
        }
      }
      CHECK_EQ(cols, 0xffff);
    }
}

// The shared-memory softmax's access pattern: each lane pair covers its row's columns once, and
// for the row strides of the table (and their small variants) every step's 32 float loads hit 32
// banks and its P stores (T, stride 2 ld_s) never put two words of one bank in a step.
void test_fa2_smem_softmax_banks() {
  for (int d : kHeadDims) {
    const fc::Fa2FwdTile tiles[] = {fc::fa2_fwd_tile(d), fc::fa2_fwd_small_tile(d)};
    for (const fc::Fa2FwdTile& t : tiles) {
      context() = "d=" + std::to_string(d) + " n=" + std::to_string(t.block_n);
      const int ld = fc::fa2_fwd_layout(d, t).ld_s, K = t.block_n / 2;
      for (int lane = 0; lane < 32; ++lane) {
        unsigned long long cols = 0;
        for (int k = 0; k < K; ++k) cols |= 1ull << fc::smem_softmax_col(lane, k, K);
        unsigned long long want = 0;
        for (int c = lane % 2; c < t.block_n; c += 2) want |= 1ull << c;
        CHECK(cols == want);
      }
      for (int k = 0; k < K; ++k) {
        unsigned load_banks = 0;
        int store_word[32];
        for (int b = 0; b < 32; ++b) store_word[b] = -1;
        bool store_ok = true;
        for (int lane = 0; lane < 32; ++lane) {
          const int r = lane / 2, c = fc::smem_softmax_col(lane, k, K);
          load_banks |= 1u << ((r * ld + c) % 32);
          const int word = (r * 2 * ld + c) / 2;  // the 4-byte word of the 2-byte P element
          int& w = store_word[word % 32];
          if (w != -1 && w != word) store_ok = false;
          w = word;
        }
        CHECK_EQ(load_banks, 0xffffffffu);
        CHECK(store_ok);
      }
    }
  }
}

void test_fa2_backward_configs() {
  for (int d : kHeadDims) {
    context() = "d=" + std::to_string(d);
    const fc::Fa2BwdConfig std_c = fc::fa2_bwd_config(d), fb = fc::fa2_bwd_fallback(d);
    CHECK(fc::fa2_bwd_config_valid(d, std_c));
    CHECK(fc::fa2_bwd_config_valid(d, fb));
    for (int st : {1, 2}) {
      check_fa2_layout(d, std_c, st);
      check_fa2_layout(d, fb, st);
    }
    // The standard tiles fit an A100 (and so an H100); the fallback fits 99 KiB parts.
    CHECK(fc::fa2_bwd_smem_bytes(d, std_c) <= std::size_t(kA100));
    CHECK(fc::fa2_bwd_smem_bytes(d, fb) <= std::size_t(kSmall));
    // The deterministic dQ pass (one buffer) never needs more than the main kernel.
    CHECK(fc::fa2_bwd_layout(d, std_c, 1).bytes <= fc::fa2_bwd_smem_bytes(d, std_c));
    CHECK(fc::pick_fa2_bwd(d, kH100) == fc::Fa2BwdVariant::standard);
    CHECK(fc::pick_fa2_bwd(d, kA100) == fc::Fa2BwdVariant::standard);
    const bool std_fits_small = fc::fa2_bwd_smem_bytes(d, std_c) <= std::size_t(kSmall);
    CHECK(fc::pick_fa2_bwd(d, kSmall) ==
          (std_fits_small ? fc::Fa2BwdVariant::standard : fc::Fa2BwdVariant::fallback));
    CHECK(fc::pick_fa2_bwd(d, 16 * 1024) == fc::Fa2BwdVariant::none);
    // The dense calls' tiles: valid, at least as many keys as the standard ones (the launcher's
    // grid checks use the standard's), fitting an H100 (227 KiB), the standard's above d 128.
    const fc::Fa2BwdConfig dense = fc::fa2_bwd_dense_config(d);
    CHECK(fc::fa2_bwd_config_valid(d, dense));
    check_fa2_layout(d, dense, dense.stages);
    CHECK(dense.block_n >= std_c.block_n && dense.block_m >= std_c.block_m);
    CHECK(fc::fa2_bwd_smem_bytes(d, dense) <= std::size_t(kH100));
    if (d > 128) CHECK(dense.block_n == std_c.block_n && dense.stages == std_c.stages);
    // The warp grid: 8 warps = key bands x head-dim slices, every slice whole 16-column tiles.
    CHECK_EQ(fc::fa2_bwd_key_bands(std_c) * fc::fa2_bwd_dim_splits(std_c), fc::kBwdWarps);
    CHECK_EQ((d / 16) % fc::fa2_bwd_dim_splits(std_c), 0);
    CHECK_EQ((d / 16) % fc::fa2_bwd_dim_splits(fb), 0);
  }
  // A config that leaves warps without a whole slice is refused.
  CHECK(!fc::fa2_bwd_config_valid(96, fc::Fa2BwdConfig{64, 32, 2}));  // 4 slices of 6 tiles
  CHECK(!fc::fa2_bwd_config_valid(64, fc::Fa2BwdConfig{64, 48, 2}));  // 3 bands of 8 warps
}

// The fa2 backward writes P and dS from the accumulators (bwd::probs_and_ds_in_registers): on the
// sm_80/sm_90 layout elements 2k and 2k + 1 of a lane are (r, c) and (r, c + 1) with c even
// (FragMap::pairs, checked on the device too), so each pair is one 32-bit store; and for every
// layout's row stride (2 ld_s elements of T: ld_s words) one store instruction's 32 words fall in
// 32 different banks.
void test_fa2_backward_pair_stores() {
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 8; i += 2) {
      CHECK_EQ(fc::acc_row(lane, i + 1), fc::acc_row(lane, i));
      CHECK_EQ(fc::acc_col(lane, i) % 2, 0);
      CHECK_EQ(fc::acc_col(lane, i + 1), fc::acc_col(lane, i) + 1);
    }
  for (int d : kHeadDims)
    for (const fc::Fa2BwdConfig c :
         {fc::fa2_bwd_config(d), fc::fa2_bwd_fallback(d), fc::fa2_bwd_dense_config(d)})
      for (int st : {1, 2}) {
        const int ld_w = fc::fa2_bwd_layout(d, c, st).ld_p / 2;  // a row of P in 4-byte words
        context() = "d=" + std::to_string(d) + " ld_w=" + std::to_string(ld_w);
        for (int rf = 0; rf < c.block_m / 16; ++rf)
          for (int nf = 0; nf < c.block_n / 16; ++nf)
            for (int i = 0; i < 8; i += 2) {
              unsigned banks = 0;
              for (int lane = 0; lane < 32; ++lane) {
                const int r = rf * 16 + fc::acc_row(lane, i), col = nf * 16 + fc::acc_col(lane, i);
                const int word = r * ld_w + col / 2;  // (r * ld_p + col) elements of 2 bytes
                banks |= 1u << (word % 32);
              }
              CHECK_EQ(banks, 0xffffffffu);
            }
      }
}

void test_fa2_backward_workspace() {
  const fc::Fa2BwdWorkspace w = fc::fa2_bwd_workspace(2, 3, 5, 64, false);
  CHECK_EQ(w.stats, int64_t(30));
  CHECK_EQ(w.dq, int64_t(30 * 64));
  CHECK_EQ(w.floats(), int64_t(60 + 30 * 64));
  const fc::Fa2BwdWorkspace det = fc::fa2_bwd_workspace(2, 3, 5, 64, true);
  CHECK_EQ(det.dq, int64_t(0));
  CHECK_EQ(fc::fa2_bwd_workspace(2, 3, 0, 64, false).floats(), int64_t(0));
}

void test_fa1_plans() {
  for (int d : kHeadDims)
    for (int optin : {kH100, kA100, kSmall})
      for (int64_t sram : {int64_t(0), int64_t(8192)})
        for (int64_t sq : {int64_t(1), int64_t(100), int64_t(5000)}) {
          context() = "d=" + std::to_string(d) + " optin=" + std::to_string(optin) +
                      " sram=" + std::to_string(sram) + " sq=sk=" + std::to_string(sq);
          const fc::Fa1Layout f = fc::plan_fa1(sram, sq, sq, d, 2, optin);
          const fc::Fa1BwdLayout b = fc::plan_fa1_backward(sram, sq, sq, d, 2, optin);
          CHECK(f.bytes <= unsigned(optin));
          CHECK(b.bytes <= unsigned(optin));
          for (int t : {f.Br, f.Bc, b.Br, b.Bc}) {
            CHECK(t >= 16);
            CHECK_EQ(t % 16, 0);
            CHECK(t <= fd::round_up(sq, 16));
          }
          // Never above the rule's sizes (Algorithm 4, line 2), except the one-tile minimum.
          const fd::Fa1Tiles rule = fd::fa1_tiles((sram > 0 ? sram : optin) / 2, d);
          CHECK(b.Bc <= (rule.Bc < 16 ? 16 : rule.Bc));
          CHECK(b.Br <= (rule.Br < 16 ? 16 : rule.Br));
          CHECK_EQ(b.ld_s % 4, 0);
          CHECK_EQ(b.ld_o % 4, 0);
          CHECK_EQ(b.ld_kv % 8, 0);
          const unsigned offs[] = {b.off_k, b.off_v,  b.off_dk, b.off_dv, b.off_q, b.off_do,
                                   b.off_s, b.off_dp, b.off_dq, b.off_l2, b.off_d};
          for (unsigned o : offs) CHECK_EQ(o % 128, 0u);
        }
  // The fa1 table of docs/development/cuda/forward.md, H100, long sequences: the forward plan
  // keeps its sizes.
  const fc::Fa1Layout h128 = fc::plan_fa1(0, 1 << 20, 1 << 20, 128, 2, kH100);
  CHECK_EQ(h128.Bc, 112);
  CHECK_EQ(h128.Br, 112);
  CHECK_EQ(h128.bytes, 203392u);
  const fc::Fa1Layout h64 = fc::plan_fa1(0, 1 << 20, 1 << 20, 64, 2, kH100);
  CHECK_EQ(h64.Bc, 368);
  CHECK_EQ(h64.Br, 64);
  // Too little shared memory for 16 x 16 tiles: a clear error naming the kernel.
  bool threw = false;
  try {
    fc::plan_fa1_backward(0, 100, 100, 256, 2, 8 * 1024);
  } catch (const flashdl::Error& e) {
    threw = e.kind() == flashdl::ErrorKind::unsupported &&
            std::string(e.what()).find("fa1 backward") != std::string::npos;
  }
  CHECK(threw);
}

// Every visible (i, j) lies in a block the range covers, for key blocks (query ranges) and query
// blocks (key ranges), over random windows and shapes; empty ranges have no visible pair.
void test_block_ranges() {
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> len(0, 90), win(-1, 20), blk(1, 24);
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t sq = len(rng), sk = len(rng), left = win(rng), right = win(rng), block = blk(rng);
    const fd::Mask m = fd::make_mask(sq, sk, left, right);
    context() = "sq=" + std::to_string(sq) + " sk=" + std::to_string(sk) + " w=(" +
                std::to_string(left) + "," + std::to_string(right) +
                ") block=" + std::to_string(block);
    for (int64_t j0 = 0; j0 < sk; j0 += block) {
      const int64_t j1 = j0 + block < sk ? j0 + block : sk;
      const fd::BlockRange r = fd::query_blocks_for_keys(m, j0, j1, block);
      for (int64_t i = 0; i < sq; ++i)
        for (int64_t j = j0; j < j1; ++j)
          if (m.visible(i, j)) CHECK(i / block >= r.begin && i / block < r.end);
      CHECK(r.begin <= r.end);
      CHECK(r.end <= fd::ceil_div(sq, block));
    }
    for (int64_t i0 = 0; i0 < sq; i0 += block) {
      const int64_t i1 = i0 + block < sq ? i0 + block : sq;
      const fd::BlockRange r = fd::key_blocks_for_queries(m, i0, i1, block);
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = 0; j < sk; ++j)
          if (m.visible(i, j)) CHECK(j / block >= r.begin && j / block < r.end);
      CHECK(r.begin <= r.end);
      CHECK(r.end <= fd::ceil_div(sk, block));
    }
  }
  CHECK_EQ(fd::query_blocks_for_keys(fd::make_mask(0, 10, -1, -1), 0, 10, 4).size(), int64_t(0));
  CHECK_EQ(fd::key_blocks_for_queries(fd::make_mask(10, 0, -1, -1), 0, 10, 4).size(), int64_t(0));
}

// The block-mask questions the CUDA kernels ask of a tile (which pairs to compute, which take the
// unmasked path, which rows to zero-fill instead of load) against brute force over its elements.
void test_block_mask_tiles() {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> len(1, 70), blk(1, 30), tile(1, 40);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t sq = len(rng), sk = len(rng), bq = blk(rng), bk = blk(rng);
    const int64_t nbq = fd::ceil_div(sq, bq), nbk = fd::ceil_div(sk, bk);
    std::vector<uint8_t> bits(static_cast<size_t>(nbq * nbk));
    for (auto& b : bits) b = static_cast<uint8_t>(rng() % 3 == 0);
    fd::BlockMask m;
    m.blocks = bits.data();
    m.row_stride = nbk;
    m.block_q = bq;
    m.block_k = bk;
    context() = "sq=" + std::to_string(sq) + " sk=" + std::to_string(sk) + " blocks=(" +
                std::to_string(bq) + "," + std::to_string(bk) + ")";
    const int64_t tm = tile(rng), tn = tile(rng);
    for (int64_t i0 = 0; i0 < sq; i0 += tm)
      for (int64_t j0 = 0; j0 < sk; j0 += tn) {
        const int64_t i1 = std::min(i0 + tm, sq), j1 = std::min(j0 + tn, sk);
        bool any = false, all = true;
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t j = j0; j < j1; ++j) {
            any = any || m.visible(i, j);
            all = all && m.visible(i, j);
          }
        const fd::BlockMask::Cover c = m.cover(i0, i1, j0, j1);
        CHECK(c.any == any);
        CHECK(c.all == all);
        for (int64_t i = i0; i < i1; ++i) {
          bool row = false;
          for (int64_t j = j0; j < j1; ++j) row = row || m.visible(i, j);
          CHECK(m.row_any(i, j0, j1) == row);
        }
        for (int64_t j = j0; j < j1; ++j) {
          bool col = false;
          for (int64_t i = i0; i < i1; ++i) col = col || m.visible(i, j);
          CHECK(m.col_any(j, i0, i1) == col);
        }
      }
  }
  const fd::BlockMask dense;
  CHECK(dense.cover(0, 5, 0, 5).all && dense.row_any(3, 0, 5) && dense.col_any(3, 0, 5));
}

// Varlen offsets as the kernels read them: exact for valid offsets (strided too), clamped into the
// arrays and the max_seqlen bounds for any others; dense calls see the whole batch entry.
void test_sequences() {
  flashdl::Params p{};
  p.seqlen_q = 7;
  p.seqlen_k = 9;
  fd::Sequence d = fd::sequence_of(p, 3);
  CHECK(d.q0 == 0 && d.k0 == 0 && d.sq == 7 && d.sk == 9);
  const int32_t cq[] = {0, -1, 3, -1, 3, -1, 10, -1}, ck[] = {0, 4, 4, 9};
  p.cu_seqlens_q = cq;
  p.cu_seqlens_k = ck;
  p.cu_seqlens_q_stride = 2;
  p.cu_seqlens_k_stride = 1;
  p.total_q = 10;
  p.total_k = 9;
  const fd::Sequence s0 = fd::sequence_of(p, 0), s1 = fd::sequence_of(p, 1),
                     s2 = fd::sequence_of(p, 2);
  CHECK(s0.q0 == 0 && s0.sq == 3 && s0.k0 == 0 && s0.sk == 4);
  CHECK(s1.q0 == 3 && s1.sq == 0 && s1.k0 == 4 && s1.sk == 0);
  CHECK(s2.q0 == 3 && s2.sq == 7 && s2.k0 == 4 && s2.sk == 5);
  // Offsets that break the rules: decreasing, negative, past the total, longer than max_seqlen.
  const int32_t bad_q[] = {5, 2, -4, 100}, bad_k[] = {0, 50, 60, 70};
  p.cu_seqlens_q = bad_q;
  p.cu_seqlens_k = bad_k;
  p.cu_seqlens_q_stride = 1;
  p.seqlen_q = 4;  // max_seqlen_q
  for (int64_t b = 0; b < 3; ++b) {
    const fd::Sequence s = fd::sequence_of(p, b);
    CHECK(s.q0 >= 0 && s.q0 + s.sq <= p.total_q && s.sq >= 0 && s.sq <= p.seqlen_q);
    CHECK(s.k0 >= 0 && s.k0 + s.sk <= p.total_k && s.sk >= 0 && s.sk <= p.seqlen_k);
  }
}

// The decode kernel's layouts: aligned, disjoint regions of the sizes its tiles need, the
// epilogue's O within the K/V buffers, one thread per K and V row of a tile; the variant per
// device.
void test_decode_layouts() {
  for (int d : kHeadDims) {
    for (int w : {4, 2}) {
      context() = "d=" + std::to_string(d) + " warps=" + std::to_string(w);
      const fc::DecodeLayout L = fc::decode_layout(d, w);
      const std::size_t offs[] = {L.off_q,    L.off_k,     L.off_v, L.off_s,
                                  L.off_rows, L.off_stats, L.bytes};
      for (std::size_t o : offs) CHECK_EQ(o % 128, std::size_t(0));
      CHECK_EQ(L.threads, 2 * L.block_n);
      CHECK_EQ(L.block_n, 16 * w);
      CHECK(L.off_k - L.off_q >= std::size_t(fc::kDecodeRows) * L.ld_qkv * 2);
      CHECK(L.kv_stage_bytes >= std::size_t(L.block_n) * L.ld_qkv * 2);
      CHECK(L.off_v - L.off_k >= fc::kDecodeStages * L.kv_stage_bytes);
      CHECK(L.off_s - L.off_v >= fc::kDecodeStages * L.kv_stage_bytes);
      CHECK(L.off_rows - L.off_s >= std::size_t(w) * fc::kDecodeRows * L.ld_s * 4);
      CHECK(L.off_stats - L.off_rows >= std::size_t(fc::kDecodeStages) * 2 * L.block_n * 8);
      CHECK(L.bytes - L.off_stats >= (3 * std::size_t(w) + 1) * fc::kDecodeRows * 4);
      CHECK(L.merge_bytes <= L.off_s - L.off_k);  // over K and V, not S or the stats
      // wmma: ld a multiple of 8 halves and 4 floats; P in place (2 * ld_s halves) holds a row.
      CHECK(L.ld_qkv % 8 == 0 && L.ld_s % 4 == 0 && (2 * L.ld_s) % 8 == 0 && L.ld_o % 4 == 0);
      CHECK(16 * 2 <= L.ld_s * 4);
    }
    context() = "d=" + std::to_string(d);
    CHECK_EQ(fc::pick_decode_warps(d, kH100), 4);
    CHECK_EQ(fc::pick_decode_warps(d, kA100), 4);
    // 99 KiB parts: the 4-warp tiles up to d = 128 (82 KiB there), 2 warps (32-key tiles) above.
    CHECK_EQ(fc::pick_decode_warps(d, kSmall), d <= 128 ? 4 : 2);
    CHECK(fc::decode_has_fallback(d) == (d > 128));
    CHECK_EQ(fc::pick_decode_warps(d, 16 * 1024), 0);
  }
  CHECK_EQ(fc::decode_layout(128, 4).bytes, std::size_t(82048));
  CHECK_EQ(fc::decode_row_chunks(1, 1), int64_t(1));
  CHECK_EQ(fc::decode_row_chunks(8, 2), int64_t(1));
  CHECK_EQ(fc::decode_row_chunks(17, 1), int64_t(2));
  CHECK_EQ(fc::decode_row_chunks(4, 0), int64_t(1));  // seqlen_q 0: a valid (unlaunched) grid
}

// The splits of a sequence: in order, they partition the keys its rows see, each a whole number
// of tiles but the last; every visible (i, j) falls in exactly one split (brute force over masks).
void test_decode_splits() {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> len(0, 300), qlen(0, 9), win(-1, 40), spl(1, 9);
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t sq = qlen(rng), sk = len(rng), left = win(rng), right = win(rng);
    const int64_t splits = spl(rng), tile = trial % 2 ? 64 : 32;
    const fd::Mask m = fd::make_mask(sq, sk, left, right);
    context() = "sq=" + std::to_string(sq) + " sk=" + std::to_string(sk) + " w=(" +
                std::to_string(left) + "," + std::to_string(right) +
                ") splits=" + std::to_string(splits) + " tile=" + std::to_string(tile);
    const fc::KeyRange vis = fc::visible_keys(m);
    int64_t next = vis.begin;
    for (int64_t s = 0; s < splits; ++s) {
      const fc::KeyRange r = fc::split_keys(vis, s, splits, tile);
      CHECK(r.begin <= r.end);
      if (r.begin == r.end) continue;
      CHECK_EQ(r.begin, next);
      CHECK_EQ((r.begin - vis.begin) % tile, int64_t(0));
      next = r.end;
    }
    if (vis.begin < vis.end) CHECK_EQ(next, vis.end);
    for (int64_t i = 0; i < sq; ++i)
      for (int64_t j = 0; j < sk; ++j) {
        if (!m.visible(i, j)) continue;
        int owners = 0;
        for (int64_t s = 0; s < splits; ++s) {
          const fc::KeyRange r = fc::split_keys(vis, s, splits, tile);
          owners += j >= r.begin && j < r.end;
        }
        CHECK_EQ(owners, 1);
      }
  }
  const fc::KeyRange none = fc::visible_keys(fd::make_mask(3, 0, -1, -1));
  CHECK(none.begin >= none.end);
  CHECK(fc::split_keys(none, 0, 4, 64).begin == fc::split_keys(none, 0, 4, 64).end);
}

// The split count: the caller's (capped by tiles), else none when the CTAs fill the SMs, else two
// CTAs per SM within kDecodeMinSplitKeys keys a split and kDecodeMaxSplits; the workspace.
void test_decode_num_splits() {
  CHECK_EQ(fc::decode_num_splits(3, 1, 1000, 64, 132), int64_t(3));
  CHECK_EQ(fc::decode_num_splits(1000, 1, 1000, 64, 132), int64_t(16));  // tiles of 64 keys
  CHECK_EQ(fc::decode_num_splits(5, 1, 0, 64, 132), int64_t(1));
  CHECK_EQ(fc::decode_num_splits(0, 132, 100000, 64, 132), int64_t(1));  // one wave already
  CHECK_EQ(fc::decode_num_splits(0, 8, 100, 64, 132), int64_t(1));       // too few keys to split
  CHECK_EQ(fc::decode_num_splits(0, 8, 100000, 64, 132), int64_t(33));   // 2 x 132 / 8
  CHECK_EQ(fc::decode_num_splits(0, 8, 2048, 64, 132), int64_t(8));      // 256 keys a split
  CHECK_EQ(fc::decode_num_splits(0, 1, 1 << 20, 64, 132), fc::kDecodeMaxSplits);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 500; ++trial) {
    const int64_t ctas = 1 + rng() % 300, keys = rng() % 70000;
    const int64_t req = rng() % 4 == 0 ? rng() % 50 : 0;
    const int sms = 1 + int(rng() % 140);
    context() = "ctas=" + std::to_string(ctas) + " keys=" + std::to_string(keys) +
                " requested=" + std::to_string(req) + " sms=" + std::to_string(sms);
    const int64_t s = fc::decode_num_splits(req, ctas, keys, 64, sms);
    CHECK(s >= 1);
    CHECK(s <= std::max<int64_t>(1, fd::ceil_div(keys, 64)));
    if (req == 0) CHECK(s <= fc::kDecodeMaxSplits);
    if (req == 0 && s > 1) CHECK(keys / s >= fc::kDecodeMinSplitKeys);
  }
  const fc::DecodeWorkspace one = fc::decode_workspace(2, 1, 8, 3, 64);
  CHECK_EQ(one.floats(), int64_t(0));
  const fc::DecodeWorkspace w = fc::decode_workspace(2, 5, 8, 3, 64);
  CHECK_EQ(w.rows, int64_t(24));
  CHECK_EQ(w.lse, int64_t(2 * 5 * 24));
  CHECK_EQ(w.o, int64_t(2 * 5 * 24 * 64));
}

}  // namespace

int main() {
  run_test("cuda plan: fa2 forward tile table and layouts", test_fa2_forward_tiles);
  run_test("cuda plan: fa2 forward register-only tiles", test_fa2_forward_regs_tiles);
  run_test("cuda plan: fa2 forward register layout", test_fa2_register_layout);
  run_test("cuda plan: fa2 forward shared-memory softmax banks", test_fa2_smem_softmax_banks);
  run_test("cuda plan: fa2 backward configs, layouts, variants", test_fa2_backward_configs);
  run_test("cuda plan: fa2 backward paired P/dS stores", test_fa2_backward_pair_stores);
  run_test("cuda plan: fa2 backward workspace", test_fa2_backward_workspace);
  run_test("cuda plan: fa1 forward and backward tiles", test_fa1_plans);
  run_test("cuda plan: block ranges vs brute force", test_block_ranges);
  run_test("cuda plan: varlen sequences and their clamping", test_sequences);
  run_test("cuda plan: block-mask tile cover, rows and keys vs brute force", test_block_mask_tiles);
  run_test("cuda plan: decode layouts and variants", test_decode_layouts);
  run_test("cuda plan: decode key splits vs brute force", test_decode_splits);
  run_test("cuda plan: decode split count and workspace", test_decode_num_splits);
  return finish();
}
