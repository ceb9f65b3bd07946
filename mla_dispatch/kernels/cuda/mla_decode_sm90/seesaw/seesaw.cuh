// [notes]: docs/notes/cuda_sm90.md, the development history these comments cite
// SM90 MLA decode, mainloop seesaw (Mainloop::kSeesaw; v5 in the history): two KV tiles in flight, one per
// warpgroup, with the softmax of one warpgroup running while the other's GEMMs occupy the tensor cores
// (the "seesaw" schedule of FlashMLA's SM90 kernel, described in DeepSeek's
// "A Deep-Dive into the New Flash MLA Kernel", 2025, and csrc/sm90/kernels/
// splitkv_mla.cu of deepseek-ai/FlashMLA). Our own code; the schedule is theirs.
//
// Why ([notes]): v2 runs S -> softmax -> P V of one 64-token tile serially in both
// warpgroups, so the tensor cores idle through every softmax and barrier. Here the
// tiles of an item go in pairs (a = 2i in stage 0, b = 2i+1 in stage 1):
//   warpgroup 0 (WG0) owns S_a = Q K_a^T (m64n64k16, all 64 tokens) and O[:, 0:256);
//   warpgroup 1 (WG1) owns S_b and O[:, 256:512).
// Per pair, with m the running row maximum in shared memory (sM):
//   WG0: softmax(S_a) against m  -> P_a, scale0     | WG1: (S_b of the last pair done)
//   WG0: O_L = O_L*scale0 + P_a V_aL (P_a in regs)  | WG1: softmax(S_b) -> P_b, scale1;
//                                                   |      O_R *= scale0*scale1
//   WG0: P_a *= scale1 -> sP0                        | WG1: P_b -> sP1; O_R += P_b V_bR
//   WG0: O_L *= scale1; O_L += sP1 V_bL             | WG1: O_R += sP0 V_aR
//   WG0: S_{a+2} (K blocks 0..3, then 4..8)         | WG1: S_{b+2}
// so each softmax overlaps the other warpgroup's GEMMs.
//
// Loads: TMA (cp.async.bulk.tensor, 128-byte swizzle = the Swizzle<3,4,3> layout of
// traits.cuh), one 64x64 box per column block, 9 per tile, each on its own mbarrier (S
// starts on a block as soon as it lands, as FlashMLA does), refilled by the warpgroup that
// reads it last:
//   stage 0: blocks 0..3 (V_L)        by WG0 after P_a V_aL,
//            blocks 4..8              by WG1 after sP0 V_aR;
//   stage 1: blocks 0..3 and 8        by WG0 after sP1 V_bL (sP1 is block 8, below),
//            blocks 4..7 (V_R)        by WG1 after P_b V_bR.
// Where a part's row tiles come in pairs (128 or 256 query rows per KV head), the plan runs each
// pair as a cluster of two CTAs (kPaired; LaunchConfig::paired) that start every item together: 1-6%
// faster on the FlashMLA grid. Multicasting each KV box to both CTAs of the pair was tried and not kept
// ([notes], "Eighteenth session").
// A 64-token tile must sit in one page, so this variant needs page_size % 64 == 0 and
// a bf16/fp16 cache that a tensor map describes (seesaw_fp8: fp8_e4m3); the binding refuses other
// caches (binding.cpp, check_config).
//
// Shared memory (common/seesaw_pair.cuh) is wgmma's: Q [64 x 576], two K stages, one P tile (sP0). sP1 lives in
// stage 1's column block 8 (K_b's RoPE part, dead once S_b is done; P V reads only
// blocks 0..7). FlashMLA puts it in Q's RoPE block and keeps that block of Q in
// registers; here those 16 registers were the difference between spilling or not.
//
// Masking: S of tokens past the item's end or past a causal row's limit is -inf; V
// rows past the end of a partial tile (unused cache slots, possibly NaN) are zeroed
// in shared memory before the P V that reads them. Both only in the last pairs of an
// item: a tile with >= 65 more tokens of the item after it needs neither (q_len <= 64).
//
// Bad block ids (docs/design.md §1): the thread that issues a tile's TMA boxes checks its page (loads.cuh, page_ok),
// loads block 0 in its place and sets the item's flag in shared memory (sBad[0], cleared by thread 0 when the item
// starts, read by every thread after the epilogue's barrier), so the item ends with NaN row sums, out and lse.
#pragma once
#include <cmath>
#include <cstdint>
#include <cuda.h>

#include "common/epilogue.cuh"
#include "common/loads.cuh"
#include "common/ptx.cuh"
#include "common/seesaw_pair.cuh"
#include "common/traits.cuh"
#include "common/gmma.cuh"

namespace mla_sm90 {

// The page of the 64 tokens from t0 of request `req`, for tma_tile: a bad block id is block 0, and *bad_flag = 1.
__device__ __forceinline__ int tile_page(const DecodeParams& p, int req, int t0, int* bad_flag) {
  const int page = p.block_table[(int64_t)req * p.bt_stride + t0 / p.page_size];
  if (page_ok(p, page)) return page;
  *bad_flag = 1;
  return 0;
}

// The 64 tokens from t0 (in block `page`, tile_page) of KV head kvh: the TMA boxes of column blocks [B0, B1) into
// `stage`, block b signalled on bars[b]. One thread calls this.
template <int B0, int B1, typename T>
__device__ __forceinline__ void tma_tile(const DecodeParams& p, const CUtensorMap* map, T* stage, uint64_t* bars,
                                         int page, int kvh, int t0) {
  const int in_page = t0 % p.page_size;
#pragma unroll
  for (int b = B0; b < B1; ++b) {
    mbar_arrive_expect_tx(bars + b, 64 * 64 * (int)sizeof(T));
    tma_load_4d(stage + b * 64 * 64, map, bars + b, 64 * b, kvh, in_page, page);
  }
}

// kPaired: launched in clusters of two row-tile CTAs of a part (grid y, seesaw/launch.cuh); a cluster barrier
// ends each item, so the pair starts the next one together. kv_map: the cache's tensor map (64 x 64 boxes).
template <typename T, bool kPaired>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    mla_decode_seesaw(const __grid_constant__ DecodeParams p, const __grid_constant__ CUtensorMap kv_map) {
  using TT = TypeTraits<T>;
  using L = Gmma128Tile64;
  using SS = Gmma<T>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem_base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  T* sQ = reinterpret_cast<T*>(smem_base);
  T* sK = sQ + Cfg::kQElems;
  T* sP0 = sK + Cfg::kStages * Cfg::kKElems;
  T* sP1 = sK + Cfg::kKElems + 8 * 64 * 64;                    // stage 1's RoPE block, dead after S_b
  float* sM = reinterpret_cast<float*>(sP0 + Cfg::kPElems);    // [64] running row max (base 2)
  // per-pair row scales, double-buffered by pair parity, so a warpgroup writing the next pair's
  // scales never touches the buffer the other may still read (the bar.arrive -> bar.sync chain
  // orders it anyway; racecheck flags these hand-offs either way: it does not model bar.arrive)
  float* sScale0 = sM + Cfg::kBlockM;                          // [2][64]
  float* sScale1 = sScale0 + 2 * Cfg::kBlockM;                 // [2][64]
  float* sSum = sScale1 + 2 * Cfg::kBlockM;                    // [2][64]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sSum + 2 * Cfg::kBlockM);  // [stage][column block]
  int* sBad = reinterpret_cast<int*>(bars + SeesawPair::kBars);              // [SeesawPair::kBadFlags]

  const int part = blockIdx.x, row_tile = blockIdx.y, kvh = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rg = warp % Cfg::kRowGroups, wg = warp / Cfg::kRowGroups, tid_wg = tid % 128;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  float out_scale = 1.f;
  const float score_scale = p.softmax_scale * out_scale * kLog2e;

  if (tid == 0) {
    for (int i = 0; i < 2 * SeesawPair::kBlocks; ++i) mbar_init(bars + i, 1);
    fence_mbar_init();
  }
  __syncthreads();
  int row_local[2], row_i[2], row_head[2];
  bool row_ok[2];
  acc_rows(p, row_tile, kvh, rg, lane, row_local, row_i, row_head, row_ok);
  uint32_t loads_done[2] = {0, 0};  // completed loads per stage before the current item (mbarrier phases)

  const int item_begin = p.part_offsets[part], item_end = p.part_offsets[part + 1];
  for (int item = item_begin; item < item_end; ++item) {
    const WorkItem w = load_item(p, item);
    const int req = w.req, tok_begin = w.tok_begin, tok_end = w.tok_end, slot = w.slot;
    if (req < 0) continue;
    const int seqlen = p.cache_seqlens[req];
    int limit[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) limit[h] = p.causal ? seqlen - p.q_len + row_i[h] : seqlen - 1;
    // tokens below this are visible to every row of the tile (causal: the later ones are cleaned, fix_hidden)
    const int unmasked_end = min(tok_end, p.causal ? seqlen - p.q_len + 1 : seqlen);
    const int num_tiles = (tok_end - tok_begin + Cfg::kBlockN - 1) / Cfg::kBlockN;
    auto t0_of = [&](int j) { return tok_begin + j * Cfg::kBlockN; };
    auto stage_of = [&](int j) { return sK + (j & 1) * Cfg::kKElems; };
    auto parity_of = [&](int j) { return (loads_done[j & 1] + (uint32_t)(j >> 1)) & 1u; };
    auto valid_of = [&](int j) { return min(Cfg::kBlockN, tok_end - t0_of(j)); };
    uint64_t* bars0 = bars;
    uint64_t* bars1 = bars + SeesawPair::kBlocks;
    // stage 1, blocks 0..3 and 8 (refilled together: WG0 reads them last)
    auto tma_stage1_lo = [&](int page, int t0) {
      tma_tile<0, 4>(p, &kv_map, stage_of(1), bars1, page, kvh, t0);
      tma_tile<8, 9>(p, &kv_map, stage_of(1), bars1, page, kvh, t0);
    };
    auto page_of = [&](int j) { return tile_page(p, req, t0_of(j), sBad); };
    // the item's bad-id flag: its last readers passed the previous item's closing barrier; its writers are thread 0
    // (program order) and thread 128 (after the barrier below)
    if (tid == 0) sBad[0] = 0;
    // -- first two tiles (TMA), Q (cp.async), sM, issued in the order S needs them: tile 0 and Q (S of tile 0),
    // then tile 1. Issuing tile 1 ahead of Q measured 0-1% slower where v5 runs (b = 32..96, h_q = 128;
    // [notes], "Seventeenth session"), which also has the per-column-block Q wait that was tried instead.
    if (tid == 0 && num_tiles > 0) tma_tile<0, 9>(p, &kv_map, stage_of(0), bars0, page_of(0), kvh, t0_of(0));
    load_q_tile_async<T, L>(p, sQ, req, row_tile, kvh);
    cp_async_commit();
    if (tid == 0 && num_tiles > 1) {
      const int page = page_of(1);
      tma_tile<4, 8>(p, &kv_map, stage_of(1), bars1, page, kvh, t0_of(1));
      tma_stage1_lo(page, t0_of(1));
    }
    if (tid < Cfg::kBlockM) sM[tid] = -INFINITY;
    cp_async_wait_all();
    fence_proxy_async_smem();
    __syncthreads();

    float acc_o[128], acc_s[32];
#pragma unroll
    for (int n = 0; n < 128; ++n) acc_o[n] = 0.f;
#pragma unroll
    for (int n = 0; n < 32; ++n) acc_s[n] = 0.f;
    // Pin the zeroing here: movs that ptxas sinks into an open wgmma stage serialise every
    // wgmma of the kernel (C7515, as in v3).
    fence_regs<128>(acc_o);
    fence_regs<32>(acc_s);
    float row_sum[2] = {0.f, 0.f};

    // the descriptor of a K-major operand block (common/seesaw_pair.cuh)
    auto desc = [](const void* base) { return seesaw_desc(base); };
    // S = Q K^T of tile j over column blocks [B0, B1), each block issued as soon as its TMA box has landed (a
    // wgmma.fence after every wait: ptxas would otherwise inject one on the wait loop's divergent path and serialise
    // the wgmmas, C7520)
    auto issue_s = [&](int j, auto b0, auto b1, bool first) {
      constexpr int B0 = decltype(b0)::value, B1 = decltype(b1)::value;
      const T* st = stage_of(j);
      uint64_t* sb = (j & 1) ? bars1 : bars0;
      const uint32_t par = parity_of(j);
      const uint64_t dq = desc(sQ), dk = desc(st);
#pragma unroll
      for (int blk = B0; blk < B1; ++blk) {
        mbar_wait(sb + blk, par);
        cute::warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t off = (uint64_t)(((blk * 64 * 64 + kk * 16) * (int)sizeof(T)) >> 4);
          gmma_call<typename SS::QK64>(dq + off, dk + off, acc_s, !(first && blk == B0 && kk == 0),
                                       std::make_index_sequence<32>{});
        }
      }
    };
    // column blocks [B0, B1) of tile j have landed (a V half read by the warpgroup that did not load them)
    auto wait_blocks = [&](int j, int b0, int b1) {
      uint64_t* sb = (j & 1) ? bars1 : bars0;
      for (int blk = b0; blk < b1; ++blk) mbar_wait(sb + blk, parity_of(j));
    };
    using I0 = std::integral_constant<int, 0>;
    using I4 = std::integral_constant<int, 4>;
    using I8 = std::integral_constant<int, 8>;
    using I9 = std::integral_constant<int, 9>;

    // this warpgroup's steps of a pair over its registers (common/seesaw_pair.cuh)
    auto softmax = [&](int j, auto mask_c, float (&scale)[2], float (&psum)[2]) {
      seesaw_softmax<decltype(mask_c)::value>(acc_s, sM, row_local, lane, tok_begin, j, tok_end, limit, score_scale,
                                              scale, psum);
    };
    auto scale_o = [&](const float (&s)[2]) { seesaw_scale_o(acc_o, s); };
    auto pack_p = [&](uint32_t (&rp)[16], const float (&f)[2]) { seesaw_pack_p<T>(acc_s, rp, f); };
    auto store_p = [&](T* sP, const uint32_t (&rp)[16]) { seesaw_store_p<T>(sP, rp, row_local, lane); };
    auto pv_rs = [&](const uint32_t (&rp)[16], const T* st) { seesaw_pv_rs<T>(acc_o, rp, st, wg); };
    auto pv_ss = [&](const T* sP, const T* st) { seesaw_pv_ss<T>(acc_o, sP, st, wg); };
    // zero this warpgroup's V columns of the rows past a partial tile's end, then sync the warpgroup
    auto fix_partial = [&](int j) {
      const int valid = valid_of(j);
      if (valid < Cfg::kBlockN) {
        zero_v_rows(stage_of(j), valid, wg, tid_wg);
        fence_proxy_async_smem();
        named_barrier(SeesawPair::kBarWg + wg, 128);
      }
    };
    // causal: the keys of tile j some row does not see out of this warpgroup's V columns (common/seesaw_pair.cuh); the
    // tile's S is done (its own, or the other warpgroup's before the P barrier this follows)
    auto fix_hidden = [&](int j, auto mask_c) {
      seesaw_fix_hidden<T, decltype(mask_c)::value>(stage_of(j), t0_of(j), tok_end, unmasked_end, p.causal, tid_wg, wg);
    };
    const float kOne[2] = {1.f, 1.f};

    if (wg == 0) {
      // ================= warpgroup 0: tiles 0, 2, 4, ...; O[:, 0:256)
      if (num_tiles > 0) {
        fence_regs<32>(acc_s);
        issue_s(0, I0{}, I9{}, true);
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
        fence_regs<32>(acc_s);
      }
      // One pair (a, b = a + 1). The conditions (tile b exists, tiles a + 2 / b + 2 exist) are
      // template arguments: a runtime branch around a wgmma still in flight makes ptxas
      // serialise every wgmma of the kernel (C7515; FlashMLA specialises the same way).
      auto pair = [&](int a, auto has_b_c, auto next_a_c, auto next_b_c) {
        constexpr bool kHasB = decltype(has_b_c)::value, kNextA = decltype(next_a_c)::value,
                       kNextB = decltype(next_b_c)::value;
        const int b = a + 1;
        const int buf = ((a >> 1) & 1) * Cfg::kBlockM;  // this pair's sScale0 / sScale1 buffer
        float sc0[2], psum[2];
        softmax(a, std::bool_constant<!kNextA>{}, sc0, psum);  // tile a + 2 exists: a is >= 65 tokens from the end
        scale_o(sc0);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          row_sum[h] = row_sum[h] * sc0[h] + psum[h];
          if (lane % 4 == 0) sScale0[buf + row_local[h]] = sc0[h];
        }
        named_barrier_arrive(SeesawPair::kBarScale0, 256);
        uint32_t rp[16];
        pack_p(rp, kOne);
        if constexpr (!kHasB) fix_partial(a);  // only the last tile can be partial
        fix_hidden(a, std::bool_constant<!kNextA>{});
        // O_L += P_a V_aL
        fence_regs<128>(acc_o);
        cute::warpgroup_arrive();
        pv_rs(rp, stage_of(a));
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
        fence_regs<128>(acc_o);
        if constexpr (kNextA) {  // stage 0, blocks 0..3: WG0 was the last reader
          if (tid_wg == 0) tma_tile<0, 4>(p, &kv_map, stage_of(a), bars0, page_of(a + 2), kvh, t0_of(a + 2));
        }
        named_barrier(SeesawPair::kBarScale1, 256);  // WG1's softmax of tile b: sM, sScale1
        float sc1[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) sc1[h] = sScale1[buf + row_local[h]];
        // P_a relative to the maximum after tile b, for WG1's P_a V_aR. Rescaled from its bf16/fp16
        // copy (a second rounding, only on rows whose maximum moved in tile b: sc1 == 1 is exact),
        // so the fp32 P_a need not stay live through P_a V_aL (it cost the registers that spilled).
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const float f = sc1[i & 1];
          if (f != 1.f) {
            const float2 v = TT::to_float2(*reinterpret_cast<const typename TT::T2*>(&rp[i]));
            typename TT::T2 w = TT::from_float2(v.x * f, v.y * f);
            rp[i] = *reinterpret_cast<uint32_t*>(&w);
          }
        }
        store_p(sP0, rp);
        fence_proxy_async_smem();
        named_barrier_arrive(SeesawPair::kBarP0, 256);
        scale_o(sc1);
        row_sum[0] *= sc1[0];
        row_sum[1] *= sc1[1];
        named_barrier(SeesawPair::kBarP1, 256);  // sP1 in place (or no tile b)
        fence_regs<128>(acc_o);
        if constexpr (kHasB) {
          wait_blocks(b, 0, 4);
          if constexpr (!kNextA) fix_partial(b);
          fix_hidden(b, std::bool_constant<!kNextB>{});
          // O_L += P_b V_bL
          cute::warpgroup_arrive();
          pv_ss(sP1, stage_of(b));
          cute::warpgroup_commit_batch();
        }
        if constexpr (kNextA) {
          // S_{a+2}: blocks 0..3 (refilled above), then 4..8 (refilled by WG1)
          fence_regs<32>(acc_s);
          issue_s(a + 2, I0{}, I4{}, true);
          cute::warpgroup_commit_batch();
          if constexpr (kNextB) {
            cute::warpgroup_wait<1>();  // sP1 V_bL done: stage 1, blocks 0..3 and 8 (sP1) are free
            if (tid_wg == 0) tma_stage1_lo(page_of(b + 2), t0_of(b + 2));
          }
          issue_s(a + 2, I4{}, I9{}, false);
          cute::warpgroup_commit_batch();
        }
        cute::warpgroup_wait<0>();
        fence_regs<128>(acc_o);
        fence_regs<32>(acc_s);
      };
      seesaw_pairs(num_tiles, pair);
    } else {
      // ================= warpgroup 1: tiles 1, 3, 5, ...; O[:, 256:512)
      if (num_tiles > 1) {
        fence_regs<32>(acc_s);
        issue_s(1, I4{}, I8{}, true);
        issue_s(1, I0{}, I4{}, false);
        issue_s(1, I8{}, I9{}, false);
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
        fence_regs<32>(acc_s);
      }
      auto pair = [&](int a, auto has_b_c, auto next_a_c, auto next_b_c) {
        constexpr bool kHasB = decltype(has_b_c)::value, kNextA = decltype(next_a_c)::value,
                       kNextB = decltype(next_b_c)::value;
        const int b = a + 1;
        const int buf = ((a >> 1) & 1) * Cfg::kBlockM;  // this pair's sScale0 / sScale1 buffer
        named_barrier(SeesawPair::kBarScale0, 256);  // WG0's softmax of tile a: sM, sScale0
        float sc0[2], sc1[2] = {1.f, 1.f}, psum[2] = {0.f, 0.f};
#pragma unroll
        for (int h = 0; h < 2; ++h) sc0[h] = sScale0[buf + row_local[h]];
        if constexpr (kHasB) softmax(b, std::bool_constant<!kNextB>{}, sc1, psum);  // b + 2 exists: >= 65 tokens follow b
        float both[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          both[h] = sc0[h] * sc1[h];
          row_sum[h] = row_sum[h] * both[h] + psum[h];
          if (lane % 4 == 0) sScale1[buf + row_local[h]] = sc1[h];
        }
        named_barrier_arrive(SeesawPair::kBarScale1, 256);
        scale_o(both);
        uint32_t rp[16];
        if constexpr (kHasB) {
          pack_p(rp, kOne);
          store_p(sP1, rp);
          fence_proxy_async_smem();
        }
        named_barrier_arrive(SeesawPair::kBarP1, 256);
        fence_regs<128>(acc_o);
        if constexpr (kHasB) {
          if constexpr (!kNextA) fix_partial(b);
          fix_hidden(b, std::bool_constant<!kNextB>{});
          // O_R += P_b V_bR
          cute::warpgroup_arrive();
          pv_rs(rp, stage_of(b));
          cute::warpgroup_commit_batch();
        }
        named_barrier(SeesawPair::kBarP0, 256);  // sP0 in place
        wait_blocks(a, 4, 8);
        if constexpr (!kHasB) fix_partial(a);
        fix_hidden(a, std::bool_constant<!kNextA>{});
        // O_R += P_a V_aR
        cute::warpgroup_arrive();
        pv_ss(sP0, stage_of(a));
        cute::warpgroup_commit_batch();
        if constexpr (kNextB) {
          cute::warpgroup_wait<1>();  // P_b V_bR done: stage 1, blocks 4..7 are free
          if (tid_wg == 0) tma_tile<4, 8>(p, &kv_map, stage_of(b), bars1, page_of(b + 2), kvh, t0_of(b + 2));
        }
        cute::warpgroup_wait<0>();
        fence_regs<128>(acc_o);
        if constexpr (kNextA) {  // stage 0, blocks 4..8: WG1 was the last reader
          if (tid_wg == 0) tma_tile<4, 9>(p, &kv_map, stage_of(a), bars0, page_of(a + 2), kvh, t0_of(a + 2));
        }
        if constexpr (kNextB) {
          fence_regs<32>(acc_s);
          issue_s(b + 2, I4{}, I8{}, true);
          issue_s(b + 2, I0{}, I4{}, false);
          issue_s(b + 2, I8{}, I9{}, false);
          cute::warpgroup_commit_batch();
          cute::warpgroup_wait<0>();
          fence_regs<32>(acc_s);
        }
      };
      seesaw_pairs(num_tiles, pair);
    }
    loads_done[0] += (uint32_t)(num_tiles + 1) / 2;
    loads_done[1] += (uint32_t)num_tiles / 2;

    // -- epilogue: both warpgroups' row sums, final max from sM
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_sum[h] += __shfl_xor_sync(0xffffffff, row_sum[h], 1);
      row_sum[h] += __shfl_xor_sync(0xffffffff, row_sum[h], 2);
      if (lane % 4 == 0) sSum[wg * Cfg::kBlockM + row_local[h]] = row_sum[h];
    }
    __syncthreads();
    const bool poisoned = sBad[0] != 0;  // the item met a bad block id
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float total = poison_sum(sSum[row_local[h]] + sSum[Cfg::kBlockM + row_local[h]], poisoned);
      const float row_max = sM[row_local[h]];
      const bool has_keys = total != 0.f;
      const float inv = has_keys ? out_scale / total : 0.f;
      const float lse_val = has_keys ? (row_max + log2f(total)) * kLn2 : (slot < 0 ? INFINITY : -INFINITY);
      if (!row_ok[h]) continue;
      store_acc_row<T>(p, acc_o, h, wg * 256, inv, lse_val, req, slot, row_i[h], row_head[h],
                       wg == 0 && lane % 4 == 0);
    }
    // sQ, sK, sM, sSum are reused by the next item
    if constexpr (kPaired) cluster_sync();
    else __syncthreads();
  }
}

}  // namespace mla_sm90
