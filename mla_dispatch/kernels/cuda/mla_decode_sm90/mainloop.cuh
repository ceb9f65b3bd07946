// Device code every SM90 MLA decode mainloop shares: the KV tile loaders (cp.async for
// bf16/fp16 caches; fp8 caches loaded into registers and dequantised while being stored),
// the split-KV work items, the query tile load and the epilogue of row-major accumulators.
#pragma once
#include <cmath>
#include <cstdint>

#include "combine.cuh"
#include "config.cuh"
#include "params.h"
#include "ptx.cuh"

namespace mla_sm90 {

using Cfg = DecodeConfig;

// ---- KV tile loaders --------------------------------------------------------------------
// Thread mapping for all loaders: 8 threads per token (consecutive 16-byte chunks, so a
// warp reads 4 tokens x 128 contiguous bytes per instruction), 32 tokens per pass, 2 passes
// (load_kv_async with a warpgroup: 16 tokens per pass, 4 passes).

// Element offset of token t (in cache block `page`) of KV head kvh.
__device__ __forceinline__ int64_t kv_token_elem(const DecodeParams& p, int page, int t, int kvh) {
  return (int64_t)page * p.kv_stride_block + (int64_t)(t % p.page_size) * p.kv_stride_tok +
         (int64_t)kvh * p.kv_stride_head;
}

template <typename T>
__device__ __forceinline__ const uint8_t* token_ptr(const DecodeParams& p, int req, int t, int kvh) {
  const int page = p.block_table[(int64_t)req * p.bt_stride + t / p.page_size];
  return reinterpret_cast<const uint8_t*>(p.kv) + kv_token_elem(p, page, t, kvh) * (int64_t)sizeof(T);
}

// bf16/fp16 cache: cp.async straight into the swizzled tile, by kLoaders threads (tid < kLoaders:
// the whole CTA, or one warpgroup of v6).
template <typename T, class Layout, int kLoaders = Cfg::kThreads>
__device__ __forceinline__ void load_kv_async(const DecodeParams& p, T* sK, int req, int kvh, int t0, int t_end,
                                              int tid = threadIdx.x) {
  static_assert(Cfg::kBlockN % (kLoaders / 8) == 0, "8 threads per token row");
#pragma unroll
  for (int pass = 0; pass < Cfg::kBlockN / (kLoaders / 8); ++pass) {
    const int row = tid / 8 + (kLoaders / 8) * pass;
    const int t = t0 + row;
    const bool valid = t < t_end;
    const T* src = valid ? reinterpret_cast<const T*>(token_ptr<T>(p, req, t, kvh)) : reinterpret_cast<const T*>(p.kv);
#pragma unroll
    for (int k = 0; k < Cfg::kChunksQK / 8; ++k) {
      const int chunk = tid % 8 + 8 * k;
      cp_async_16(sK + Layout::offset(row, chunk * 8), src + (valid ? chunk * 8 : 0), valid);
    }
  }
}

// Two e4m3 values (the low 16 bits of `pair`) -> two values of T times `scale`, packed. The
// conversion to fp16 is exact (every finite e4m3 value is a normal fp16 or zero), so an unscaled fp16
// tile keeps it as is; bf16 goes through fp32 (sm_90 has no e4m3 -> bf16 conversion).
template <typename T, bool kScaled>
__device__ __forceinline__ uint32_t fp8x2_to(uint32_t pair, float scale) {
  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
  if constexpr (!TypeTraits<T>::kIsBf16 && !kScaled) {
    return static_cast<uint32_t>(hr.x) | (static_cast<uint32_t>(hr.y) << 16);
  } else {
    float2 f = __half22float2(__half2(hr));
    if constexpr (kScaled) f.x *= scale, f.y *= scale;
    typename TypeTraits<T>::T2 v = TypeTraits<T>::from_float2(f.x, f.y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// 8 bf16 rope values (fp8_ds_mla stores them as bf16) as T.
template <typename T>
__device__ __forceinline__ uint4 rope_as(uint4 rope) {
  if constexpr (!TypeTraits<T>::kIsBf16) {
    uint32_t w[4] = {rope.x, rope.y, rope.z, rope.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w[i]));
      __half2 h = __floats2half2_rn(f.x, f.y);
      w[i] = *reinterpret_cast<uint32_t*>(&h);
    }
    rope = make_uint4(w[0], w[1], w[2], w[3]);
  }
  return rope;
}

// fp8 tiles for the wgmma kernels (v2: the CTA, v6: one warpgroup; Gmma128Tile64), 8 bytes per load:
// the 8 threads of token row tid / 8 + kLoaders / 8 * pass load 8 bytes each per step, so step k
// covers columns 64k .. 64k + 63 (one column block, whose 8-value chunk c is thread c's) and a row's 8
// stores fill one 128-byte row of the block, free of bank conflicts, at one base pointer plus
// compile-time offsets. store_kv_fp8's 16 fp8 values per thread put a thread's two chunks in two
// column blocks at the same swizzle positions, so a row's stores conflict two-way (25% of v6's
// shared-memory wavefronts under ncu). H100 (NOTES.md, "fp8 loads"): v6 b=64 h_q=16 fp8_e4m3 204 ->
// 185 us against 16-byte loads with the offsets folded, v2 b=128 h_q=128 L=8K 1016 -> 876 us; 16-byte
// loads with the lanes reordered so that the stores do not conflict measured 10% (v6) / 4% (v2) slower.
template <int kPasses>
struct Fp8Stage8B {
  uint2 v[kPasses][9];   // fp8 bytes 64k + 8c .. + 8 of the row (fp8_ds_mla: NoPE, k < 8)
  uint4 scale[kPasses];  // fp8_ds_mla: the row's four fp32 tile scales (one per 128 channels)
  uint4 rope[kPasses];   // fp8_ds_mla: rope values 8c .. 8c + 8 (bf16)
  bool valid[kPasses];
};

template <int KvFmt, int kLoaders, bool kPaged>
__device__ __forceinline__ void load_kv_fp8_8b(const DecodeParams& p, Fp8Stage8B<Cfg::kBlockN * 8 / kLoaders>& st,
                                               const int* spage, int req, int kvh, int t0, int t_end, int tid) {
  const int c = tid % 8;
#pragma unroll
  for (int pass = 0; pass < Cfg::kBlockN * 8 / kLoaders; ++pass) {
    const int row = tid / 8 + kLoaders / 8 * pass;
    const int t = t0 + row;
    const bool valid = t < t_end;
    st.valid[pass] = valid;
    // fp8_e4m3: no branch on the row (see load_fp8_row); a row past the end reads page 0, in bounds, and is
    // zero-filled at the store. fp8_ds_mla keeps the branch: same-call A/B on the H100 (v6 b=64 h16 L=8K), without
    // it 221 us, with it 210; with it fp8_e4m3 went 185 -> 196 us (NOTES.md, fifth session)
    if (KvFmt != kKvFp8E4M3 && !valid) continue;
    const int page = kPaged ? spage[row] : (valid ? p.block_table[(int64_t)req * p.bt_stride + t / p.page_size] : 0);
    const int64_t elem = kv_token_elem(p, page, t, kvh);
    const uint8_t* src = reinterpret_cast<const uint8_t*>(p.kv) + elem;
#pragma unroll
    for (int k = 0; k < (KvFmt == kKvFp8E4M3 ? 9 : 8); ++k) {
      st.v[pass][k] = __ldg(reinterpret_cast<const uint2*>(src) + c + 8 * k);
    }
    if constexpr (KvFmt != kKvFp8E4M3) {
      st.scale[pass] = __ldg(reinterpret_cast<const uint4*>(src + 512));
      st.rope[pass] = __ldg(reinterpret_cast<const uint4*>(src + 528) + c);
    }
  }
}

template <typename T, int KvFmt, int kLoaders>
__device__ __forceinline__ void store_kv_fp8_8b(T* stage, const Fp8Stage8B<Cfg::kBlockN * 8 / kLoaders>& st, int tid) {
  constexpr bool kScaled = KvFmt != kKvFp8E4M3;  // fp8_e4m3: the per-tensor scale is applied outside
  // chunk c of column block k of the thread's row in pass p: blk + 4096 k + kLoaders / 8 * 64 p
  T* const blk = stage + Gmma128Tile64::offset(tid / 8, 8 * (tid % 8));
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int pass = 0; pass < Cfg::kBlockN * 8 / kLoaders; ++pass) {
    T* const row = blk + kLoaders / 8 * 64 * pass;
    if (!st.valid[pass]) {  // zero-fill the whole token row
#pragma unroll
      for (int k = 0; k < 9; ++k) *reinterpret_cast<uint4*>(row + 4096 * k) = zero;
      continue;
    }
    const float scales[4] = {__uint_as_float(st.scale[pass].x), __uint_as_float(st.scale[pass].y),
                             __uint_as_float(st.scale[pass].z), __uint_as_float(st.scale[pass].w)};
#pragma unroll
    for (int k = 0; k < (kScaled ? 8 : 9); ++k) {
      const uint2 w = st.v[pass][k];
      const float s = kScaled ? scales[k / 2] : 1.f;  // column block k lies in scale group k / 2
      *reinterpret_cast<uint4*>(row + 4096 * k) =
          make_uint4(fp8x2_to<T, kScaled>(w.x, s), fp8x2_to<T, kScaled>(w.x >> 16, s), fp8x2_to<T, kScaled>(w.y, s),
                     fp8x2_to<T, kScaled>(w.y >> 16, s));
    }
    if constexpr (kScaled) {  // rope: 8 bf16 values -> chunk c of column block 8
      *reinterpret_cast<uint4*>(row + 4096 * 8) = rope_as<T>(st.rope[pass]);
    }
  }
}

// ---- pieces every mainloop version shares ---------------------------------------------------
// This thread's two accumulator rows (mma.sync and wgmma C layout: rows lane/4 and lane/4 + 8 of
// its warp's 16, warp group rg): row in the tile, query position, query head, row exists.
__device__ __forceinline__ void acc_rows(const DecodeParams& p, int row_tile, int kvh, int rg, int lane,
                                         int (&local)[2], int (&qi)[2], int (&head)[2], bool (&ok)[2]) {
  const int heads_per_kv = p.heads_q / p.heads_kv;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    local[h] = rg * 16 + lane / 4 + 8 * h;
    const int r = row_tile * Cfg::kBlockM + local[h];
    ok[h] = r < p.rows_per_kv_head;
    const int rc = ok[h] ? r : 0;
    qi[h] = rc / heads_per_kv;
    head[h] = kvh * heads_per_kv + rc % heads_per_kv;
  }
}

// One work item of the split-KV schedule (mla_dispatch/metadata.py): request (< 0: padding, skip),
// its token range [tok_begin, tok_end), and the partial slot it writes (< 0: the request fits one
// part, write out / lse directly).
struct WorkItem {
  int req, tok_begin, tok_end, slot;
};
__device__ __forceinline__ WorkItem load_item(const DecodeParams& p, int item) {
  const int4 it = reinterpret_cast<const int4*>(p.items)[item];
  return {it.x, it.y, it.z, it.w};
}

// The item's Q tile [64 x 576] into sQ by cp.async (committed by the caller); rows past
// rows_per_kv_head are zero-filled. 8 threads per row, 32 rows per pass, 2 passes.
template <typename T, class Layout>
__device__ __forceinline__ void load_q_tile_async(const DecodeParams& p, T* sQ, int req, int row_tile, int kvh) {
  const int tid = threadIdx.x;
  const int heads_per_kv = p.heads_q / p.heads_kv;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int row = tid / 8 + 32 * pass;
    const int r = row_tile * Cfg::kBlockM + row;
    const bool valid = r < p.rows_per_kv_head;
    const int rc = valid ? r : 0;
    const T* src = reinterpret_cast<const T*>(p.q) + (int64_t)req * p.q_stride_b +
                   (int64_t)(rc / heads_per_kv) * p.q_stride_s +
                   (int64_t)(kvh * heads_per_kv + rc % heads_per_kv) * p.q_stride_h;
#pragma unroll
    for (int k = 0; k < Cfg::kChunksQK / 8; ++k) {
      const int chunk = tid % 8 + 8 * k;
      cp_async_16(sQ + Layout::offset(row, chunk * 8), src + chunk * 8, valid);
    }
  }
}

// Accumulator row h of this thread (acc_o[4 n + 2 h + {0, 1}], n < 32: its 64 of the 256 output
// channels from col0), times inv, into out (unsplit item, slot < 0) or the item's partial row (params.h: fp16,
// scaled per quarter row; one shift for the quad's 256 channels); the row's LSE from the thread with writes_lse.
// The four lanes of the thread's quad hold the row and call it together (their shuffles name only the quad).
template <typename T>
__device__ __forceinline__ void store_acc_row(const DecodeParams& p, const float* acc_o, int h, int col0, float inv,
                                              float lse_val, int req, int slot, int qi, int head, bool writes_lse) {
  using TT = TypeTraits<T>;
  const int lane = threadIdx.x % 32;
  if (slot < 0) {
    T* dst = out_row<T>(p, req, qi, head) + col0 + (lane % 4) * 2;
#pragma unroll
    for (int n = 0; n < 32; ++n)
      *reinterpret_cast<typename TT::T2*>(dst + n * 8) =
          TT::from_float2(acc_o[4 * n + 2 * h] * inv, acc_o[4 * n + 2 * h + 1] * inv);
    if (writes_lse) lse_at(p, req, qi, head) = lse_val;
  } else {
    float m = 0.f;
#pragma unroll
    for (int n = 0; n < 32; ++n) m = fmaxf(m, fmaxf(fabsf(acc_o[4 * n + 2 * h]), fabsf(acc_o[4 * n + 2 * h + 1])));
    const unsigned quad = 0xfu << (lane & 28);
    m = fmaxf(m, __shfl_xor_sync(quad, m, 1));
    m = fmaxf(m, __shfl_xor_sync(quad, m, 2));
    const int shift = partial_shift(m * inv, inv);
    const float pscale = inv * pow2i(shift);
    const int64_t prow = partial_index(p, slot, qi, head);
    char* row = partial_row(p.partial_out, prow);
    __half* dst = reinterpret_cast<__half*>(row) + col0 + (lane % 4) * 4;
#pragma unroll
    for (int k = 0; k < 16; ++k) {  // pairs n = 2k (channels 16k + 2q ..) and 2k + 1 (16k + 8 + 2q ..)
      const float* a = acc_o + 8 * k + 2 * h;
      *reinterpret_cast<uint2*>(dst + 16 * k) =
          make_uint2(half2_bits(__floats2half2_rn(a[0] * pscale, a[1] * pscale)),
                     half2_bits(__floats2half2_rn(a[4] * pscale, a[5] * pscale)));
    }
    // both quarters of the 256 channels take the shift: lanes 0, 1 fill the first one's sector, lanes 2, 3 the next
    const uint32_t w = shift_word(shift);
    *reinterpret_cast<uint4*>(row + kPartialShiftByte + kPartialShiftStride * (col0 / 128) + 16 * (lane % 4)) =
        make_uint4(w, w, w, w);
    if (writes_lse) p.partial_lse[prow] = lse_val;
  }
}

}  // namespace mla_sm90
