// SM90 MLA decode, mainloop wgmma (Mainloop::kWgmma; v2 in the history): a persistent CTA per (split-KV part,
// 64-row query tile, KV head) walks its items of the split-KV schedule (mla_dispatch/metadata/schedule.py), streams
// each item's KV tokens in 64-token tiles through a two-stage shared-memory ring (cp.async for bf16/fp16 caches; fp8
// caches loaded into registers one tile ahead and dequantised while being stored), and keeps an online softmax in
// fp32 (base-2 exponents, FlashMLA's trick). V is the first 512 channels of K, so one tile feeds both GEMMs (the
// MQA-mode absorption of FlashMLA and FlashMLA-ETAP).
//
// Two consumer warpgroups (FlashMLA's split of the 512-wide output), both GEMMs on wgmma from shared memory:
//   S = Q K^T : warpgroup g computes S[:, 32g .. 32g+32) with m64n32k16 (A = Q,
//               B = K, both K-major, 128-byte swizzle), 36 k-steps over D_qk = 576;
//   softmax   : the two warpgroups exchange row maxima through shared memory and
//               write their halves of P (q dtype) to one [64 x 64] tile;
//   O += P V  : warpgroup g computes O[:, 256g .. 256g+256) with m64n256k16,
//               A = P (K-major), B = V = the same K tile read MN-major.
// Warp w owns query rows 16 (w % 4) .. + 16 of the tile in both GEMMs.
//
// Masking: tokens past the item's end are zero-filled (never read), so NaN poison in unused cache slots cannot reach
// P V; causal rows mask tokens past L - s_q + i. A row with no visible key gets out = 0 and lse = +inf (final) or
// lse = -inf (partial, so the combine gives it zero weight).
//
// Sparse launches (params.h, DecodeParams::sparse): a -1 entry of the table is a skipped top-k slot, zero-filled
// like a token past the end and masked in every tile.
//
// Bad block ids: every thread checks the pages of the token rows it loads (loads.cuh, checked_page: block 0 is read
// instead) and keeps the largest id it read for the item; the epilogue's barrier ORs "that id is bad" over the CTA,
// and an item that met a bad id ends with NaN row sums, so NaN out and lse in every row (docs/design.md §1).
#pragma once
#include <cmath>
#include <cstdint>

#include "common/combine.cuh"
#include "common/epilogue.cuh"
#include "common/loads.cuh"
#include "common/ptx.cuh"
#include "common/traits.cuh"
#include "common/gmma.cuh"

namespace mla_sm90 {

template <typename T, int KvFmt, bool kSparse>
__global__ void __launch_bounds__(Cfg::kThreads, 1) mla_decode_wgmma(const __grid_constant__ DecodeParams p) {
  using TT = TypeTraits<T>;
  using L = Gmma128Tile64;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // wgmma's 128-byte swizzle is a function of address bits [4:10): tiles start at
  // 1024-byte boundaries (kSmemBytes reserves the slack).
  uint8_t* smem_base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  T* sQ = reinterpret_cast<T*>(smem_base);
  T* sK = sQ + Cfg::kQElems;
  T* sP = sK + Cfg::kStages * Cfg::kKElems;
  float* sMax = reinterpret_cast<float*>(sP + Cfg::kPElems);  // [2][64]
  float* sSum = sMax + 2 * Cfg::kBlockM;                        // [2][64]

  const int part = blockIdx.x, row_tile = blockIdx.y, kvh = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // half = warpgroup, through a shuffle from lane 0 so the compiler knows it is warp-uniform and keeps the
  // wgmma descriptors that depend on it in uniform registers (CUTLASS's canonical_warp_group_idx)
  const int rg = warp % Cfg::kRowGroups;
  const int half = __shfl_sync(0xffffffff, warp / Cfg::kRowGroups, 0);
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;

  float out_scale = 1.0f;
  if constexpr (KvFmt == kKvFp8E4M3) out_scale = *p.kv_scale;
  const float score_scale = p.softmax_scale * out_scale * kLog2e;

  int row_local[2], row_i[2], row_head[2];
  bool row_ok[2];
  acc_rows(p, row_tile, kvh, rg, lane, row_local, row_i, row_head, row_ok);

  const int item_begin = p.part_offsets[part], item_end = p.part_offsets[part + 1];
  for (int item = item_begin; item < item_end; ++item) {
    const WorkItem w = load_item(p, item);
    const int req = w.req, tok_begin = w.tok_begin, slot = w.slot;
    if (req < 0) continue;
    const int seqlen = p.cache_seqlens[req];
    // A sparse launch's length is its list's (topk_length: entries past it are never read, tiles past it skipped)
    const int tok_end = kSparse ? min(w.tok_end, max(seqlen, tok_begin)) : w.tok_end;
    int limit[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) limit[h] = p.causal ? seqlen - p.q_len + row_i[h] : seqlen - 1;
    // tokens below this are visible to every row of the tile (tiles entirely below it skip the mask)
    const int unmasked_end = min(tok_end, p.causal ? seqlen - p.q_len + 1 : seqlen);

    // -- Q tile
    load_q_tile_async<T, L, KvFmt == kKvFp8DsV4 ? kDsV4HeadDim / 8 : Cfg::kChunksQK>(p, sQ, req, row_tile, kvh);
    const int num_tiles = (tok_end - tok_begin + Cfg::kBlockN - 1) / Cfg::kBlockN;
    Fp8Stage8B<2> fp8_stage;
    uint32_t max_id = 0;  // the largest block id this thread read for the item, as unsigned (loads.cuh)
    if (num_tiles > 0) {
      if constexpr (KvFmt == kKvSameAsQ) {
        if constexpr (kSparse)
          load_kv_async_sparse<T, L>(p, sK, req, kvh, tok_begin, tok_end, max_id);
        else
          load_kv_async<T, L>(p, sK, req, kvh, tok_begin, tok_end, max_id);
      } else {
        if constexpr (kSparse)
          load_kv_fp8_8b_sparse<KvFmt>(p, fp8_stage, req, kvh, tok_begin, tok_end, tid, max_id);
        else
          load_kv_fp8_8b<KvFmt, Cfg::kThreads, false>(p, fp8_stage, nullptr, req, kvh, tok_begin, tok_end, tid, max_id);
        store_kv_fp8_8b<T, KvFmt, Cfg::kThreads>(sK, fp8_stage, tid);
      }
    }
    cp_async_commit();
    cp_async_wait_all();
    fence_proxy_async_smem();
    __syncthreads();

    float acc_o[128];
#pragma unroll
    for (int n = 0; n < 128; ++n) acc_o[n] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.f, 0.f};

    // -- S = Q K^T of the tile in stage `st`, this warpgroup's 32 tokens (issued, not waited)
    float acc_s[16];
    auto issue_s = [&](int st) {
      const T* sKs = sK + st * Cfg::kKElems;
      fence_regs<16>(acc_s);
      cute::warpgroup_arrive();
#pragma unroll
      for (int kk = 0; kk < Cfg::kHeadDimQK / 16; ++kk) {
        const int blk = kk / 4, kin = (kk % 4) * 16;
        const uint64_t da = gmma_desc_sw128(sQ + blk * 64 * 64 + kin, 16, 1024);
        const uint64_t db = gmma_desc_sw128(sKs + blk * 64 * 64 + half * 32 * 64 + kin, 16, 1024);
        gmma_call<typename Gmma<T>::QK>(da, db, acc_s, kk > 0, std::make_index_sequence<16>{});
      }
      cute::warpgroup_commit_batch();
    };

    for (int j = 0; j < num_tiles; ++j) {
      const int t0 = tok_begin + j * Cfg::kBlockN;
      const T* sKj = sK + (j & 1) * Cfg::kKElems;
      T* sKnext = sK + ((j + 1) & 1) * Cfg::kKElems;
      const bool has_next = j + 1 < num_tiles;

      issue_s(j & 1);
      // Sparse launches: which of this thread's 8 token columns are skipped slots (bit 2n + c: column n * 8 +
      // 2 (lane % 4) + c), read while the tensor cores run S, so the table reads are off the softmax's path.
      uint32_t skipped = 0;
      if constexpr (kSparse) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int t = t0 + half * 32 + n * 8 + (lane % 4) * 2 + c;
            if (t < tok_end && sparse_id(p, req, t) == -1) skipped |= 1u << (2 * n + c);
          }
        }
      }
      // Issue the loads of tile j+1 while the tensor cores run S (wgmma is asynchronous).
      if (has_next) {
        if constexpr (KvFmt == kKvSameAsQ) {
          if constexpr (kSparse)
            load_kv_async_sparse<T, L>(p, sKnext, req, kvh, t0 + Cfg::kBlockN, tok_end, max_id);
          else
            load_kv_async<T, L>(p, sKnext, req, kvh, t0 + Cfg::kBlockN, tok_end, max_id);
          cp_async_commit();
        } else {
          if constexpr (kSparse)
            load_kv_fp8_8b_sparse<KvFmt>(p, fp8_stage, req, kvh, t0 + Cfg::kBlockN, tok_end, tid, max_id);
          else
            load_kv_fp8_8b<KvFmt, Cfg::kThreads, false>(p, fp8_stage, nullptr, req, kvh, t0 + Cfg::kBlockN, tok_end,
                                                        tid, max_id);
        }
      }
      cute::warpgroup_wait<0>();
      fence_regs<16>(acc_s);

      // Scores stay raw (unscaled) here: the maximum of raw scores times score_scale (> 0) is the
      // scaled maximum, and the scale is folded into the exponent's FFMA below. Only tiles that
      // reach past unmasked_end (the item's last, or the causal rows' last tokens) are masked.
      // A sparse launch masks its skipped top-k slots (-1 entries) in every tile.
      if (kSparse || t0 + Cfg::kBlockN > unmasked_end) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int t = t0 + half * 32 + n * 8 + (lane % 4) * 2 + (e & 1);
            const bool visible = t < tok_end && t <= limit[e >> 1] && !((skipped >> (2 * n + (e & 1))) & 1u);
            if (!visible) acc_s[4 * n + e] = -INFINITY;
          }
        }
      }
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) tile_max[e >> 1] = fmaxf(tile_max[e >> 1], acc_s[4 * n + e]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffff, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffff, tile_max[h], 2));
        tile_max[h] *= score_scale;
        if (lane % 4 == 0) sMax[half * Cfg::kBlockM + row_local[h]] = tile_max[h];
      }
      named_barrier(1 + rg, 64);
      float scale_o[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float other = sMax[(1 - half) * Cfg::kBlockM + row_local[h]];
        const float m_new = fmaxf(row_max[h], fmaxf(tile_max[h], other));
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        scale_o[h] = exp2_ftz(row_max[h] - m_use);
        row_max[h] = m_new;
        row_sum[h] *= scale_o[h];
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            acc_s[4 * n + e] = exp2_ftz(fmaf(acc_s[4 * n + e], score_scale, -m_use));
            row_sum[h] += acc_s[4 * n + e];
          }
        }
      }
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int col = half * 32 + n * 8 + (lane % 4) * 2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          typename TT::T2 v = TT::from_float2(acc_s[4 * n + 2 * h], acc_s[4 * n + 2 * h + 1]);
          *reinterpret_cast<typename TT::T2*>(sP + L::offset(row_local[h], col)) = v;
        }
      }
      // Rescale O only when some row maximum of this warp moved (rare after the first tiles).
      if (__any_sync(0xffffffff, scale_o[0] != 1.f || scale_o[1] != 1.f)) {
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          acc_o[4 * n + 0] *= scale_o[0];
          acc_o[4 * n + 1] *= scale_o[0];
          acc_o[4 * n + 2] *= scale_o[1];
          acc_o[4 * n + 3] *= scale_o[1];
        }
      }
      fence_proxy_async_smem();
      __syncthreads();  // both halves of P are in place (and both warpgroups' S reads of the tile are done)
      if (!kSparse && p.causal && t0 + Cfg::kBlockN > unmasked_end) {  // keys some row of the tile does not see
        clean_hidden_rows<T>(sK + (j & 1) * Cfg::kKElems, max(unmasked_end - t0, 0), min(tok_end - t0, Cfg::kBlockN),
                             tid, Cfg::kThreads);
        fence_proxy_async_smem();
        __syncthreads();
      }

      // -- O += P V, this warpgroup's 256 output channels
      fence_regs<128>(acc_o);
      cute::warpgroup_arrive();
#pragma unroll
      for (int kt = 0; kt < Cfg::kBlockN / 16; ++kt) {
        const uint64_t da = gmma_desc_sw128(sP + kt * 16, 16, 1024);
        const uint64_t db = gmma_desc_sw128(sKj + (4 * half) * 64 * 64 + kt * 16 * 64, 64 * 64 * 2, 1024);
        gmma_call<typename Gmma<T>::PV>(da, db, acc_o, true, std::make_index_sequence<128>{});
      }
      cute::warpgroup_commit_batch();
      // Land tile j+1 (fp8: dequantise into the other stage) while the tensor cores run P V.
      if (has_next) {
        if constexpr (KvFmt == kKvSameAsQ) {
          cp_async_wait_all();
        } else {
          store_kv_fp8_8b<T, KvFmt, Cfg::kThreads>(sKnext, fp8_stage, tid);
        }
        fence_proxy_async_smem();
      }
      cute::warpgroup_wait<0>();
      fence_regs<128>(acc_o);
      __syncthreads();
    }

    // -- epilogue
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_sum[h] += __shfl_xor_sync(0xffffffff, row_sum[h], 1);
      row_sum[h] += __shfl_xor_sync(0xffffffff, row_sum[h], 2);
      if (lane % 4 == 0) sSum[half * Cfg::kBlockM + row_local[h]] = row_sum[h];
    }
    // both warpgroups' row sums in place, and whether any thread met a bad block id in the item
    const bool poisoned = __syncthreads_or(!page_ok(p, max_id));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float total = poison_sum(row_sum[h] + sSum[(1 - half) * Cfg::kBlockM + row_local[h]], poisoned);
      const bool has_keys = total != 0.f;
      if (!row_ok[h]) continue;
      // a whole request's row with a sink s: times exp(lse) / (exp(lse) + exp(s)), 1 / (total + 2^(s log2 e - max))
      // in all (row_max is in log2 units; s = +inf: 0); a split request's rows take it in the combine
      const float sink = kSparse && slot < 0 && p.attn_sink != nullptr ? exp2f(p.attn_sink[row_head[h]] * kLog2e -
                                                                               row_max[h]) : 0.f;
      const float inv = has_keys ? out_scale / (total + sink) : 0.f;
      const float lse_val = has_keys ? (row_max[h] + log2f(total)) * kLn2 : (slot < 0 ? INFINITY : -INFINITY);
      store_acc_row<T>(p, acc_o, h, half * 256, inv, lse_val, req, slot, row_i[h], row_head[h],
                       half == 0 && lane % 4 == 0);
    }
    __syncthreads();
  }
  static_assert(kFusedScratchBytes<Cfg::kThreads> <= Cfg::kQElems * (int)sizeof(T), "the combine's list fits sQ");
  if (p.fuse_combine) combine_in_grid<T, Cfg::kThreads>(p, reinterpret_cast<int*>(smem_base));
}

}  // namespace mla_sm90
