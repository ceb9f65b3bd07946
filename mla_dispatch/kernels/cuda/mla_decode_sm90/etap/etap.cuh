// SM90 MLA decode, mainloop etap (Mainloop::kEtap; v6 in the history): KV tokens on the 64-row side of wgmma, query
// rows on the narrow side, for shapes with at most 32 query rows per KV head (s_q * h_q / h_kv <= 32:
// the memory-bound decode of 16-32 heads). The orientation is FlashMLA-ETAP's (Dege et al.,
// "FlashMLA-ETAP: Efficient Transpose Attention Pipeline for Accelerating MLA Inference on
// NVIDIA H20 GPUs", 2025): with 16 query rows, v2's m64 tiles are three quarters padding, so
// a 64-token tile costs as much tensor time as at 64 heads and the kernel runs at the
// compute-tile rate (~3.3 us per tile) instead of the memory rate (~2.3 us on the H200).
// Here, per 64-token tile and with N = 16 or 32 query rows:
//   S^T = K Q^T      m64nNk16 x 36   (A = the K tile, B = Q, both K-major, 128-byte swizzle)
//   softmax over the 64 tokens of each column (a cross-warp column max through shared memory)
//   O^T += V^T P^T   m64nNk16 x 4 per 64 output channels, 8 blocks (A = the same tile read
//                    MN-major as V^T, B = P^T written to shared memory, K-major)
// so the tensor work per tile shrinks with N (36 + 32 small wgmmas, ~1 us at N = 32).
//
// Warpgroups work independently: warpgroup g owns tiles g, g + 2, ... of an item and KV
// stage g, keeps its own running max, row sums and O^T (all 512 channels, 8 x N/2
// accumulators per thread), loads its next tile itself while the other warpgroup computes
// (TMA where page_size % 64 == 0, else cp.async), and the two partial results are merged
// through shared memory at the end of the item. No cross-warpgroup barrier in the mainloop.
//
// Masking as v2: tokens past the item's end are zero-filled by the loader (NaN in unused
// cache slots never reaches P V) and get S = -inf; causal columns mask tokens past
// L - s_q + i.
//
// Sparse launches (kSparse; params.h, DecodeParams::sparse): the flattened view of a top-k decode over an fp8 cache
// (fp8_ds_mla, fp8_e4m3, and DeepSeek-V4's fp8_ds_v4 with D_qk 512), the tokens-on-M orientation for <= 16 heads per
// KV head, where wgmma's 64-row tiles are three quarters padding (issue 57: b=128 h_q=16 s_q=2 took 304 us against
// ~81 us of bytes). The table's entries are token ids, prefetched into shared memory as the dense pages are; a -1 id
// (a skipped top-k slot) is zero-filled like a row past the end, and the warpgroup keeps each tile's "id is not -1"
// flags in shared memory (sOk) to mask those tokens' scores in every tile. The sink of a whole request's rows
// (attn_sink, DeepSeek-V4) is applied in the epilogue, as in wgmma's.
//
// Bad block ids as v2: each thread that turns a page into an address checks it (loads.cuh, checked_page; with TMA
// the issuing thread) and keeps the largest id it read for the item; the merge's barrier ORs "that id is bad" over
// the CTA, and an item that met a bad id ends with NaN column sums, so NaN out and lse in every row
// (docs/design.md §1).
#pragma once
#include <cmath>
#include <cstdint>
#include <cuda.h>

#include "common/combine.cuh"
#include "common/epilogue.cuh"
#include "common/loads.cuh"
#include "common/ptx.cuh"
#include "common/traits.cuh"
#include "common/gmma.cuh"

namespace mla_sm90 {

struct Etap {
  static constexpr int kMaxRows = kEtapMaxRows;        // query rows per KV head (config.h; kEtapFp8MaxRows for fp8)
  static constexpr int kRedFloats = 2 * 4 * kMaxRows;  // [warpgroup][warp][column]: column maxima of a tile
  static constexpr int kBarWg = 1;                     // named barriers 1, 2: one per warpgroup
  static constexpr int kOStride = Cfg::kHeadDimV + 4;  // fp32 row stride of the merge buffer (spreads banks)
  static constexpr int kBlocks = Cfg::kHeadDimQK / 64;  // column blocks of a tile: one mbarrier each (TMA)
  static constexpr int kSmemBytes = 2 * (Cfg::kQElems + Cfg::kStages * Cfg::kKElems + Cfg::kPElems) +
                                    kRedFloats * (int)sizeof(float) + 2 * Cfg::kBlockN * (int)sizeof(int) +
                                    2 * kBlocks * 8 + 2 * Cfg::kBlockN + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the SM90 per-block limit");
  static_assert(kMaxRows * kOStride * (int)sizeof(float) <= Cfg::kStages * Cfg::kKElems * 2,
                "the merge buffer lives in the KV stages");
  static_assert(10 * kMaxRows * (int)sizeof(float) <= Cfg::kPElems * 2, "the end-of-item sums and maxima live in sP");
};

// The block-table entries of tokens [t0, t0 + 64) of `req` into spage (0 for tokens past t_end,
// whose entries are never read), by cp.async from the first 64 threads of a warpgroup: issued a
// tile ahead, so the table's latency does not sit in front of the next tile's loads.
__device__ __forceinline__ void prefetch_pages(const DecodeParams& p, int* spage, int req, int t0, int t_end,
                                               int tid) {
  if (tid < Cfg::kBlockN) {
    const int t = t0 + tid;
    cp_async_4(spage + tid, p.block_table + (int64_t)req * p.bt_stride + (t < t_end ? t / p.page_size : 0), t < t_end);
  }
}

// load_kv_async for one warpgroup (tid < 128: 16 token rows per pass), the pages from spage
// (prefetch_pages) instead of the block table; max_id as in checked_page (a bad block id: block 0 read instead).
template <typename T, class Layout>
__device__ __forceinline__ void load_kv_async_paged(const DecodeParams& p, T* sK, const int* spage, int kvh, int t0,
                                                    int t_end, int tid, uint32_t& max_id) {
#pragma unroll
  for (int pass = 0; pass < Cfg::kBlockN / 16; ++pass) {
    const int row = tid / 8 + 16 * pass;
    const int t = t0 + row;
    const bool valid = t < t_end;
    const int64_t elem = kv_token_elem(p, checked_page(p, spage[row], max_id), t, kvh);
    const T* src = reinterpret_cast<const T*>(p.kv) + (valid ? elem : 0);
#pragma unroll
    for (int k = 0; k < Cfg::kChunksQK / 8; ++k) {
      const int chunk = tid % 8 + 8 * k;
      cp_async_16(sK + Layout::offset(row, chunk * 8), src + (valid ? chunk * 8 : 0), valid);
    }
  }
}

// kTma (page_size % 64 == 0): a tile is one 64-token box per column block of one page, loaded by
// TMA (the tensor map of v5) by one thread, each block on its own mbarrier, so S^T of a tile
// starts on its first block while the rest are still arriving. Otherwise cp.async by the
// warpgroup (any page size), with the tile's pages prefetched a tile ahead.
// fp8 caches (KvFmt != kKvSameAsQ, cp.async path only): a warpgroup loads its next tile into
// registers at the start of the current one (so the loads fly during its GEMMs) and dequantises it
// into its stage after P V, as v2 does for the whole CTA (store_kv_fp8_8b: fp8_e4m3 unscaled, the
// per-tensor scale folded into the softmax scale and the output; fp8_ds_mla times its tile scales).
// The block-table entries of a tile are prefetched into shared memory two tiles ahead of its load.
template <typename T, int kN, bool kTma, int KvFmt = kKvSameAsQ, bool kSparse = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    mla_decode_etap(const __grid_constant__ DecodeParams p, const __grid_constant__ CUtensorMap kv_map) {
  static_assert(kN == 16 || kN == 32, "16 or 32 query rows");
  static_assert(KvFmt == kKvSameAsQ || !kTma, "fp8 caches are loaded through registers");
  constexpr bool kFp8 = KvFmt != kKvSameAsQ;
  static_assert(kFp8 || !kSparse, "the sparse instances read fp8 caches");
  static_assert(KvFmt != kKvFp8DsV4 || kSparse, "fp8_ds_v4 caches are decoded sparse");
  using TT = TypeTraits<T>;
  using L = Gmma128Tile64;
  using G = GmmaEtap<T, kN>;
  constexpr int kAcc = kN / 2;   // fp32 accumulators per thread of one m64 x kN tile
  constexpr int kCols = kN / 4;  // columns (query rows) per thread: c = 8 (k / 2) + 2 (lane % 4) + k % 2
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem_base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  T* sQ = reinterpret_cast<T*>(smem_base);
  T* sK = sQ + Cfg::kQElems;
  T* sP = sK + Cfg::kStages * Cfg::kKElems;
  float* sRed = reinterpret_cast<float*>(sP + Cfg::kPElems);
  int* sPage = reinterpret_cast<int*>(sRed + Etap::kRedFloats);  // [warpgroup][64]: pages of its next tile
  uint64_t* sBar = reinterpret_cast<uint64_t*>(sPage + 2 * Cfg::kBlockN);  // [warpgroup][column block] (kTma)
  uint8_t* sOk = reinterpret_cast<uint8_t*>(sBar + 2 * Etap::kBlocks);       // [warpgroup][64] (kSparse)

  // row tiles (blockIdx.y) of kN rows each: one for a dense launch (its rows fit), ceil(rows / kN) for a sparse one
  const int part = blockIdx.x, row_tile = blockIdx.y, kvh = blockIdx.z;
  const int row0 = row_tile * kN;  // the tile's first query row of the KV head
  const int tid = threadIdx.x, lane = tid % 32, tid_wg = tid % 128, warp = (tid / 32) % 4;
  // warpgroup index through a shuffle from lane 0, so the compiler knows it is warp-uniform and keeps the
  // stage-dependent wgmma descriptors in uniform registers (CUTLASS's canonical_warp_group_idx does the same)
  const int wg = __shfl_sync(0xffffffff, tid / 128, 0);
  T* const stage = sK + wg * Cfg::kKElems;  // this warpgroup's KV stage
  T* const sPw = sP + wg * 32 * 64;         // its P^T [kN x 64 tokens] (rows 32 wg.., 1024-byte aligned)
  float* const red = sRed + wg * 4 * Etap::kMaxRows;
  int* const spage = sPage + wg * Cfg::kBlockN;
  uint8_t* const ok = sOk + wg * Cfg::kBlockN;  // kSparse: whether each token of this warpgroup's tile has an id
  uint64_t* const bars = sBar + wg * Etap::kBlocks;
  uint32_t loads_done = 0;  // TMA loads into this warpgroup's stage consumed so far (mbarrier phase)
  uint32_t max_id = 0;      // the largest block id this thread read for the current item, as unsigned (loads.cuh)
  if constexpr (kTma) {
    if (tid == 0) {
      for (int i = 0; i < 2 * Etap::kBlocks; ++i) mbar_init(sBar + i, 1);
      fence_mbar_init();
    }
    __syncthreads();
  }
  // one thread: the 9 boxes of the tile at t0 (in `page`; block 0 for a bad id) into this warpgroup's stage
  auto tma_tile_v6 = [&](int page, int t0) {
    page = checked_page(p, page, max_id);
#pragma unroll
    for (int b = 0; b < Etap::kBlocks; ++b) {
      mbar_arrive_expect_tx(bars + b, 64 * 64 * (int)sizeof(T));
      tma_load_4d(stage + b * 64 * 64, &kv_map, bars + b, 64 * b, kvh, t0 % p.page_size, page);
    }
  };
  const int32_t* table = p.block_table;
  const int bar = Etap::kBarWg + wg;
  const int heads_per_kv = p.heads_q / p.heads_kv;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  float out_scale = 1.0f;
  if constexpr (KvFmt == kKvFp8E4M3) out_scale = *p.kv_scale;
  const float score_scale = p.softmax_scale * out_scale * kLog2e;
  auto col_of = [&](int k) { return 8 * (k / 2) + 2 * (lane % 4) + (k % 2); };
  // accumulator i of an m64 x kN tile: row 16 warp + lane / 4 + 8 ((i % 4) / 2), column index k
  auto acc_row = [&](int i) { return 16 * warp + lane / 4 + 8 * ((i % 4) / 2); };
  auto acc_col = [](int i) { return 2 * (i / 4) + (i % 2); };
  auto desc = [](const void* base) { return gmma_desc_sw128_addr(smem_u32(base), 16, 1024); };
  // kFp8: this warpgroup's tile from t0 into registers (the sparse ids from spage where `paged`, prefetch_pages)
  auto load_fp8 = [&](Fp8Stage8B<4>& st, int req, int t0, int t_end, bool paged) {
    if constexpr (kSparse)
      load_kv_fp8_8b_sparse<KvFmt, 128>(p, st, req, kvh, t0, t_end, tid_wg, max_id, paged ? spage : nullptr);
    else if (paged)
      load_kv_fp8_8b<KvFmt, 128, true>(p, st, spage, req, kvh, t0, t_end, tid_wg, max_id);
    else
      load_kv_fp8_8b<KvFmt, 128, false>(p, st, nullptr, req, kvh, t0, t_end, tid_wg, max_id);
  };
  // kFp8: the registers into this warpgroup's stage (kSparse: and the tokens' "has an id" flags into ok)
  auto store_fp8 = [&](const Fp8Stage8B<4>& st) {
    store_kv_fp8_8b<T, KvFmt, 128>(stage, st, tid_wg);
    if constexpr (kSparse) {
      if (tid_wg % 8 == 0) {
#pragma unroll
        for (int pass = 0; pass < 4; ++pass) ok[tid_wg / 8 + 16 * pass] = st.valid[pass];
      }
    }
  };

  const int item_begin = p.part_offsets[part], item_end = p.part_offsets[part + 1];
  for (int item = item_begin; item < item_end; ++item) {
    const WorkItem w = load_item(p, item);
    const int req = w.req, tok_begin = w.tok_begin, slot = w.slot;
    if (req < 0) continue;
    const int seqlen = p.cache_seqlens[req];
    // a sparse launch's length is its list's (topk_length: entries past it are never read, tiles past it skipped)
    const int tok_end = kSparse ? min(w.tok_end, max(seqlen, tok_begin)) : w.tok_end;
    int limit[kCols];
#pragma unroll
    for (int k = 0; k < kCols; ++k)
      limit[k] = p.causal ? seqlen - p.q_len + (row0 + col_of(k)) / heads_per_kv : seqlen - 1;
    // tokens below this are visible to every query column (tiles entirely below it skip the mask)
    const int unmasked_end = min(tok_end, p.causal ? seqlen - p.q_len + 1 : seqlen);
    const int num_tiles = (tok_end - tok_begin + Cfg::kBlockN - 1) / Cfg::kBlockN;

    const int32_t* table_row = table + (int64_t)req * p.bt_stride;
    Fp8Stage8B<4> fp8_next;  // kFp8: the next tile of this warpgroup, in registers
    max_id = 0;
    if constexpr (kFp8) {
      if (wg < num_tiles) {
        load_fp8(fp8_next, req, tok_begin + wg * Cfg::kBlockN, tok_end, false);
        store_fp8(fp8_next);
      }
      // pages of this warpgroup's second tile (landed by the wait below)
      if (wg + 2 < num_tiles) prefetch_pages(p, spage, req, tok_begin + (wg + 2) * Cfg::kBlockN, tok_end, tid_wg);
    } else if constexpr (kTma) {
      if (wg < num_tiles && tid_wg == 0) {
        const int t0 = tok_begin + wg * Cfg::kBlockN;
        tma_tile_v6(table_row[t0 / p.page_size], t0);
      }
    } else if (wg < num_tiles) {
      load_kv_async<T, L, 128>(p, stage, req, kvh, tok_begin + wg * Cfg::kBlockN, tok_end, max_id, tid_wg);
    }
    load_q_tile_async<T, L, KvFmt == kKvFp8DsV4 ? kDsV4HeadDim / 8 : Cfg::kChunksQK>(p, sQ, req, row_tile, kvh, kN);
    cp_async_commit();
    cp_async_wait_all();
    fence_proxy_async_smem();
    __syncthreads();

    float acc_o[8][kAcc];
    etap_zero_acc_o(acc_o);
    float m_run[kCols], l_run[kCols];
#pragma unroll
    for (int k = 0; k < kCols; ++k) m_run[k] = -INFINITY, l_run[k] = 0.f;

    for (int j = wg; j < num_tiles; j += 2) {
      const int t0 = tok_begin + j * Cfg::kBlockN;
      const bool has_next = j + 2 < num_tiles;
      int next_page = 0;  // kTma: the next tile's page, loaded now and used after P V
      if constexpr (kFp8) {
        // the next tile into registers now, so the loads fly during this tile's GEMMs (issued after
        // the S^T wgmmas instead, as v2 does, measured 6% slower: 241 vs 228 us at b=64 h16 L=8K)
        if (has_next) load_fp8(fp8_next, req, t0 + 2 * Cfg::kBlockN, tok_end, true);
      } else if constexpr (kTma) {
        if (has_next && tid_wg == 0) next_page = table_row[(t0 + 2 * Cfg::kBlockN) / p.page_size];
      } else if (has_next) {  // pages of the next tile (read by other threads after the barrier before its load)
        prefetch_pages(p, spage, req, t0 + 2 * Cfg::kBlockN, tok_end, tid_wg);
        cp_async_commit();
      }
      const uint32_t parity = loads_done & 1u;
      // ---- S^T = K Q^T (etap_gemm_s)
      float acc_s[kAcc];
      etap_gemm_s<G, 64 * 64>(desc(stage), desc(sQ), acc_s, [&](int blk) {
        if constexpr (kTma) {
          mbar_wait(bars + blk, parity);
          cute::warpgroup_arrive();
        }
      });

      // ---- mask; column max over the tile's 64 tokens (16 per warp, 4 warps via red)
      float cmax[kCols];
#pragma unroll
      for (int k = 0; k < kCols; ++k) cmax[k] = -INFINITY;
      // raw scores: the maximum times score_scale (> 0) is the scaled maximum, and the scale goes into
      // the exponent's FFMA below; only tiles reaching past unmasked_end are masked (as in v2 / v5), and every tile of
      // a sparse launch (its -1 slots: ok, written with the tile's stage)
      if (kSparse || t0 + Cfg::kBlockN > unmasked_end) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
          const int t = t0 + acc_row(i);
          const bool seen = kSparse ? t < tok_end && ok[acc_row(i)] : t < tok_end && t <= limit[acc_col(i)];
          if (!seen) acc_s[i] = -INFINITY;
        }
      }
#pragma unroll
      for (int i = 0; i < kAcc; ++i) cmax[acc_col(i)] = fmaxf(cmax[acc_col(i)], acc_s[i]);
#pragma unroll
      for (int k = 0; k < kCols; ++k) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) cmax[k] = fmaxf(cmax[k], __shfl_xor_sync(0xffffffff, cmax[k], o));
        cmax[k] *= score_scale;
        if (lane < 4) red[warp * Etap::kMaxRows + col_of(k)] = cmax[k];
      }
      named_barrier(bar, 128);
      if constexpr (kFp8) {  // every thread has read spage for this tile's loads: the pages two tiles on
        if (j + 4 < num_tiles) {
          prefetch_pages(p, spage, req, t0 + 4 * Cfg::kBlockN, tok_end, tid_wg);
          cp_async_commit();
        }
      }
      float m_use[kCols], scale[kCols], psum[kCols];
#pragma unroll
      for (int k = 0; k < kCols; ++k) {
        const int c = col_of(k);
        const float tile_max = fmaxf(fmaxf(red[c], red[Etap::kMaxRows + c]),
                                     fmaxf(red[2 * Etap::kMaxRows + c], red[3 * Etap::kMaxRows + c]));
        const float m_new = fmaxf(m_run[k], tile_max);
        m_use[k] = m_new == -INFINITY ? 0.f : m_new;
        scale[k] = exp2_ftz(m_run[k] - m_use[k]);
        m_run[k] = m_new;
        psum[k] = 0.f;
      }
      // ---- P (fp32 in acc_s), row sums, rescale O^T, P^T to shared memory
#pragma unroll
      for (int i = 0; i < kAcc; ++i) {
        const int k = acc_col(i);
        acc_s[i] = exp2_ftz(fmaf(acc_s[i], score_scale, -m_use[k]));
        psum[k] += acc_s[i];
      }
#pragma unroll
      for (int k = 0; k < kCols; ++k) l_run[k] = l_run[k] * scale[k] + psum[k];
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc_o[mb][i] *= scale[acc_col(i)];
#pragma unroll
      for (int i = 0; i < kAcc; ++i) {
        sPw[L::offset(col_of(acc_col(i)), acc_row(i))] = TT::from_float2(acc_s[i], 0.f).x;
      }
      if constexpr (kTma) {  // TMA loaded whole boxes: V rows past the item's end may hold anything (NaN)
        const int valid = min(Cfg::kBlockN, tok_end - t0);
        if (valid < Cfg::kBlockN) {
          zero_v_rows(stage, valid, 0, tid_wg);
          zero_v_rows(stage, valid, 1, tid_wg);
        }
      }
      if (p.causal && t0 + Cfg::kBlockN > unmasked_end)  // keys some column (query row) does not see: out of P V
        clean_hidden_rows<T>(stage, max(unmasked_end - t0, 0), min(tok_end - t0, Cfg::kBlockN), tid_wg, 128);
      fence_proxy_async_smem();
      named_barrier(bar, 128);  // P^T complete (and V rows zeroed); every warp has read red

      // ---- O^T += V^T P^T (etap_gemm_pv)
      etap_gemm_pv<G>(stage, desc(sPw), acc_o);

      // ---- this warpgroup's next tile into its stage (the other warpgroup computes meanwhile)
      ++loads_done;
      if constexpr (kFp8) {
        if (has_next) {
          cp_async_wait_all();      // this thread's page entries of the tile after next
          named_barrier(bar, 128);  // every warp's wgmmas have read the stage; spage complete
          store_fp8(fp8_next);  // (ok: every warp read it before the barrier after the column maxima)
          fence_proxy_async_smem();
          named_barrier(bar, 128);
        }
      } else if constexpr (kTma) {
        if (has_next) {
          named_barrier(bar, 128);  // every warp's wgmmas have read the stage
          if (tid_wg == 0) tma_tile_v6(next_page, t0 + 2 * Cfg::kBlockN);
        }
      } else if (has_next) {
        cp_async_wait_all();      // this thread's page entries
        named_barrier(bar, 128);  // every warp's wgmmas have read the stage and sPw; spage complete
        load_kv_async_paged<T, L>(p, stage, spage, kvh, t0 + 2 * Cfg::kBlockN, tok_end, tid_wg, max_id);
        cp_async_commit();
        cp_async_wait_all();
        fence_proxy_async_smem();
        named_barrier(bar, 128);
      }
    }

    // ---- merge the two warpgroups: column sums and maxima, then O through shared memory
    __syncthreads();  // both mainloops done: the stages are free
    // in the P^T tiles (free now): nothing the mainloop's scratch shares
    float* sL = reinterpret_cast<float*>(sP);  // [warpgroup][warp][column] column sums
    float* sM = sL + 8 * kN;                   // [warpgroup][column] column maxima
    float* sO = reinterpret_cast<float*>(sK);  // [kN][kOStride]
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      float l = l_run[k];
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) l += __shfl_xor_sync(0xffffffff, l, o);
      if (lane < 4) {
        sL[(wg * 4 + warp) * kN + col_of(k)] = l;
        if (warp == 0) sM[wg * kN + col_of(k)] = m_run[k];
      }
    }
    const bool poisoned = __syncthreads_or(!page_ok(p, max_id));  // sL and sM in place; whether any id was bad
    float fac[kCols];  // this warpgroup's weight per column: 2^(m_wg - m_final)
#pragma unroll
    for (int k = 0; k < kCols; ++k) {
      const int c = col_of(k);
      const float m0 = sM[c], m1 = sM[kN + c];
      const float mf = fmaxf(m0, m1);
      const float mu = mf == -INFINITY ? 0.f : mf;
      fac[k] = exp2f((wg == 0 ? m0 : m1) - mu);
    }
    auto o_at = [&](int mb, int i) -> float& { return sO[col_of(acc_col(i)) * Etap::kOStride + mb * 64 + acc_row(i)]; };
    if (wg == 1) {
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int i = 0; i < kAcc; ++i) o_at(mb, i) = acc_o[mb][i] * fac[acc_col(i)];
    }
    __syncthreads();
    if (wg == 0) {
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int i = 0; i < kAcc; ++i) o_at(mb, i) += acc_o[mb][i] * fac[acc_col(i)];
    }
    __syncthreads();
    // ---- rows out: 4 channels per thread and step, coalesced
    for (int idx = tid; idx < kN * (Cfg::kHeadDimV / 4); idx += Cfg::kThreads) {
      const int c = idx / (Cfg::kHeadDimV / 4), ch = 4 * (idx % (Cfg::kHeadDimV / 4));
      if (row0 + c >= p.rows_per_kv_head) break;  // idx grows with c
      const float m0 = sM[c], m1 = sM[kN + c];
      const float mf = fmaxf(m0, m1);
      const float mu = mf == -INFINITY ? 0.f : mf;
      const float f0 = exp2f(m0 - mu), f1 = exp2f(m1 - mu);
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) total += f0 * sL[w * kN + c] + f1 * sL[(4 + w) * kN + c];
      total = poison_sum(total, poisoned);
      const bool has_keys = total != 0.f;
      const int qi = (row0 + c) / heads_per_kv, head = kvh * heads_per_kv + (row0 + c) % heads_per_kv;
      // a whole request's row with a sink s: 1 / (total + 2^(s log2 e - max)) (wgmma's epilogue; s = +inf: 0); a split
      // request's rows take it in the combine
      const float sink = kSparse && slot < 0 && p.attn_sink != nullptr ? exp2f(p.attn_sink[head] * kLog2e - mu) : 0.f;
      const float inv = has_keys ? out_scale / (total + sink) : 0.f;
      const float lse_val = has_keys ? (mu + log2f(total)) * kLn2 : (slot < 0 ? INFINITY : -INFINITY);
      // a warp holds one quarter row (its 32 lanes: c and slot shared), as store_row_quad asks
      store_row_quad<T>(p, sO + c * Etap::kOStride, ch, ch, inv, req, qi, head, slot);
      if (ch == 0) store_item_lse(p, req, slot, qi, head, lse_val);
    }
    // sQ, the stages and sP are reused by the next item, the stages by TMA (async proxy) after
    // the generic-proxy sO writes above
    fence_proxy_async_smem();
    __syncthreads();
  }
  static_assert(kFusedScratchBytes<Cfg::kThreads> <= Cfg::kQElems * (int)sizeof(T), "the combine's list fits sQ");
  if (p.fuse_combine) combine_in_grid<T, Cfg::kThreads>(p, reinterpret_cast<int*>(smem_base));
}

}  // namespace mla_sm90
