// Loads of the SM90 decode mainloops: the split-KV work items, the query tile, and KV tiles into the 128-byte-swizzled
// stages (cp.async for bf16/fp16 caches; fp8 caches through registers, dequantised while being stored). The TMA loads
// of whole-tile pages are the mainloops' own (a tensor map per cache, common/launch.cuh).
#pragma once
#include <cstdint>

#include "fp8.cuh"
#include "params.h"
#include "ptx.cuh"
#include "traits.cuh"

namespace mla_sm90 {

// One work item of the split-KV schedule (mla_dispatch/metadata/schedule.py): request (< 0: padding, skip),
// its token range [tok_begin, tok_end), and the partial slot it writes (< 0: the request fits one
// part, write out / lse directly).
struct WorkItem {
  int req, tok_begin, tok_end, slot;
};
__device__ __forceinline__ WorkItem load_item(const DecodeParams& p, int item) {
  const int4 it = reinterpret_cast<const int4*>(p.items)[item];
  return {it.x, it.y, it.z, it.w};
}

// ---- bad block ids (docs/design.md §1) ----------------------------------------------------
// A block-table entry outside [0, num_blocks) is never used as an address: the loaders take block 0 in its place, and
// the mainloop makes every row of that work item NaN, out and lse (its row sums NaN at the epilogue: epilogue.cuh,
// poison_sum; the combine keeps a NaN piece NaN). A loader keeps the largest id it read for the item, as unsigned
// (negative ids are 2^31 or more), so a page read costs a compare, a select and a max, with no flag to materialise;
// the item met a bad id iff that maximum is not page_ok.
__device__ __forceinline__ bool page_ok(const DecodeParams& p, int page) { return (uint32_t)page < p.block_ids; }
__device__ __forceinline__ bool page_ok(const DecodeParams& p, uint32_t page) { return page < p.block_ids; }
// `page` where it names a block of the cache, else block 0; max_id: the largest id read so far, as unsigned.
__device__ __forceinline__ int checked_page(const DecodeParams& p, int page, uint32_t& max_id) {
  max_id = max(max_id, (uint32_t)page);
  return page_ok(p, page) ? page : 0;
}

// ---- KV tile loaders --------------------------------------------------------------------
// Thread mapping for all loaders: 8 threads per token (consecutive 16-byte chunks, so a
// warp reads 4 tokens x 128 contiguous bytes per instruction), 32 tokens per pass, 2 passes
// (load_kv_async with a warpgroup: 16 tokens per pass, 4 passes).

// Element offset of token t (in cache block `page`) of KV head kvh.
__device__ __forceinline__ int64_t kv_token_elem(const DecodeParams& p, int page, int t, int kvh) {
  return (int64_t)page * p.kv_stride_block + (int64_t)(t % p.page_size) * p.kv_stride_tok +
         (int64_t)kvh * p.kv_stride_head;
}

// Token t of request `req`, KV head kvh, in the cache (a bad block id: block 0's; max_id as in checked_page).
template <typename T>
__device__ __forceinline__ const uint8_t* token_ptr(const DecodeParams& p, int req, int t, int kvh, uint32_t& max_id) {
  const int page = checked_page(p, p.block_table[(int64_t)req * p.bt_stride + t / p.page_size], max_id);
  return reinterpret_cast<const uint8_t*>(p.kv) + kv_token_elem(p, page, t, kvh) * (int64_t)sizeof(T);
}

// bf16/fp16 cache: cp.async straight into the swizzled tile, by kLoaders threads (tid < kLoaders:
// the whole CTA, or one warpgroup of v6). max_id: as in checked_page, over this thread's rows.
template <typename T, class Layout, int kLoaders = Cfg::kThreads>
__device__ __forceinline__ void load_kv_async(const DecodeParams& p, T* sK, int req, int kvh, int t0, int t_end,
                                              uint32_t& max_id, int tid = threadIdx.x) {
  static_assert(Cfg::kBlockN % (kLoaders / 8) == 0, "8 threads per token row");
#pragma unroll
  for (int pass = 0; pass < Cfg::kBlockN / (kLoaders / 8); ++pass) {
    const int row = tid / 8 + (kLoaders / 8) * pass;
    const int t = t0 + row;
    const bool valid = t < t_end;
    const T* src =
        valid ? reinterpret_cast<const T*>(token_ptr<T>(p, req, t, kvh, max_id)) : reinterpret_cast<const T*>(p.kv);
#pragma unroll
    for (int k = 0; k < Cfg::kChunksQK / 8; ++k) {
      const int chunk = tid % 8 + 8 * k;
      cp_async_16(sK + Layout::offset(row, chunk * 8), src + (valid ? chunk * 8 : 0), valid);
    }
  }
}

// fp8 tiles for the wgmma kernels (v2: the CTA, v6: one warpgroup; Gmma128Tile64), 8 bytes per load:
// the 8 threads of token row tid / 8 + kLoaders / 8 * pass load 8 bytes each per step, so step k
// covers columns 64k .. 64k + 63 (one column block, whose 8-value chunk c is thread c's) and a row's 8
// stores fill one 128-byte row of the block, free of bank conflicts, at one base pointer plus
// compile-time offsets. 16-byte loads (16 fp8 values per thread) put a thread's two chunks in two
// column blocks at the same swizzle positions, so a row's stores conflict two-way (25% of v6's
// shared-memory wavefronts under ncu). H100 (docs/notes/cuda_sm90.md, "fp8 loads"): v6 b=64 h_q=16 fp8_e4m3 204 ->
// 185 us against 16-byte loads with the offsets folded, v2 b=128 h_q=128 L=8K 1016 -> 876 us; 16-byte
// loads with the lanes reordered so that the stores do not conflict measured 10% (v6) / 4% (v2) slower.
template <int kPasses>
struct Fp8Stage8B {
  uint2 v[kPasses][9];   // fp8 bytes 64k + 8c .. + 8 of the row (fp8_ds_mla: NoPE, k < 8)
  uint4 scale[kPasses];  // fp8_ds_mla: the row's four fp32 tile scales (one per 128 channels)
  uint4 rope[kPasses];   // fp8_ds_mla: rope values 8c .. 8c + 8 (bf16)
  bool valid[kPasses];
};

// Thread c's bytes of one fp8 token row at `src` into pass `pass` of st: 8 bytes of each column block (fp8_ds_mla:
// the 8 NoPE blocks, then the row's four tile scales and RoPE values 8c .. 8c + 8).
template <int KvFmt, int kPasses>
__device__ __forceinline__ void load_fp8_token(Fp8Stage8B<kPasses>& st, int pass, const uint8_t* src, int c) {
#pragma unroll
  for (int k = 0; k < (KvFmt == kKvFp8E4M3 ? 9 : 8); ++k) {
    st.v[pass][k] = __ldg(reinterpret_cast<const uint2*>(src) + c + 8 * k);
  }
  if constexpr (KvFmt != kKvFp8E4M3) {
    st.scale[pass] = __ldg(reinterpret_cast<const uint4*>(src + 512));
    st.rope[pass] = __ldg(reinterpret_cast<const uint4*>(src + 528) + c);
  }
}

// max_id: as in checked_page, over this thread's rows (a bad block id: block 0 is read in its place).
template <int KvFmt, int kLoaders, bool kPaged>
__device__ __forceinline__ void load_kv_fp8_8b(const DecodeParams& p, Fp8Stage8B<Cfg::kBlockN * 8 / kLoaders>& st,
                                               const int* spage, int req, int kvh, int t0, int t_end, int tid,
                                               uint32_t& max_id) {
  const int c = tid % 8;
#pragma unroll
  for (int pass = 0; pass < Cfg::kBlockN * 8 / kLoaders; ++pass) {
    const int row = tid / 8 + kLoaders / 8 * pass;
    const int t = t0 + row;
    const bool valid = t < t_end;
    st.valid[pass] = valid;
    // fp8_e4m3: no branch on the row; a row past the end reads page 0, in bounds, and is
    // zero-filled at the store. fp8_ds_mla keeps the branch: same-call A/B on the H100 (v6 b=64 h16 L=8K), without
    // it 221 us, with it 210; with it fp8_e4m3 went 185 -> 196 us (docs/notes/cuda_sm90.md, fifth session)
    if (KvFmt != kKvFp8E4M3 && !valid) continue;
    const int page = checked_page(
        p, kPaged ? spage[row] : (valid ? p.block_table[(int64_t)req * p.bt_stride + t / p.page_size] : 0), max_id);
    const int64_t elem = kv_token_elem(p, page, t, kvh);
    const uint8_t* src = reinterpret_cast<const uint8_t*>(p.kv) + elem;
    load_fp8_token<KvFmt>(st, pass, src, c);
  }
}

template <typename T, int KvFmt, int kLoaders>
__device__ __forceinline__ void store_kv_fp8_8b(T* stage, const Fp8Stage8B<Cfg::kBlockN * 8 / kLoaders>& st, int tid) {
  constexpr bool kScaled = KvFmt != kKvFp8E4M3;  // fp8_e4m3: the per-tensor scale is applied outside
  // chunk c of column block k of the thread's row in pass p: blk + 4096 k + kLoaders / 8 * 64 p
  T* const blk = stage + Gmma128Tile64::offset(tid / 8, 8 * (tid % 8));
  const uint4 zero = make_uint4(0, 0, 0, 0);
  if constexpr (KvFmt == kKvFp8DsV4) {
    // column blocks 0-6: the NoPE values times their ue8m0 scale (2^(byte - 127), the fp32 of that biased exponent;
    // 255 is NaN); 7: the RoPE values; 8: zeros (D_qk 512: q's column block 8 is zero too, load_q_tile_async)
#pragma unroll
    for (int pass = 0; pass < Cfg::kBlockN * 8 / kLoaders; ++pass) {
      T* const row = blk + kLoaders / 8 * 64 * pass;
      *reinterpret_cast<uint4*>(row + 4096 * 8) = zero;
      if (!st.valid[pass]) {
#pragma unroll
        for (int k = 0; k < 8; ++k) *reinterpret_cast<uint4*>(row + 4096 * k) = zero;
        continue;
      }
#pragma unroll
      for (int k = 0; k < 7; ++k) {
        const uint32_t e = ((k < 4 ? st.scale[pass].x : st.scale[pass].y) >> (8 * (k % 4))) & 0xffu;
        const float s = e == 0xffu ? __uint_as_float(0x7fc00000u) : __uint_as_float(e << 23);
        const uint2 w = st.v[pass][k];
        *reinterpret_cast<uint4*>(row + 4096 * k) =
            make_uint4(fp8x2_to<T, true>(w.x, s), fp8x2_to<T, true>(w.x >> 16, s), fp8x2_to<T, true>(w.y, s),
                       fp8x2_to<T, true>(w.y >> 16, s));
      }
      *reinterpret_cast<uint4*>(row + 4096 * 7) = rope_as<T>(st.rope[pass]);
    }
  } else {
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
}

// ---- sparse decode (params.h, DecodeParams::sparse): the loaders of the sparse instances (wgmma, etap; fp8t and
// seesaw_fp8 have their own, on the row addresses below) ------------------------------------------------------
// The table holds cache token ids (block * sparse_page + offset, FlashMLA's sparse indices), one per token; an id of
// -1 is a skipped top-k slot: its row is zero-filled like a row past the end (never read, so NaN poison in the cache
// cannot reach P V) and its score is masked (wgmma/wgmma.cuh). Any other id outside [0, block_ids) is a bad id, as
// in a dense launch (checked_page; block_ids counts tokens here). Separate from the dense loaders above, whose code
// (and SASS) the sparse instance leaves as it was.
__device__ __forceinline__ int sparse_id(const DecodeParams& p, int req, int t) {
  return p.block_table[(int64_t)req * p.bt_stride + t];
}
// Element offset of cache token `id` (checked) of KV head kvh, in the cache's own blocks, whatever their stride.
__device__ __forceinline__ int64_t sparse_token_elem(const DecodeParams& p, int id, int kvh) {
  return (int64_t)(id / p.sparse_page) * p.kv_stride_block + (int64_t)(id % p.sparse_page) * p.kv_stride_tok +
         (int64_t)kvh * p.kv_stride_head;
}

// Token t's page-table column and its row in the page (the converters of fp8t and of sparse seesaw_fp8): shifts where
// the page size is a power of two (every size the backend is tested with; a division by a runtime value is ~20
// instructions, and the converter takes several per tile: ncu, H100), a division otherwise.
struct PageGeometry {
  int size, shift;
  bool pow2;
  __device__ __forceinline__ int index(int t) const { return pow2 ? t >> shift : t / size; }
  __device__ __forceinline__ int row(int t) const { return pow2 ? t & (size - 1) : t % size; }
};
__device__ __forceinline__ PageGeometry page_geometry(int page_size) {
  PageGeometry g;
  g.size = page_size;
  g.shift = __ffs(page_size) - 1;
  g.pow2 = (page_size & (page_size - 1)) == 0;
  return g;
}
// Byte offset of token t (in cache block `page`) of KV head kvh (kv_token_elem with PageGeometry).
__device__ __forceinline__ int64_t paged_row_offset(const DecodeParams& p, const PageGeometry& pg, int page, int t,
                                                    int kvh) {
  return (int64_t)page * p.kv_stride_block + (int64_t)pg.row(t) * p.kv_stride_tok + (int64_t)kvh * p.kv_stride_head;
}

// Bytes of a sparse row an L2 prefetch asks for (fp8_ds_v4: the token's data; its 8 scale bytes lie apart).
template <int KvFmt>
constexpr int sparse_row_bytes() {
  return KvFmt == kKvFp8DsMla ? kDsMlaTokenBytes : KvFmt == kKvFp8DsV4 ? kDsV4DataBytes : kHeadDimQK;
}

// The data of sparse token `id` (pg: of the cache's page size, sparse_page; the token is row `id` of block
// pg.index(id)): fp8_ds_v4 its 576 bytes in the block, else its row of KV head kvh (paged_row_offset).
__device__ __forceinline__ const uint8_t* sparse_row(const DecodeParams& p, const PageGeometry& pg, int id, int kvh,
                                                     bool ds_v4) {
  const uint8_t* kv = reinterpret_cast<const uint8_t*>(p.kv);
  return ds_v4 ? kv + (int64_t)pg.index(id) * p.kv_stride_block + (int64_t)pg.row(id) * kDsV4DataBytes
               : kv + paged_row_offset(p, pg, pg.index(id), id, kvh);
}
// fp8_ds_v4: token `id`'s 8 scale bytes, behind its block's tokens.
__device__ __forceinline__ const uint8_t* ds_v4_scales(const DecodeParams& p, const PageGeometry& pg, int id) {
  return reinterpret_cast<const uint8_t*>(p.kv) + (int64_t)pg.index(id) * p.kv_stride_block +
         (int64_t)p.sparse_page * kDsV4DataBytes + 8 * pg.row(id);
}

// load_kv_async of a sparse launch (the whole CTA).
template <typename T, class Layout>
__device__ __forceinline__ void load_kv_async_sparse(const DecodeParams& p, T* sK, int req, int kvh, int t0,
                                                     int t_end, uint32_t& max_id) {
  constexpr int kLoaders = Cfg::kThreads;
  const int tid = threadIdx.x;
#pragma unroll
  for (int pass = 0; pass < Cfg::kBlockN / (kLoaders / 8); ++pass) {
    const int row = tid / 8 + (kLoaders / 8) * pass;
    const int t = t0 + row;
    const int id = t < t_end ? sparse_id(p, req, t) : -1;
    const bool valid = id != -1;
    const T* src = reinterpret_cast<const T*>(p.kv);
    if (valid) src += sparse_token_elem(p, checked_page(p, id, max_id), kvh);
#pragma unroll
    for (int k = 0; k < Cfg::kChunksQK / 8; ++k) {
      const int chunk = tid % 8 + 8 * k;
      cp_async_16(sK + Layout::offset(row, chunk * 8), src + (valid ? chunk * 8 : 0), valid);
    }
  }
}

// One fp8_ds_v4 token (config.h, kDsV4*) into pass `pass` of st: its 7 NoPE column blocks (8 bytes of each), its
// RoPE values 8c .. 8c + 8 (bf16, stored as column block 7) and its 7 scale bytes + pad (st.scale.x, .y). `data` is
// the token's 576 bytes in its block, `scales` its 8 scale bytes behind the block's tokens (FlashMLA reads the same
// layout: csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh, MODEL1).
template <int kPasses>
__device__ __forceinline__ void load_ds_v4_token(Fp8Stage8B<kPasses>& st, int pass, const uint8_t* data,
                                                 const uint8_t* scales, int c) {
#pragma unroll
  for (int k = 0; k < 7; ++k) st.v[pass][k] = __ldg(reinterpret_cast<const uint2*>(data) + c + 8 * k);
  st.rope[pass] = __ldg(reinterpret_cast<const uint4*>(data + 448) + c);
  const uint2 s = __ldg(reinterpret_cast<const uint2*>(scales));
  st.scale[pass] = make_uint4(s.x, s.y, 0u, 0u);
}

// load_kv_fp8_8b of a sparse launch (store_kv_fp8_8b stores it), by kLoaders threads (tid < kLoaders: the whole CTA of
// wgmma, or one warpgroup of etap); the ids from `sids` (the tile's table entries prefetched into shared memory,
// etap's prefetch_pages) where it is given, else from the table. A row whose id is -1 (or past t_end) is not valid.
template <int KvFmt, int kLoaders = Cfg::kThreads>
__device__ __forceinline__ void load_kv_fp8_8b_sparse(const DecodeParams& p, Fp8Stage8B<Cfg::kBlockN * 8 / kLoaders>& st,
                                                      int req, int kvh, int t0, int t_end, int tid, uint32_t& max_id,
                                                      const int* sids = nullptr) {
  const int c = tid % 8;
#pragma unroll
  for (int pass = 0; pass < Cfg::kBlockN * 8 / kLoaders; ++pass) {
    const int row = tid / 8 + kLoaders / 8 * pass;
    const int t = t0 + row;
    const int id = t < t_end ? (sids != nullptr ? sids[row] : sparse_id(p, req, t)) : -1;
    st.valid[pass] = id != -1;
    if (id == -1) continue;
    if constexpr (KvFmt == kKvFp8DsV4) {  // one KV head; the token's bytes and its scales are apart in its block
      const int ok_id = checked_page(p, id, max_id);
      const uint8_t* block =
          reinterpret_cast<const uint8_t*>(p.kv) + (int64_t)(ok_id / p.sparse_page) * p.kv_stride_block;
      const int slot = ok_id % p.sparse_page;
      load_ds_v4_token(st, pass, block + (int64_t)slot * kDsV4DataBytes,
                       block + (int64_t)p.sparse_page * kDsV4DataBytes + 8 * slot, c);
    } else {
      const uint8_t* src =
          reinterpret_cast<const uint8_t*>(p.kv) + sparse_token_elem(p, checked_page(p, id, max_id), kvh);
      load_fp8_token<KvFmt>(st, pass, src, c);
    }
  }
}

// The item's Q tile [64 x 576] into sQ by cp.async (committed by the caller): query rows row_tile * tile_m + i of the
// KV head for i < tile_m (etap's row tiles have 16 rows); rows past rows_per_kv_head or the tile are zero-filled, and
// the chunks of 8 values from kQChunks on (a q of D_qk 512, fp8_ds_v4: 64). 8 threads per row, 32 rows per pass, 2
// passes.
template <typename T, class Layout, int kQChunks = Cfg::kChunksQK>
__device__ __forceinline__ void load_q_tile_async(const DecodeParams& p, T* sQ, int req, int row_tile, int kvh,
                                                  int tile_m = Cfg::kBlockM) {
  const int tid = threadIdx.x;
  const int heads_per_kv = p.heads_q / p.heads_kv;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int row = tid / 8 + 32 * pass;
    const int r = row_tile * tile_m + row;
    const bool valid = r < p.rows_per_kv_head && row < tile_m;
    const int rc = valid ? r : 0;
    const T* src = reinterpret_cast<const T*>(p.q) + (int64_t)req * p.q_stride_b +
                   (int64_t)(rc / heads_per_kv) * p.q_stride_s +
                   (int64_t)(kvh * heads_per_kv + rc % heads_per_kv) * p.q_stride_h;
#pragma unroll
    for (int k = 0; k < Cfg::kChunksQK / 8; ++k) {
      const int chunk = tid % 8 + 8 * k;
      if constexpr (kQChunks < Cfg::kChunksQK)
        cp_async_16(sQ + Layout::offset(row, chunk * 8), src + (chunk < kQChunks ? chunk * 8 : 0),
                    valid && chunk < kQChunks);
      else
        cp_async_16(sQ + Layout::offset(row, chunk * 8), src + chunk * 8, valid);
    }
  }
}

// Zero the V rows [valid, 64) of column blocks [4*half, 4*half + 4) of a stage (one warpgroup).
template <typename T>
__device__ __forceinline__ void zero_v_rows(T* stage, int valid, int half, int tid_wg) {
  const int rows = Cfg::kBlockN - valid;
  const int per_block = rows * 8;  // 16-byte chunks
  for (int i = tid_wg; i < 4 * per_block; i += 128) {
    const int blk = 4 * half + i / per_block, rem = i % per_block;
    *reinterpret_cast<uint4*>(stage + blk * 64 * 64 + (valid + rem / 8) * 64 + (rem % 8) * 8) = make_uint4(0, 0, 0, 0);
  }
}

// Rows [row_begin, row_end) of a K tile in shared memory (64 tokens x 576 channels in 64x64 blocks, 128-byte
// swizzled: a token's 64 channels of a block fill one 128-byte line whatever the swizzle), their V channels (blocks
// 0-7): every non-finite value set to 0. For keys the causal mask hides from some row of the tile: that row's p is 0
// for them, but 0 * NaN in P V is NaN; the rows that see such a key get NaN from its score already (V is the first
// 512 channels of K), so only the rows that must not see it change (the rule of the Triton kernel's
// _hide_from_rows_that_do_not_see, kernels/triton/decode.py). Blocks [blk_begin, blk_begin + blocks) of the eight
// (a warpgroup's half: 4 * half, 4). 16-byte vectors over `threads` threads; the caller fences (generic -> async
// proxy) and syncs before the P V wgmma reads the tile.
template <typename T>
__device__ __forceinline__ void clean_hidden_rows(T* tile, int row_begin, int row_end, int tid, int threads,
                                                  int blk_begin = 0, int blocks = 8) {
  constexpr uint32_t kExp = TypeTraits<T>::kIsBf16 ? 0x7f80u : 0x7c00u;  // exponent bits: all ones = inf or NaN
  const int per_row = blocks * 8;                                        // 16-byte vectors of a token row
  const int vectors = (row_end - row_begin) * per_row;
  // a loop of few registers: it runs on causal tail tiles only, and unrolled it took registers v9's consumers (232
  // by setmaxnreg) did not have (ptxas: spills 48 / 76 bytes against 32 / 36)
#pragma unroll 1
  for (int v = tid; v < vectors; v += threads) {
    const int row = row_begin + v / per_row, blk = blk_begin + (v % per_row) / 8, chunk = v % 8;
    uint4* at = reinterpret_cast<uint4*>(tile + blk * 64 * 64 + row * 64 + chunk * 8);
    uint4 x = *at;
    uint32_t* w = reinterpret_cast<uint32_t*>(&x);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if ((w[i] & kExp) == kExp) w[i] &= 0xffff0000u;                  // the low half
      if (((w[i] >> 16) & kExp) == kExp) w[i] &= 0x0000ffffu;          // the high half
    }
    *at = x;
  }
}

}  // namespace mla_sm90
