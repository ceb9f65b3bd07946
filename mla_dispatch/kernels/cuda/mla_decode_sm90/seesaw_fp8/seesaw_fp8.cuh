// [notes]: docs/notes/cuda_sm90.md, the development history these comments cite
// SM90 MLA decode, mainloop seesaw_fp8 (Mainloop::kSeesawFp8; v9 in the history): the schedule of mainloop seesaw
// (seesaw/seesaw.cuh, which describes it: two KV tiles in flight, one per consumer warpgroup, each softmax overlapping
// the other warpgroup's GEMMs; its constants and shared memory in common/seesaw_pair.cuh) over an fp8_e4m3 cache,
// with a third warpgroup that converts each tile into the K stages in place (seesaw_fp8_converter). The consumers
// take S's column blocks in the converter's order and free each stage in two parts (release), where seesaw refills
// it by TMA. Sparse launches over fp8_ds_mla / fp8_ds_v4 caches have a converter of their own, which gathers the rows
// by id (seesaw_fp8_sparse_converter, below).
//
// A dense 64-token tile must sit in one page (page_size % 64 == 0), and the cache must be one a tensor map describes;
// the binding refuses other caches (binding.cpp, check_config). Query lengths up to kSeesawMaxQLen, as seesaw.
//
// Bad block ids (docs/design.md §1): the converter, which may run an item ahead, sets a flag per stage
// (sBad[1 + stage]) before the tile's full barriers, and the warpgroup that owns the tile (warpgroup 0 for stage 0,
// 1 for stage 1) moves it into the item's flag sBad[0] (cleared by thread 0 when the item starts, read by every
// thread after the epilogue's barrier) when it releases the stage's early part (release), after which the converter
// may rewrite it; the item then ends with NaN row sums, out and lse.
#pragma once
#include <cmath>
#include <cstdint>
#include <cuda.h>

#include "common/epilogue.cuh"
#include "common/fp8.cuh"
#include "common/loads.cuh"
#include "common/ptx.cuh"
#include "common/seesaw_pair.cuh"
#include "common/traits.cuh"
#include "common/gmma.cuh"

namespace mla_sm90 {

// seesaw_fp8's own constants (the schedule's are SeesawPair's): a third warpgroup converts the tiles
// (seesaw_fp8_converter); barriers 7 (the two consumer warpgroups, in place of __syncthreads) and 8 (the converter).
// setmaxnreg moves registers between the warpgroups (it adds none: 2 x 232 + 40 = 3 x 168, the launch's share of 384
// threads); seesaw itself uses 255 at 256 threads, and ptxas spilled 28 bytes of the unpaired kernel at 232 (4 at
// 240; no converter fits in 24)
struct SeesawFp8 {
  static constexpr int kThreads = 384;
  static constexpr int kBarConsumers = 7, kBarConv = 8;
  static constexpr int kRegsConsumer = 232, kRegsConv = 40, kRegsLaunch = 168;
  static_assert(2 * kRegsConsumer + kRegsConv == 3 * kRegsLaunch, "setmaxnreg moves registers, adds none");
};

// The converter (warpgroup 2 of mla_decode_seesaw_fp8): fills the two K stages with each tile of
// the CTA's items in turn, converted from fp8_e4m3 into T, unscaled (the kernel folds the per-tensor scale into the
// softmax scale and the output, as v2 does). Tile j goes to stage j % 2, as in v5.
//
// No room for a raw staging buffer beside Q and the two 72 KB stages, so the raw tile lands in the stage it is
// converted into. v5's readers free a stage in two steps (the refill points of v5): an early part, 32 KB (stage 0:
// column blocks 0..3, once warpgroup 0 is done with P_a V_aL and S_a; stage 1: blocks 4..7, once warpgroup 1 is done
// with P_b V_bR), and the rest later. Raw column blocks 0..7 (64 tokens x 64 bytes each) go into the early part by
// TMA as soon as it is free (raw block c at 4c KB in stage 0, at 32 + 4c KB in stage 1), with an L2 prefetch of the
// RoPE columns (block 8), which are copied by TMA to 64 KB once the rest is free too. Then the blocks are converted in
// place in groups, a barrier of the warpgroup before each group's stores where they overwrite raw bytes (every raw
// block read into registers before any store over it):
//   stage 0: 7, 6, 5, 4 (over nothing raw) | read 3, 2; barrier; store | read 1, 0; barrier; store | read 8; b.; store
//   stage 1: 0, 1, 2, 3 (over nothing raw) | read 4, 5; barrier; store | read 6, 7; barrier; store | read 8; b.; store
// The consumers' S takes the blocks in the same order. Each converted pair of blocks is fenced for the async proxy
// once and signalled on the blocks' full barriers (128 arrivals each); rows past the item's end are stored as zeros
// (what v5's fix_partial does for V, for K too). Thread t converts rows t / 4 and t / 4 + 32, 16 bytes (chunk t % 4)
// of each raw block row: a warp reads 8 whole 64-byte rows, free of bank conflicts.
//
// The converter runs its tiles in order, but a stage-0 tile j waits for its late part only after it has started the
// raw copy of tile j + 1 (stage 1): warpgroup 1 frees the early part of stage 1 (after P_b V_bR) before the late part
// of stage 0 (after sP0 V_aR), so the wait costs nothing and tile j + 1's bytes fly while tile j is converted. (The
// other way round would wait for the next pair's P V.)
// A first version (a barrier and a fence per block, the RoPE block first by register loads; commit c6a2525) measured
// as slow as v2; register loads of the RoPE block held through the conversion spilled 144 bytes here.
// sBad: the kernel's flags (SeesawPair::kBadFlags); the converter writes sBad[1 + s], whether the page of the tile it
// starts in stage s is a bad block id (the tile then copies block 0), before any full barrier of the tile.
template <typename T>
__device__ __forceinline__ void seesaw_fp8_converter(const DecodeParams& p, const CUtensorMap* map, T* sK, uint64_t* bars,
                                                     int* sBad, int part, int kvh, int tid_c) {
  uint64_t* full = bars;
  uint64_t* empty = bars + 2 * SeesawPair::kBlocks;  // [stage][early, late]
  uint64_t* raw_bar = empty + 4;                  // [stage]
  uint64_t* rope_bar = raw_bar + 2;               // [stage]
  const int r0 = tid_c / 4, q = tid_c % 4;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint32_t fills0 = 0, fills1 = 0;  // tiles started in each stage so far (the phases of its barriers)
  // the raw copy of tile t0.. of request `req` into stage s (its early part free), and the RoPE rows asked of L2
  auto start_tile = [&](int s, int req, int t0) {
    const uint32_t k = s == 0 ? fills0++ : fills1++;
    if (k > 0) mbar_wait(empty + 2 * s, (k - 1) & 1u);  // (the stage's last flag was read before this release)
    int page = p.block_table[(int64_t)req * p.bt_stride + t0 / p.page_size];
    if (tid_c == 0) {
      const bool ok = page_ok(p, page);
      page = ok ? page : 0;
      sBad[1 + s] = !ok;
      uint8_t* raw = reinterpret_cast<uint8_t*>(sK + s * Cfg::kKElems) + (s == 0 ? 0 : 32768);
      mbar_arrive_expect_tx(raw_bar + s, 8 * 4096);
#pragma unroll
      for (int c = 0; c < 8; ++c) tma_load_4d(raw + 4096 * c, map, raw_bar + s, 64 * c, kvh, t0 % p.page_size, page);
      // the RoPE box asked of L2 (inline: a ptx.cuh wrapper of this asm moved one instruction of the kernel)
      asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global [%0, {%1, %2, %3, %4}];\n" ::"l"(
                       reinterpret_cast<uint64_t>(map)),
                   "r"(512), "r"(kvh), "r"(t0 % p.page_size), "r"(page)
                   : "memory");
    }
    return k;
  };
  const int item_end = p.part_offsets[part + 1];
  for (int item = p.part_offsets[part]; item < item_end; ++item) {
    const WorkItem w = load_item(p, item);
    if (w.req < 0) continue;
    const int num_tiles = (w.tok_end - w.tok_begin + Cfg::kBlockN - 1) / Cfg::kBlockN;
    auto t0_of = [&](int j) { return w.tok_begin + j * Cfg::kBlockN; };
    auto valid_of = [&](int j) { return min(Cfg::kBlockN, w.tok_end - t0_of(j)); };
    uint32_t k_next = 0;  // the fill of tile j when tile j - 1 started it
    for (int j = 0; j < num_tiles; ++j) {
      const int s = j & 1;
      const int t0 = t0_of(j), valid = valid_of(j);
      const uint32_t k = (s == 1) ? k_next : start_tile(0, w.req, t0);
      if (s == 0 && j + 1 < num_tiles) k_next = start_tile(1, w.req, t0_of(j + 1));
      T* st = sK + s * Cfg::kKElems;
      const uint8_t* raw = reinterpret_cast<const uint8_t*>(st) + (s == 0 ? 0 : 32768);
      if (k > 0) mbar_wait(empty + 2 * s + 1, (k - 1) & 1u);
      if (tid_c == 0) {  // the RoPE block, asked of L2 when the tile started, to 64 KB (free now)
        int page = p.block_table[(int64_t)w.req * p.bt_stride + t0 / p.page_size];
        page = page_ok(p, page) ? page : 0;  // (start_tile flagged it)
        mbar_arrive_expect_tx(rope_bar + s, 4096);
        tma_load_4d(reinterpret_cast<uint8_t*>(st) + 65536, map, rope_bar + s, 512, kvh, t0 % p.page_size, page);
      }
      mbar_wait(raw_bar + s, k & 1u);
      auto read = [&](int c, uint4 (&v)[2]) {  // raw block c (8: the RoPE block at 64 KB)
        const uint8_t* src = c == 8 ? reinterpret_cast<const uint8_t*>(st) + 65536 : raw + 4096 * c;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = r0 + 32 * h;
          v[h] = row < valid ? *reinterpret_cast<const uint4*>(src + 64 * row + 16 * q) : zero;
        }
      };
      auto store = [&](int c, const uint4 (&v)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) store_e4m3x16(st, r0 + 32 * h, 64 * c + 16 * q, v[h]);
      };
      auto signal = [&](int c0, int c1) {  // blocks c0 and c1 of this tile are in place
        fence_proxy_async_smem();
        mbar_arrive(full + s * SeesawPair::kBlocks + c0);
        mbar_arrive(full + s * SeesawPair::kBlocks + c1);
      };
      // group 1: four blocks whose places hold no raw bytes (stage 0: 7..4 over [32, 64) KB; stage 1: 0..3)
#pragma unroll 1
      for (int i = 0; i < 4; i += 2) {
        const int c0 = s == 0 ? 7 - i : i, c1 = s == 0 ? 6 - i : i + 1;
        uint4 v0[2], v1[2];
        read(c0, v0);
        read(c1, v1);
        store(c0, v0);
        store(c1, v1);
        signal(c0, c1);
      }
      // groups 2 and 3: over raw bytes read before the barrier
#pragma unroll 1
      for (int g = 0; g < 2; ++g) {
        const int c0 = s == 0 ? 3 - 2 * g : 4 + 2 * g, c1 = s == 0 ? 2 - 2 * g : 5 + 2 * g;
        uint4 v0[2], v1[2];
        read(c0, v0);
        read(c1, v1);
        named_barrier(SeesawFp8::kBarConv, 128);
        store(c0, v0);
        store(c1, v1);
        signal(c0, c1);
      }
      // the RoPE block last: its copy (an L2 hit) had the whole conversion to land
      mbar_wait(rope_bar + s, k & 1u);
      uint4 v8[2];
      read(8, v8);
      named_barrier(SeesawFp8::kBarConv, 128);
      store(8, v8);
      fence_proxy_async_smem();
      mbar_arrive(full + s * SeesawPair::kBlocks + 8);
    }
  }
}

// ---- sparse launches (params.h, DecodeParams::sparse): fp8_ds_mla and fp8_ds_v4 caches, 64 heads or more per KV
// head (the producer-warpgroup design of FlashMLA's sparse decode, csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh, on
// seesaw's schedule). The converter gathers each tile's rows by id instead of by TMA: its thread t copies bytes
// [16 (t % 4), + 16) of every 64-byte NoPE block of rows t / 4 and t / 4 + 32 by cp.async into the raw layout of the
// dense converter (raw block c at 4c KB of the stage's early part, 64 bytes per row), the copies counted on the
// stage's raw mbarrier (cp_async_mbar_arrive), and later converts the same bytes, times the row's scale of the block,
// in the dense converter's order. The RoPE values (bf16 in both caches) go by cp.async into block 8's place, with the
// raw copies in stage 0 (whose block 8 is free with its early part) and once the late part is free in stage 1 (asked
// of L2 when the tile starts): fp8_ds_mla reads them there (bf16 q: as copied; fp16 q: converted in place by the
// thread that copied them); fp8_ds_v4, whose D_qk is 512, moves them to block 7 (its NoPE has 7 blocks) and never
// reads block 8. A row without a key (a -1 id, or past the list's length) is zero-filled by the copies and cleared in
// the stage's row mask, which the tile's softmax applies (seesaw_softmax, kBits); a bad id reads token 0 in its place
// and sets its warp's byte in the stage's bad flags, which the tile's owner moves into the item's flag as the dense
// flag is (release). Measured slower than wgmma's sparse instances on the H200 (benchmarks/RESULTS.md, 2026-11-29, "the
// producer-warpgroup design"), so the plan runs it only when backend_options force variant 9 (choose_sparse_variant).
template <int KvFmt>
struct SeesawFp8Sparse {
  static constexpr bool kV4 = KvFmt == kKvFp8DsV4;
  static constexpr int kNope = kV4 ? 7 : 8;  // fp8 column blocks of a token
  static constexpr int kRope = kV4 ? 7 : 8;  // the column block of its RoPE values, converted last
  static constexpr int kRopeByte = kV4 ? 448 : 528;  // where they start in the token's bytes (sparse_row)
};

// `x`, opaque to the optimiser: the converter's shared-memory offsets derive from its row, made opaque inside its tile
// loop, since hoisted out of it (one per row, block and stage) they did not fit its registers (ptxas spilled ~280
// bytes of them)
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// Bits 0, 4, .., 28 of a warp's ballot (the converter's rows 8w + i, four lanes each) as bits 0 .. 7.
__device__ __forceinline__ uint32_t quad_bits(uint32_t b) {
  b &= 0x11111111u;
  b = (b | (b >> 3)) & 0x03030303u;
  b = (b | (b >> 6)) & 0x000f000fu;
  return (b | (b >> 12)) & 0xffu;
}

template <typename T, int KvFmt>
__device__ __forceinline__ void seesaw_fp8_sparse_converter(const DecodeParams& p, T* sK, uint64_t* bars,
                                                            uint32_t* sTile, int part, int kvh, int tid_c) {
  using F = SeesawFp8Sparse<KvFmt>;
  using L = Gmma128Tile64;
  uint64_t* full = bars;
  uint64_t* empty = bars + 2 * SeesawPair::kBlocks;  // [stage][early, late]
  uint64_t* raw_bar = empty + 4;                     // [stage], 128 arrivals (cp_async_mbar_arrive)
  uint64_t* rope_bar = raw_bar + 2;                  // [stage], the same
  const int lane = tid_c % 32, warp = tid_c / 32;
  const PageGeometry pg = page_geometry(p.sparse_page);
  uint32_t fills0 = 0, fills1 = 0;  // tiles started in each stage so far (the phases of its barriers)
  // the id of token t of the list (-1: none, or past t_end)
  auto row_id = [&](int req, int t, int t_end) { return t < t_end ? sparse_id(p, req, t) : -1; };
  // a row's id checked: its token's bytes, `id` the token read (token 0 for a bad id or none); valid: it holds a key
  auto checked_row = [&](int& id, bool& valid, bool& bad) {
    valid = id != -1;
    bad = valid && !page_ok(p, id);
    id = valid && !bad ? id : 0;
    return sparse_row(p, pg, id, kvh, F::kV4);
  };
  // the RoPE values of row `row` (8 per thread and copy) into block 8's place of stage `st`: issued with the raw copies
  // in stage 0 and once the late part is free in stage 1, and counted on the stage's rope mbarrier. (A stage-1 tile's
  // copies at its conversion, behind the next tile's raw copies, would count those too: an arrival on an mbarrier
  // waits for every earlier cp.async of the thread.)
  auto rope_copy = [&](T* st, int row, const uint8_t* src, bool valid, int q) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int ch = q + 4 * i;
      cp_async_16(st + L::offset(row, 512 + 8 * ch), src + F::kRopeByte + 16 * ch, valid);
    }
  };
  // The ids of the thread's two rows, a queue per stage of the stage's next two tiles ([0] the next, [1] the one
  // after; -1 past the list): a tile's copies never wait for its ids. (An L2 prefetch of the rows of the stage's next
  // tile, as fp8t's converter asks for its rows ahead, was slower: RESULTS.md, 2026-11-29, "the producer-warpgroup".)
  int queue0[2][2], queue1[2][2];
  auto tile_ids = [&](int (&ids)[2], int req, int t0, int t_end) {
#pragma unroll
    for (int h = 0; h < 2; ++h) ids[h] = row_id(req, t0 + tid_c / 4 + 32 * h, t_end);
  };
  // the raw NoPE copies of the tile at t0 into stage S (its early part free), stage 0's RoPE copies (stage 1's RoPE
  // values and scales asked of L2), its row mask and bad flags, and the queue moved on
  auto start_tile = [&](auto stage_c, int req, int t0, int t_end) {
    constexpr int S = decltype(stage_c)::value;
    int (&queue)[2][2] = S == 0 ? queue0 : queue1;
    const uint32_t k = S == 0 ? fills0++ : fills1++;
    if (k > 0) mbar_wait(empty + 2 * S, (k - 1) & 1u);  // (the stage's last words were read before this release)
    uint8_t* raw = reinterpret_cast<uint8_t*>(sK + S * Cfg::kKElems) + (S == 0 ? 0 : 32768);
    const int r0 = opaque(tid_c / 4), q = tid_c % 4;
    bool valid[2], bad[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = r0 + 32 * h;
      int id = queue[0][h];
      const uint8_t* src = checked_row(id, valid[h], bad[h]);
#pragma unroll
      for (int c = 0; c < F::kNope; ++c)
        cp_async_16(raw + 4096 * c + 64 * row + 16 * q, src + 64 * c + 16 * q, valid[h]);
      if (S == 0) rope_copy(sK, row, src, valid[h], q);  // (stage 0's block 8 is free with its early part)
      if (S == 1 && q == 0 && valid[h] && !bad[h]) {  // its RoPE values and scales, asked of L2 (copied / loaded later)
        if constexpr (F::kV4) {
          prefetch_l2_bulk(src + F::kRopeByte, 128);
          prefetch_l2_bulk(
              reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(ds_v4_scales(p, pg, queue[0][h])) &
                                            ~uintptr_t(15)),
              16);
        } else {
          prefetch_l2_bulk(src + 512, kDsMlaTokenBytes - 512);  // 4 fp32 scales, 64 bf16 RoPE values
        }
      }
    }
    cp_async_mbar_arrive(raw_bar + S);
    if (S == 0) cp_async_mbar_arrive(rope_bar);
    const uint32_t v0 = __ballot_sync(~0u, valid[0]), v1 = __ballot_sync(~0u, valid[1]);
    const bool any_bad = __any_sync(~0u, bad[0] || bad[1]);
    if (lane == 0) {
      uint8_t* words = reinterpret_cast<uint8_t*>(sTile + 4 * S);
      words[warp] = static_cast<uint8_t>(quad_bits(v0));
      words[4 + warp] = static_cast<uint8_t>(quad_bits(v1));
      words[8 + warp] = any_bad ? 1 : 0;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) queue[0][h] = queue[1][h];
    tile_ids(queue[1], req, t0 + 4 * Cfg::kBlockN, t_end);
    return k;
  };
  // the tile at t0 in stage s, its k-th: RoPE copies and scales, then the blocks in the dense converter's order
  auto convert_tile = [&](int s, uint32_t k, int req, int t0, int t_end) {
    T* st = sK + s * Cfg::kKElems;
    const uint8_t* raw = reinterpret_cast<const uint8_t*>(st) + (s == 0 ? 0 : 32768);
    const int r0 = opaque(tid_c / 4), q = tid_c % 4;
    const uint8_t* src[2];
    bool valid[2];
    uint4 scales[2];  // fp8_ds_mla: 4 fp32; fp8_ds_v4: 8 ue8m0 bytes (.x, .y)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      bool bad;
      int id = row_id(req, t0 + r0 + 32 * h, t_end);
      src[h] = checked_row(id, valid[h], bad);
      scales[h] = make_uint4(0u, 0u, 0u, 0u);
      if (valid[h]) {
        if constexpr (F::kV4) {
          const uint2 e = __ldg(reinterpret_cast<const uint2*>(ds_v4_scales(p, pg, id)));
          scales[h] = make_uint4(e.x, e.y, 0u, 0u);
        } else {
          scales[h] = __ldg(reinterpret_cast<const uint4*>(src[h] + 512));
        }
      }
    }
    if (k > 0) mbar_wait(empty + 2 * s + 1, (k - 1) & 1u);
    if (s == 1) {  // (stage 1's block 8 is sP1, free with its late part)
#pragma unroll
      for (int h = 0; h < 2; ++h) rope_copy(st, r0 + 32 * h, src[h], valid[h], q);
      cp_async_mbar_arrive(rope_bar + 1);
    }
    // block c's scale of row h (c runs in a loop: selects, not an indexed array, which would live in local memory)
    auto scale_of = [&](int h, int c) {
      if constexpr (F::kV4) {
        const uint32_t e = ((c < 4 ? scales[h].x : scales[h].y) >> (8 * (c % 4))) & 0xffu;
        return __uint_as_float(e << 23);  // ue8m0: 2^(e - 127)
      } else {
        const int g = c / 2;  // one per 128 values
        return __uint_as_float(g == 0 ? scales[h].x : g == 1 ? scales[h].y : g == 2 ? scales[h].z : scales[h].w);
      }
    };
    mbar_wait(raw_bar + s, k & 1u);
    // The blocks two at a time: raw into registers, (after the converter's barrier where it must) converted, stored,
    // fenced once and signalled. Stage 0 holds raw block c at 4c KB, stage 1 at 32 + 4c KB, and converted block c
    // goes to 8c KB, so stage 0 runs 7, 6 and 5, 4 over no raw bytes, then 3, 2 and 1, 0, and stage 1 runs 0, 1 and
    // 2, 3 over no raw bytes, then 4, 5 and 6, 7, each of the last two pairs after a barrier once every raw block it
    // overwrites was read by all (fp8_ds_v4, 7 blocks: stage 0 runs 6, 5 | 4, 3 | 2, 1 | 0 with the barrier from the
    // second pair on, block 3 landing on raw 6; stage 1 0, 1 | 2, 3 | 4, 5 | 6). A loop, not unrolled: unrolled, each
    // block's addresses were hoisted out of the tile loop and spilled (the converter has 40 registers)
    constexpr int kPairs = (F::kNope + 1) / 2;
#pragma unroll 1
    for (int pair = 0; pair < kPairs; ++pair) {
      const int c0 = s == 0 ? F::kNope - 1 - 2 * pair : 2 * pair;
      const bool two = 2 * pair + 1 < F::kNope;
      const int c1 = s == 0 ? c0 - 1 : c0 + 1;
      uint4 v0[2], v1[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        v0[h] = *reinterpret_cast<const uint4*>(raw + 4096 * c0 + 64 * (r0 + 32 * h) + 16 * q);
        v1[h] = two ? *reinterpret_cast<const uint4*>(raw + 4096 * c1 + 64 * (r0 + 32 * h) + 16 * q) : v0[h];
      }
      if (pair >= 2 || (F::kV4 && s == 0 && pair == 1)) named_barrier(SeesawFp8::kBarConv, 128);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        store_e4m3x16<T, true>(st, r0 + 32 * h, 64 * c0 + 16 * q, v0[h], scale_of(h, c0));
        if (two) store_e4m3x16<T, true>(st, r0 + 32 * h, 64 * c1 + 16 * q, v1[h], scale_of(h, c1));
      }
      fence_proxy_async_smem();
      mbar_arrive(full + s * SeesawPair::kBlocks + c0);
      if (two) mbar_arrive(full + s * SeesawPair::kBlocks + c1);
    }
    // the RoPE values, each thread its own copies (fp8_ds_v4's block 7 lands on stage 1's raw 6, which every thread
    // read before the last pair's barrier)
    mbar_wait(rope_bar + s, k & 1u);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = r0 + 32 * h, ch = q + 4 * i;
        uint4* at = reinterpret_cast<uint4*>(st + L::offset(row, 512 + 8 * ch));
        if constexpr (F::kV4)
          *reinterpret_cast<uint4*>(st + L::offset(row, 448 + 8 * ch)) = rope_as<T>(*at);
        else if constexpr (!TypeTraits<T>::kIsBf16)
          *at = rope_as<T>(*at);
      }
    fence_proxy_async_smem();
    mbar_arrive(full + s * SeesawPair::kBlocks + F::kRope);
  };
  const int item_end = p.part_offsets[part + 1];
  for (int item = p.part_offsets[part]; item < item_end; ++item) {
    const WorkItem w = load_item(p, item);
    if (w.req < 0) continue;
    const int tok_end = min(w.tok_end, max(p.cache_seqlens[w.req], w.tok_begin));  // the list's length (wgmma's)
    const int num_tiles = (tok_end - w.tok_begin + Cfg::kBlockN - 1) / Cfg::kBlockN;
    auto t0_of = [&](int j) { return w.tok_begin + j * Cfg::kBlockN; };
    tile_ids(queue0[0], w.req, t0_of(0), tok_end);
    tile_ids(queue0[1], w.req, t0_of(2), tok_end);
    tile_ids(queue1[0], w.req, t0_of(1), tok_end);
    tile_ids(queue1[1], w.req, t0_of(3), tok_end);
    for (int j = 0; j < num_tiles; j += 2) {  // tiles j (stage 0) and j + 1 (stage 1)
      const uint32_t k0 = start_tile(std::integral_constant<int, 0>{}, w.req, t0_of(j), tok_end);
      const bool has_b = j + 1 < num_tiles;
      const uint32_t k1 = has_b ? start_tile(std::integral_constant<int, 1>{}, w.req, t0_of(j + 1), tok_end) : 0u;
      convert_tile(0, k0, w.req, t0_of(j), tok_end);
      if (has_b) convert_tile(1, k1, w.req, t0_of(j + 1), tok_end);
    }
  }
}

template <typename T, int KvFmt>
__global__ void __launch_bounds__(SeesawFp8::kThreads, 1)
    mla_decode_seesaw_fp8(const __grid_constant__ DecodeParams p, const __grid_constant__ CUtensorMap kv_map) {
  constexpr bool kSparse = KvFmt != kKvFp8E4M3, kV4 = KvFmt == kKvFp8DsV4;
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
  uint32_t* sTile = reinterpret_cast<uint32_t*>(sBad + SeesawPair::kBadFlags);  // [SeesawPair::kTileWords]

  const int part = blockIdx.x, row_tile = blockIdx.y, kvh = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rg = warp % Cfg::kRowGroups, wg = warp / Cfg::kRowGroups, tid_wg = tid % 128;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  // the cache's per-tensor scale, applied to the scores and the output (the sparse formats scale per group instead)
  const float out_scale = kSparse ? 1.f : *p.kv_scale;
  const float score_scale = p.softmax_scale * out_scale * kLog2e;

  if (tid == 0) {
    for (int i = 0; i < 2 * SeesawPair::kBlocks; ++i) mbar_init(bars + i, 128);
    for (int i = 0; i < 4; ++i) mbar_init(bars + 2 * SeesawPair::kBlocks + i, 128);  // empty: a consumer warpgroup
    // raw, rope: TMA copies (sparse: every converter thread's cp.async copies)
    for (int i = 4; i < 8; ++i) mbar_init(bars + 2 * SeesawPair::kBlocks + i, kSparse ? 128 : 1);
    fence_mbar_init();
  }
  __syncthreads();
  if (wg == 2) {
    regs_dec<SeesawFp8::kRegsConv>();
    if constexpr (kSparse)
      seesaw_fp8_sparse_converter<T, KvFmt>(p, sK, bars, sTile, part, kvh, tid - 256);
    else
      seesaw_fp8_converter<T>(p, &kv_map, sK, bars, sBad, part, kvh, tid - 256);
    return;
  }
  regs_inc<SeesawFp8::kRegsConsumer>();
  // the two consumer warpgroups' barrier over the CTA (the converter does not take part)
  auto consumers_sync = [] { named_barrier(SeesawFp8::kBarConsumers, 256); };
  // warpgroup `wg` is done reading part `which` (0 early, 1 late) of the stage of tile j. The early part's release
  // is the tile's owner's (warpgroup 0 for stage 0, 1 for stage 1), which has waited for the tile's full barriers:
  // first the converter's bad-id flag of the tile goes into the item's (a load by every thread, a store by one, so no
  // branch; placed at the head of each pair instead, it made ptxas duplicate a masked softmax)
  auto release = [&](int j, int which) {
    if (which == 0) {
      const int bad = kSparse ? sTile[4 * (j & 1) + 2] : sBad[1 + (j & 1)];
      if (bad != 0 && tid_wg == 0) sBad[0] = 1;
    }
    mbar_arrive(bars + 2 * SeesawPair::kBlocks + 2 * (j & 1) + which);
  };

  int row_local[2], row_i[2], row_head[2];
  bool row_ok[2];
  acc_rows(p, row_tile, kvh, rg, lane, row_local, row_i, row_head, row_ok);
  uint32_t loads_done[2] = {0, 0};  // completed loads per stage before the current item (mbarrier phases)

  const int item_begin = p.part_offsets[part], item_end = p.part_offsets[part + 1];
  for (int item = item_begin; item < item_end; ++item) {
    const WorkItem w = load_item(p, item);
    const int req = w.req, tok_begin = w.tok_begin, slot = w.slot;
    if (req < 0) continue;
    const int seqlen = p.cache_seqlens[req];
    // a sparse launch's length is its list's (topk_length), as the converter's
    const int tok_end = kSparse ? min(w.tok_end, max(seqlen, tok_begin)) : w.tok_end;
    int limit[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) limit[h] = p.causal ? seqlen - p.q_len + row_i[h] : seqlen - 1;
    // tokens below this are visible to every row of the tile (causal: the later ones are cleaned, fix_hidden)
    const int unmasked_end = min(tok_end, p.causal ? seqlen - p.q_len + 1 : seqlen);
    const int num_tiles = (tok_end - tok_begin + Cfg::kBlockN - 1) / Cfg::kBlockN;
    auto t0_of = [&](int j) { return tok_begin + j * Cfg::kBlockN; };
    auto stage_of = [&](int j) { return sK + (j & 1) * Cfg::kKElems; };
    auto parity_of = [&](int j) { return (loads_done[j & 1] + (uint32_t)(j >> 1)) & 1u; };
    uint64_t* bars0 = bars;
    uint64_t* bars1 = bars + SeesawPair::kBlocks;
    // the item's bad-id flag: its last readers passed the previous item's closing barrier; its writers are thread 0
    // (program order) and thread 128 (after the barrier below)
    if (tid == 0) sBad[0] = 0;
    // -- Q (cp.async), sM (the converter fills the K stages)
    load_q_tile_async<T, L, kV4 ? kDsV4HeadDim / 8 : Cfg::kChunksQK>(p, sQ, req, row_tile, kvh);
    cp_async_commit();
    if (tid < Cfg::kBlockM) sM[tid] = -INFINITY;
    cp_async_wait_all();
    fence_proxy_async_smem();
    consumers_sync();

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
    // S = Q K^T of tile j over column blocks [B0, B1), in ascending order or, with kDesc, descending (stage 0: the
    // converter's order), each block issued as soon as its TMA box has landed (a wgmma.fence after every wait:
    // ptxas would otherwise inject one on the wait loop's divergent path and serialise the wgmmas, C7520)
    auto issue_s_dir = [&](int j, auto b0, auto b1, bool first, auto desc_c) {
      constexpr int B0 = decltype(b0)::value, B1 = decltype(b1)::value;
      constexpr bool kDesc = decltype(desc_c)::value;
      const T* st = stage_of(j);
      uint64_t* sb = (j & 1) ? bars1 : bars0;
      const uint32_t par = parity_of(j);
      const uint64_t dq = desc(sQ), dk = desc(st);
#pragma unroll
      for (int it = B0; it < B1; ++it) {
        const int blk = kDesc ? B0 + B1 - 1 - it : it;
        mbar_wait(sb + blk, par);
        cute::warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t off = (uint64_t)(((blk * 64 * 64 + kk * 16) * (int)sizeof(T)) >> 4);
          gmma_call<typename SS::QK64>(dq + off, dk + off, acc_s, !(first && it == B0 && kk == 0),
                                       std::make_index_sequence<32>{});
        }
      }
    };
    auto issue_s = [&](int j, auto b0, auto b1, bool first) { issue_s_dir(j, b0, b1, first, std::false_type{}); };
    auto issue_s_desc = [&](int j, auto b0, auto b1, bool first) { issue_s_dir(j, b0, b1, first, std::true_type{}); };
    // column blocks [B0, B1) of tile j have landed (a V half read by the warpgroup that did not load them)
    auto wait_blocks = [&](int j, int b0, int b1) {
      uint64_t* sb = (j & 1) ? bars1 : bars0;
      for (int blk = b0; blk < b1; ++blk) mbar_wait(sb + blk, parity_of(j));
    };
    using I0 = std::integral_constant<int, 0>;
    using I4 = std::integral_constant<int, 4>;
    // the RoPE block, which the converter fills last (8; fp8_ds_v4, whose D_qk is 512: 7), and the end of S's blocks
    using IRope = std::integral_constant<int, kV4 ? 7 : 8>;
    using IEnd = std::integral_constant<int, kV4 ? 8 : 9>;

    // this warpgroup's steps of a pair over its registers (common/seesaw_pair.cuh)
    auto softmax = [&](int j, auto mask_c, float (&scale)[2], float (&psum)[2]) {
      if constexpr (kSparse)  // every tile: the stage's row mask (written before the tile's full barriers)
        seesaw_softmax<false, true>(acc_s, sM, row_local, lane, tok_begin, j, tok_end, limit, score_scale, scale, psum,
                                    *reinterpret_cast<const uint64_t*>(sTile + 4 * (j & 1)));
      else
        seesaw_softmax<decltype(mask_c)::value>(acc_s, sM, row_local, lane, tok_begin, j, tok_end, limit, score_scale,
                                                scale, psum);
    };
    auto scale_o = [&](const float (&s)[2]) { seesaw_scale_o(acc_o, s); };
    auto pack_p = [&](uint32_t (&rp)[16], const float (&f)[2]) { seesaw_pack_p<T>(acc_s, rp, f); };
    auto store_p = [&](T* sP, const uint32_t (&rp)[16]) { seesaw_store_p<T>(sP, rp, row_local, lane); };
    auto pv_rs = [&](const uint32_t (&rp)[16], const T* st) { seesaw_pv_rs<T>(acc_o, rp, st, wg); };
    auto pv_ss = [&](const T* sP, const T* st) { seesaw_pv_ss<T>(acc_o, sP, st, wg); };
    // (no V rows to zero past a partial tile's end: the converter stores them as zeros)
    // causal: the keys of tile j some row does not see out of this warpgroup's V columns (common/seesaw_pair.cuh); the
    // tile's S is done (its own, or the other warpgroup's before the P barrier this follows). On the converted tile
    // (an e4m3 NaN is a NaN of T there): not in the converter, whose tile S must still read with its NaN (the rows that
    // see the key get NaN from its score); the converter rewrites the columns only after this warpgroup's release of
    // them (after its P V). Only in the tail pairs (ptxas, the consumers at 232 registers: spills 20 / 16 bytes without
    // any cleaning, 56 / 92 with it in every pair, 48 / 76 in the tail pairs only, 32 / 36 with the cleaning loop not
    // unrolled; the reloads are in the item's epilogue)
    auto fix_hidden = [&](int j, auto mask_c) {  // (sparse launches are not causal)
      if constexpr (!kSparse)
        seesaw_fix_hidden<T, decltype(mask_c)::value>(stage_of(j), t0_of(j), tok_end, unmasked_end, p.causal, tid_wg,
                                                      wg);
    };
    const float kOne[2] = {1.f, 1.f};

    if (wg == 0) {
      // ================= warpgroup 0: tiles 0, 2, 4, ...; O[:, 0:256)
      if (num_tiles > 0) {
        fence_regs<32>(acc_s);
        // the converter's order for stage 0: 7..0, then 8 (fp8_ds_v4: 6..0, then 7)
        issue_s_desc(0, I0{}, IRope{}, true);
        issue_s(0, IRope{}, IEnd{}, false);
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
        fix_hidden(a, std::bool_constant<!kNextA>{});
        // O_L += P_a V_aL
        fence_regs<128>(acc_o);
        cute::warpgroup_arrive();
        pv_rs(rp, stage_of(a));
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<0>();
        fence_regs<128>(acc_o);
        release(a, 0);  // stage 0, blocks 0..3 (and 8, dead since S_a)
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
          fix_hidden(b, std::bool_constant<!kNextB>{});
          // O_L += P_b V_bL
          cute::warpgroup_arrive();
          pv_ss(sP1, stage_of(b));
          cute::warpgroup_commit_batch();
        }
        if constexpr (kNextA) {
          // S_{a+2} in the converter's order: blocks 7..4, then 3..0 and 8 (fp8_ds_v4: 6..4, 3..0, 7)
          fence_regs<32>(acc_s);
          issue_s_desc(a + 2, I4{}, IRope{}, true);
          cute::warpgroup_commit_batch();
          cute::warpgroup_wait<1>();  // sP1 V_bL done (tile b exists: a + 2 does)
          release(b, 1);              // stage 1, blocks 0..3 and 8 (sP1)
          issue_s_desc(a + 2, I0{}, I4{}, false);
          issue_s(a + 2, IRope{}, IEnd{}, false);
          cute::warpgroup_commit_batch();
        }
        cute::warpgroup_wait<0>();
        fence_regs<128>(acc_o);
        fence_regs<32>(acc_s);
        if constexpr (kHasB && !kNextA) release(b, 1);
      };
      seesaw_pairs(num_tiles, pair);
    } else {
      // ================= warpgroup 1: tiles 1, 3, 5, ...; O[:, 256:512)
      if (num_tiles > 1) {
        fence_regs<32>(acc_s);
        issue_s(1, I0{}, IEnd{}, true);  // the converter's order for stage 1: 0..7, then 8
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
          fix_hidden(b, std::bool_constant<!kNextB>{});
          // O_R += P_b V_bR
          cute::warpgroup_arrive();
          pv_rs(rp, stage_of(b));
          cute::warpgroup_commit_batch();
        }
        named_barrier(SeesawPair::kBarP0, 256);  // sP0 in place
        wait_blocks(a, 4, 8);
        fix_hidden(a, std::bool_constant<!kNextA>{});
        // O_R += P_a V_aR
        cute::warpgroup_arrive();
        pv_ss(sP0, stage_of(a));
        cute::warpgroup_commit_batch();
        if constexpr (kHasB) {
          cute::warpgroup_wait<1>();  // P_b V_bR done
          release(b, 0);              // stage 1, blocks 4..7
        }
        cute::warpgroup_wait<0>();
        fence_regs<128>(acc_o);
        release(a, 1);  // stage 0, blocks 4..8
        if constexpr (kNextB) {
          fence_regs<32>(acc_s);
          issue_s(b + 2, I0{}, IEnd{}, true);  // the converter's order for stage 1: 0..7, then 8
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
    consumers_sync();
    const bool poisoned = sBad[0] != 0;  // the item met a bad block id
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float total = poison_sum(sSum[row_local[h]] + sSum[Cfg::kBlockM + row_local[h]], poisoned);
      const float row_max = sM[row_local[h]];
      const bool has_keys = total != 0.f;
      float inv = has_keys ? out_scale / total : 0.f;
      const float lse_val = has_keys ? (row_max + log2f(total)) * kLn2 : (slot < 0 ? INFINITY : -INFINITY);
      if (!row_ok[h]) continue;
      // a whole request's row with a sink s: times exp(lse) / (exp(lse) + exp(s)) (as wgmma's epilogue; a split
      // request's rows take it in the combine)
      if (kSparse && slot < 0 && p.attn_sink != nullptr && has_keys)
        inv = out_scale / (total + exp2f(p.attn_sink[row_head[h]] * kLog2e - row_max));
      store_acc_row<T>(p, acc_o, h, wg * 256, inv, lse_val, req, slot, row_i[h], row_head[h],
                       wg == 0 && lane % 4 == 0);
    }
    // sQ, sK, sM, sSum are reused by the next item
    consumers_sync();
  }
}

}  // namespace mla_sm90
