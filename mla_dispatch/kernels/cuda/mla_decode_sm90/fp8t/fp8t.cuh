// [notes]: docs/notes/cuda_sm90.md, the development history these comments cite
// SM90 MLA decode, the body shared by mainloops fp8t_convert (v7, Mainloop::kFp8tConvert; fp8t_convert.cuh) and
// fp8t_regs (v8, kFp8tRegs; fp8t_regs.cuh): fp8_e4m3 caches with at most 32 query
// rows per KV head (the memory-bound decode of 16-32 heads), in three warpgroups.
//
// v6 (etap/etap.cuh) puts KV tokens on the 64-row side of wgmma (FlashMLA-ETAP's orientation, Dege et al.
// 2025), but with an fp8 cache each of its warpgroups runs load wait -> dequantise -> S^T -> softmax -> P V in series
// on its one stage: 1.25x the bf16 throughput against the 1.6-1.7x the bytes allow ([notes], fifth and eleventh
// sessions). This kernel is the design the Triton backend measured at 1.59x (kernels/triton/gluon_fp8.py): the same
// orientation, the dequantisation in a warpgroup of its own (FlashMLA's fp8 kernels divide the work that way), and
// the two consumers split by role instead of by tile, so each tile is read by the tensor cores once per GEMM:
//
//   warpgroup 0, the converter: loads a tile's fp8 rows into registers (16-byte loads, each token row from its own
//     page, so any page size; a tile ahead, the loop unrolled by two so that no register set is copied, and the tile
//     three ahead already asked of L2 with cp.async.bulk.prefetch.L2), converts them to fp16 (cvt.rn.f16x2.e4m3x2:
//     one instruction per pair, where bf16 takes four; [notes], fifth session) and stores them into one of two
//     shared-memory stages;
//   warpgroup 1, the scorer: S^T = K Q^T (m64nNk16 x 36), the softmax over the tile's tokens with FlashAttention-4's
//     conditional rescaling (the reference maximum of a query row moves only when a score passes it by more than
//     2^8, so most tiles need no column maximum), P^T and the rescale factors into shared memory, the LSE;
//   warpgroup 2, the accumulator: O^T += V^T P^T (m64nNk16 x 32), then out or the partial rows.
//
// fp16 operands: e4m3 values are exact in fp16. A bf16 query is converted to fp16 per row times the power of two
// that puts its largest magnitude in [2^14, 2^15) (fp16 keeps all of bf16's 8 significant bits there), and the
// scores of that row are multiplied by the inverse; an fp16 query takes the same path. The per-tensor kv_scale
// multiplies the scores and the output, not the tile.
//
// Shared memory: two fp16 stages of 72 KB (v6's layout: nine 64-column blocks, 128-byte swizzle, K-major for S^T and
// MN-major for V^T), the query tile (kN x 576 fp16, 36 KB at kN = 32), two P^T tiles, half an output row block in fp32
// for the coalesced epilogue (33 KB), and 10 mbarriers:
//   full[2]       converter -> consumers: the stage holds tile it (one arrive per converter warp)
//   empty[2]      consumers -> converter: both are done with the stage (one arrive per consumer warp)
//   p_ready[2]    scorer -> accumulator: P^T and the rescale factors of the stage's tile (one arrive per warp, and
//                 one more from each of lanes 1..3 of warp 0, which write rescale factors too)
//   sums_full[2]  scorer -> accumulator: the item's row sums (by item parity)
//   sums_empty[2] accumulator -> scorer: the row sums of that parity are read
// The converter's release of a stage (its proxy fence) compiles to MEMBAR.ALL.CTA, which waits for its loads of the
// next tile in flight. Named barriers instead (bar.arrive, the proxy fence on the consumers' side) take the MEMBAR out
// of the converter but measured 5% slower at 32 rows and no faster at 16 ([notes], twenty-fifth session).
// Registers by setmaxnreg: the converter holds two tiles (2 x 72 registers), the accumulator O^T (kN x 4), the scorer
// little; all three return to the launch's 168 before the fused combine.
// Bad block ids (docs/design.md §1): the thread that turns a page into an address checks it (loads.cuh, page_ok) and
// takes block 0 instead. A stage carries a flag word to the scorer with its full barrier (sBad: v7, each converter
// warp's byte, whether any of its threads read a bad id for the item so far; v8, the producer's, whether the tile's page
// was one); the scorer ORs the words of an item's tiles and makes its row sums NaN, so the LSE, and through sSum the
// accumulator's out rows, are NaN (epilogue.cuh, poison_sum).
//
// H100, b=64 L=8K, graph replay ([notes], "Twenty-fifth session"): 16 heads 148.3 us (1.55x bf16's 230.7; v6 186.1),
// 32 heads 177.4 us (1.35x; v2 243.8). What moved it from 162.8 / 184.1 was the distance of the L2 prefetch
// (Fp8t::kPrefetchAhead). Ablation builds ([notes], twenty-sixth session) put the rest of the gap in the converter's
// round trip: its register loads and its fp16 stores.
//
// Version 8 (kRS; mla_decode_fp8t_regs) drops that round trip. One thread issues each tile as five tensor copies of
// 128-column boxes (128-byte swizzle, the page's raw fp8 bytes; whole-tile pages only, the plan picks v7 on others)
// into three stages, and the two consumers convert their operands in registers and feed wgmma's register-A form: the
// scorer K (ldmatrix, fp8rs_gemm_s), the accumulator V^T (transposed ldmatrix and a byte permute, fp8rs_load_v).
// The query tile holds its columns in the order the scorer's fragments take the stage's bytes (fp8rs_q_col), O^T's rows are the
// channels in fp8rs_load_v's order (fp8rs_channel), and tokens past an item's end are zeroed in the accumulator's
// fragments (the scorer masks their scores). Every tile is converted twice (K and V^T), against once in v7, but with
// no shared-memory stores. H100, b=64 L=8K, graph replay ([notes], twenty-seventh session): 16 heads 140.2 us
// (1.64x bf16), 32 heads 168.9 (1.41x). Row-wise bulk copies (64 per tile) made it slower than v7 (182 / 200 us).
// With the query rows asked of L2 an item ahead by the producer and, at 32 rows, the output rows written in
// overlapping passes (twenty-eighth session): 135.8-136.2 us (1.69-1.70x) and 159.6 (1.50x).
#pragma once
#include <cmath>
#include <cstdint>
#include <cuda.h>
#include <type_traits>

#include "common/combine.cuh"
#include "common/epilogue.cuh"
#include "common/fp8.cuh"
#include "common/loads.cuh"
#include "common/ptx.cuh"
#include "common/traits.cuh"
#include "common/gmma.cuh"

namespace mla_sm90 {

struct Fp8t {
  static constexpr int kThreads = 384;
  static constexpr int kMaxRows = kFp8tMaxRows;  // config.h
  static constexpr int kOStride = Cfg::kHeadDimV / 2 + 4;  // fp32 row stride of half an output row (spreads banks)
  // v8: a stage holds the tile's raw bytes as five [64 tokens][128 bytes] boxes with the 128-byte swizzle (the last
  // box's upper half is the tensor map's zero fill past column 575)
  static constexpr int kBoxes = (Cfg::kHeadDimQK + 127) / 128;
  static constexpr int kBoxBytes = Cfg::kBlockN * 128;
  // named barriers (0 is __syncthreads): one per consumer warpgroup, one for the CTA after the first setmaxnreg
  static constexpr int kBarScorer = 1, kBarAcc = 2, kBarRegs = 3;
  // registers per thread by warpgroup (setmaxnreg): converter, scorer, accumulator. setmaxnreg.inc takes only what
  // other warps of the CTA released with setmaxnreg.dec (not the SM's unallocated registers: a first version with
  // 200 + 112 + 200 waited forever), so the three sum to the launch's 3 x 168. And every warpgroup holds its new
  // count before any returns to 168 (kBarRegs after the first setmaxnreg): a CTA without items let its scorer take
  // back its 56 registers before the converter had its 32, which then waited forever (H100, intermittent)
  // how many tiles ahead of the one being stored the converter asks L2 for a tile (the register loads run one
  // ahead). H100, b=64 L=8K h16 graph us by distance: 2: 164.3 (L2 hit rate 35%, the converter 38% in
  // long-scoreboard stalls), 3: 148.3, 4: 148.9, 5: 153.5, 6: 158.8, 8: 176.7 (farther ahead, the prefetched lines
  // are evicted before use: 132 SMs x 8 tiles x 36 KB is 38 MB of L2's 50). h32 did not move (186.7-187.3 from 2 to 4).
  // Measured with the stages' full signal on named barriers (reverted after: [notes], twenty-fifth session)
  static constexpr int kPrefetchAhead = 3;
  static constexpr int kRegsConv = 200, kRegsScorer = 112, kRegsAcc = 192, kRegsLaunch = 168;
  // v8: the producer warpgroup (one issuing thread) gives its registers to the consumers, which hold A fragments
  static constexpr int kRegsProd = 40, kRegsScorerRS = 224, kRegsAccRS = 240;
  static_assert(kRegsConv + kRegsScorer + kRegsAcc == 3 * kRegsLaunch, "setmaxnreg moves registers, adds none");
  // sparse fp8_ds_mla: the converter's two tiles of rows hold RoPE values and scales besides (2 x 89 registers; at
  // 200 ptxas spilled), which the accumulator gives (at 168 none spilled at 16 or 32 rows)
  static constexpr int kRegsConvDs = 224, kRegsAccDs = 168;
  static_assert(kRegsConvDs + kRegsScorer + kRegsAccDs == 3 * kRegsLaunch, "setmaxnreg moves registers, adds none");
  static_assert(kRegsProd + kRegsScorerRS + kRegsAccRS == 3 * kRegsLaunch, "setmaxnreg moves registers, adds none");
};

// Shared memory of v7 (kRS = false: two fp16 stages that the converter fills) and v8 (kRS = true: three raw fp8 stages
// of five boxes that tensor copies fill), byte offsets from the 1024-aligned base (every operand tile 1024-aligned).
// v8 measured no faster with an L2 prefetch of the tile a ring ahead (much slower: 187 / 189 us at h16 / h32 against
// 140 / 169) or with four stages at 16 rows (Q, P^T and the epilogue buffer sized by the rows used: 140.0 against
// 138.5 us; [notes], twenty-seventh session).
template <bool kRS>
struct Fp8tSmem {
  static constexpr int kStages = kRS ? 3 : 2;
  static constexpr int kStageBytes = kRS ? Fp8t::kBoxes * Fp8t::kBoxBytes : Cfg::kBlockN * Cfg::kHeadDimQK * 2;
  static constexpr int kQBytes = Fp8t::kMaxRows * Cfg::kHeadDimQK * 2;
  static constexpr int kPBytes = Fp8t::kMaxRows * Cfg::kBlockN * 2;
  static constexpr int kOffQ = kStages * kStageBytes;
  static constexpr int kOffP = kOffQ + kQBytes;
  static constexpr int kOffO = kOffP + kStages * kPBytes;
  // floats: column scale, alpha [stages], maxima / sums exchange, sums [2]
  static constexpr int kOffF = kOffO + Fp8t::kMaxRows * Fp8t::kOStride * 4;
  static constexpr int kFloats = Fp8t::kMaxRows * (1 + kStages + 4 + 4 + 2 + 1);
  static constexpr int kOffFlag = kOffF + kFloats * 4;  // int [stages]: a tile's rescale flag
  static constexpr int kOffBad = kOffFlag + 16;          // int [stages]: a tile's bad-block-id flag (see above)
  static constexpr int kOffOk = kOffBad + 16;            // uint64 [stages]: a sparse tile's rows that have an id
  static constexpr int kOffBar = kOffOk + 8 * kStages;
  static constexpr int kBars = 3 * kStages + 4;  // full, empty, p_ready by stage; sums_full, sums_empty by item parity
  static constexpr int kSmemBytes = kOffBar + kBars * 8 + 1024;  // + alignment slack
  static_assert(kStageBytes % 1024 == 0 && kOffQ % 1024 == 0 && kOffP % 1024 == 0, "operand tiles 1024-aligned");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the SM90 per-block limit");
  static_assert(kOffBar % 8 == 0, "mbarriers are 8-byte aligned");
  static_assert(kStages <= 4, "the rescale and bad-id flags hold four stages");
  static_assert(kFusedScratchBytes<Fp8t::kThreads> <= kStages * kStageBytes, "the combine's list fits the stages");
};

// A tile's fp8 bytes held by one converter thread: token rows r0 and r0 + 32 (r0 = 8 warp + lane / 4), of each of the
// nine 64-byte column blocks the 16 bytes at 16 (lane % 4). A warp's loads read 64-byte pieces of 8 rows; its stores
// (two 16-byte fp16 chunks per piece) put 8 rows of one column block in distinct bank groups (chunks 2 (lane % 4) and
// +1, XOR-swizzled by the row).
struct Fp8tRows {
  uint4 v[2][9];
};

// The tile at t0 into registers; `page` holds the pages of the thread's two rows (0 past t_end: such a row reads
// page 0's first row of this head, in bounds, and is zeroed before the store, so nothing past a request is used).
__device__ __forceinline__ void fp8t_load(const DecodeParams& p, const PageGeometry& pg, Fp8tRows& x,
                                          const int (&page)[2], int t0, int t_end, int kvh, int r0, int q4) {
  const uint8_t* kv = reinterpret_cast<const uint8_t*>(p.kv);
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int t = t0 + r0 + 32 * pass;
    const uint8_t* src =
        kv + (t < t_end ? paged_row_offset(p, pg, page[pass], t, kvh) : (int64_t)kvh * p.kv_stride_head) + 16 * q4;
#pragma unroll
    for (int b = 0; b < 9; ++b) x.v[pass][b] = ld_stream_16(src + 64 * b);
  }
}

// The tile of fp8_load at t0 into `stage` as fp16 (Gmma128Tile64), rows at or past t_end as zeros (zeroed in x, in
// the item's last tile only: a select per word in every tile was 12% of the converter's instructions).
__device__ __forceinline__ void fp8t_store(__half* stage, Fp8tRows& x, int t0, int t_end, int r0, int q4) {
  if (t0 + Cfg::kBlockN > t_end) {
#pragma unroll
    for (int pass = 0; pass < 2; ++pass)
      if (t0 + r0 + 32 * pass >= t_end) {
#pragma unroll
        for (int b = 0; b < 9; ++b) x.v[pass][b] = make_uint4(0, 0, 0, 0);
      }
  }
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int row = r0 + 32 * pass;
    __half* base = stage + row * 64;
    const int c0 = ((2 * q4) ^ (row & 7)) << 3, c1 = ((2 * q4 + 1) ^ (row & 7)) << 3;
#pragma unroll
    for (int b = 0; b < 9; ++b) {
      const uint4 w = x.v[pass][b];
      const uint2 a = e4m3x4_to_f16x4(w.x), c = e4m3x4_to_f16x4(w.y), d = e4m3x4_to_f16x4(w.z),
                  e = e4m3x4_to_f16x4(w.w);
      *reinterpret_cast<uint4*>(base + b * 64 * 64 + c0) = make_uint4(a.x, a.y, c.x, c.y);
      *reinterpret_cast<uint4*>(base + b * 64 * 64 + c1) = make_uint4(d.x, d.y, e.x, e.y);
    }
  }
}

// ---- v7's sparse launches (kSparse; params.h, DecodeParams::sparse): the flattened view of a top-k decode, whose
// table holds one cache token id per token (-1: a skipped slot), over fp8_e4m3, fp8_ds_mla or fp8_ds_v4 caches. The
// converter gathers each tile row by row (v7 loads rows from their own pages already), zero-fills the rows without
// an id (-1, or past the item's end: nothing of them is read, so NaN poison in unused slots cannot reach P V) and
// gives the scorer a bit per row with the stage (sOk), which masks the others' scores. The design FlashMLA's sparse
// fp8 decode uses for its heads (a warpgroup that gathers and converts beside the ones that compute:
// csrc/sm90/decode/sparse_fp8), here at the 16 or 32 query rows of a tokens-on-M tile (issue 57).
//
// Operands are fp16 for every format, q scaled per row as for fp8_e4m3. The scaled formats' values are the exact
// fp16 of the fp8 value times the fp16 of its group's scale, one fp16 multiply per pair (HMUL2): within 2^-10 of the
// product (two fp16 roundings; bf16, as etap and wgmma store it, 2^-9), exact for fp8_ds_v4's power-of-two scales. Its
// range is fp16's: products below 2^-14 lose relative precision (absolute error <= 2^-25), and a group scale below
// 2^-14 (fp8_ds_mla: a group whose largest magnitude is below ~0.027) is rounded in fp16's subnormal steps of 2^-24.
// The converter is one warp per scheduler: bf16 operands through fp32 products (six instructions per pair) took
// 287.5 us at H200, b=128 s_q=2 h_q=16, fp8_ds_mla, these 235 (benchmarks/RESULTS.md, 2026-11-29, "sparse decode of
// <= 32 heads", where ncu puts most of what is left in the wait for the gathered rows: a gather of the same rows alone
// takes 107 us).

// A tile's rows held by one converter thread of a sparse launch (rows r0 and r0 + 32, the 16 bytes at 16 (lane % 4)
// of each 64-byte fp8 column block, as Fp8tRows): fp8_e4m3 nine fp8 blocks; fp8_ds_mla eight NoPE blocks, the
// thread's 16 RoPE values (bf16, two 16-byte pieces) and the row's four fp32 scales; fp8_ds_v4 seven NoPE blocks, its
// RoPE values and the seven ue8m0 scale bytes (scale .x, .y). ok: bit `pass` set where that row has an id.
template <int KvFmt>
struct Fp8tSparseRows {
  static constexpr int kFp8Blocks = KvFmt == kKvFp8E4M3 ? 9 : KvFmt == kKvFp8DsMla ? 8 : 7;
  uint4 v[2][kFp8Blocks];
  uint4 rope[2][2];
  uint4 scale[2];
  uint32_t ok;
};

// The thread's rows of a sparse tile into registers; ids: of its two rows (-1: none, whose loads are skipped); a bad
// id reads token 0 in its place (checked_page: max_id keeps it for the item's NaN).
template <int KvFmt>
__device__ __forceinline__ void fp8t_load_sparse(const DecodeParams& p, const PageGeometry& pg,
                                                 Fp8tSparseRows<KvFmt>& x, const int (&ids)[2], int kvh, int q4,
                                                 uint32_t& max_id) {
  constexpr bool kV4 = KvFmt == kKvFp8DsV4;
  x.ok = 0;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    if (ids[pass] == -1) continue;
    x.ok |= 1u << pass;
    const int id = checked_page(p, ids[pass], max_id);
    const uint8_t* src = sparse_row(p, pg, id, kvh, kV4);
#pragma unroll
    for (int b = 0; b < Fp8tSparseRows<KvFmt>::kFp8Blocks; ++b) x.v[pass][b] = ld_stream_16(src + 64 * b + 16 * q4);
    if constexpr (KvFmt != kKvFp8E4M3) {
      const uint8_t* rope = src + (kV4 ? 448 : 528) + 32 * q4;  // fp8_ds_mla: behind the NoPE bytes and the scales
      x.rope[pass][0] = ld_stream_16(rope);
      x.rope[pass][1] = ld_stream_16(rope + 16);
      if constexpr (kV4) {
        const uint2 s = __ldg(reinterpret_cast<const uint2*>(ds_v4_scales(p, pg, id)));
        x.scale[pass] = make_uint4(s.x, s.y, 0u, 0u);
      } else {
        x.scale[pass] = __ldg(reinterpret_cast<const uint4*>(src + 512));
      }
    }
  }
}

// The rows of fp8t_load_sparse into `stage` (Gmma128Tile64) as fp16: fp8_e4m3 unscaled (its per-tensor scale goes to
// the scores and the output), the scaled formats times their group's scale in fp16 (above); rows without an id as
// zeros. fp8_ds_v4 (D_qk 512): column block 7 holds the RoPE values and 8 zeros (q's are too).
template <int KvFmt>
__device__ __forceinline__ void fp8t_store_sparse(__half* stage, const Fp8tSparseRows<KvFmt>& x, int r0, int q4) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int row = r0 + 32 * pass;
    __half* base = stage + row * 64;
    const int c0 = ((2 * q4) ^ (row & 7)) << 3, c1 = ((2 * q4 + 1) ^ (row & 7)) << 3;
    // the thread's 16 values of column block b: values 0-7 at chunk 2 q4, 8-15 at 2 q4 + 1 (swizzled by the row)
    auto put = [&](int b, uint4 lo, uint4 hi) {
      *reinterpret_cast<uint4*>(base + b * 64 * 64 + c0) = lo;
      *reinterpret_cast<uint4*>(base + b * 64 * 64 + c1) = hi;
    };
    if (!((x.ok >> pass) & 1u)) {
#pragma unroll
      for (int b = 0; b < 9; ++b) put(b, zero, zero);
      continue;
    }
    // 16 fp8 values (w) as fp16 times s (both halves): two conversions and two multiplies per 4 values
    auto conv16 = [&](int b, const uint4 w, __half2 s) {
      uint32_t o[8];
      const uint32_t in[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint2 h = e4m3x4_to_f16x4(in[i]);
        if constexpr (KvFmt == kKvFp8E4M3) {
          o[2 * i] = h.x, o[2 * i + 1] = h.y;
        } else {
          o[2 * i] = half2_bits(__hmul2(*reinterpret_cast<const __half2*>(&h.x), s));
          o[2 * i + 1] = half2_bits(__hmul2(*reinterpret_cast<const __half2*>(&h.y), s));
        }
      }
      put(b, make_uint4(o[0], o[1], o[2], o[3]), make_uint4(o[4], o[5], o[6], o[7]));
    };
    if constexpr (KvFmt == kKvFp8E4M3) {
#pragma unroll
      for (int b = 0; b < 9; ++b) conv16(b, x.v[pass][b], __half2());
    } else {
      const uint4 sc = x.scale[pass];
#pragma unroll
      for (int b = 0; b < Fp8tSparseRows<KvFmt>::kFp8Blocks; ++b) {
        float s;
        if constexpr (KvFmt == kKvFp8DsV4) {  // ue8m0: 2^(byte - 127), the fp32 of that biased exponent; 255 is NaN
          const uint32_t e = ((b < 4 ? sc.x : sc.y) >> (8 * (b % 4))) & 0xffu;
          s = e == 0xffu ? __uint_as_float(0x7fc00000u) : __uint_as_float(e << 23);
        } else {  // fp8_ds_mla: column block b lies in scale group b / 2
          s = __uint_as_float(b < 2 ? sc.x : b < 4 ? sc.y : b < 6 ? sc.z : sc.w);
        }
        conv16(b, x.v[pass][b], __float2half2_rn(s));
      }
      constexpr int kRope = Fp8tSparseRows<KvFmt>::kFp8Blocks;  // the block after the NoPE ones
      put(kRope, rope_as<__half>(x.rope[pass][0]), rope_as<__half>(x.rope[pass][1]));
      if constexpr (kRope == 7) put(8, zero, zero);
    }
  }
}

// One bit per lane of a warp's ballot at lanes 0, 4, .., 28 (the q4 = 0 lane of each of its 8 rows), as a byte.
__device__ __forceinline__ uint32_t fp8t_row_byte(uint32_t ballot) {
  uint32_t m = ballot & 0x11111111u;         // bit 4i: row i
  m = (m | (m >> 3)) & 0x03030303u;          // rows 2j, 2j + 1 at bits 8j, 8j + 1
  m = (m | (m >> 6)) & 0x000f000fu;          // rows 4j .. 4j + 3 at bits 16j .. 16j + 3
  return (m | (m >> 12)) & 0xffu;
}

// Offset of (row, col) in the kN-row query tile: nine [kN][64] blocks, 128-byte swizzle (K-major B of S^T).
template <int kN>
__device__ __forceinline__ int q_tile_offset(int row, int col) {
  return (col >> 6) * (kN * 64) + row * 64 + ((((col & 63) >> 3) ^ (row & 7)) << 3) + (col & 7);
}

// ---- v8: the tensor cores read fp16 A fragments that the consumers convert in registers from the raw fp8 stage
// (wgmma's register-A form; FlashAttention-3's fp8 path also feeds V through registers, Shah et al. 2024), so no
// warpgroup writes a converted tile back to shared memory: v7's ablation builds put its time in that round trip
// ([notes], twenty-sixth session).

// Byte offset of the 16 bytes at column `col` (a multiple of 16) of token row `row` in a v8 stage: box col / 128, its
// 16-byte chunks XOR-swizzled by the row (the 128-byte swizzle of the tensor map; the 8 rows of an ldmatrix, one
// chunk column, fall in 8 different bank groups).
__device__ __forceinline__ int fp8rs_offset(int row, int col) {
  return (col >> 7) * Fp8t::kBoxBytes + row * 128 + ((((col & 127) >> 4) ^ (row & 7)) << 4);
}

// S^T = K Q^T with K from a raw stage: per 64-column block two ldmatrix (x4) per thread, converted to the fp16 A
// fragments of four k-steps (two blocks' fragments in flight). A thread's 4-byte piece of a row holds stage columns
// 4t .. 4t + 3 of a 16-column step (t = lane % 4), which it uses as the fragment's k = 2t, 2t + 1 and 2t + 8, 2t + 9;
// so within each step the query tile holds its columns in the order of fp8rs_q_col. Returns with the wgmmas done.
template <typename Op, int kQBlock, int kAcc>
__device__ __forceinline__ void fp8rs_gemm_s(const uint8_t* stage, uint64_t dq, float (&acc)[kAcc], int warp,
                                             int lane) {
  // matrix i = lane / 8 of an x4: token rows 8 (i % 2) .. + 8 of the warp's 16, the 16 bytes at 16 (i / 2)
  const int row = 16 * warp + 8 * ((lane / 8) % 2) + lane % 8, col = 16 * (lane / 16);
  uint32_t a[2][16];
  fence_regs<kAcc>(acc);
#pragma unroll
  for (int blk = 0; blk < 9; ++blk) {
    uint32_t(&f)[16] = a[blk & 1];
    if (blk >= 2) cute::warpgroup_wait<1>();  // the wgmmas of block blk - 2 have read these registers
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t r[4];
      ldmatrix_x4(r, stage + fp8rs_offset(row, 64 * blk + 32 * h + col));
#pragma unroll
      for (int s = 0; s < 2; ++s) {  // r[2s] / r[2s + 1]: rows g / g + 8 of k-step 4 blk + 2 h + s
        const uint2 lo = e4m3x4_to_f16x4(r[2 * s]), hi = e4m3x4_to_f16x4(r[2 * s + 1]);
        uint32_t* q = f + 4 * (2 * h + s);
        q[0] = lo.x, q[1] = hi.x, q[2] = lo.y, q[3] = hi.y;
      }
    }
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t off_q = (uint64_t)(((blk * kQBlock + kk * 16) * 2) >> 4);
      gmma_rs_call<Op>(f + 4 * kk, dq + off_q, acc, blk + kk > 0, std::make_index_sequence<kAcc>{});
    }
    cute::warpgroup_commit_batch();
  }
  cute::warpgroup_wait<0>();
  fence_regs<kAcc>(acc);
}

// Where fp8rs_gemm_s wants stage column c (of the 16-column step c / 16) in the query tile: columns 4t, 4t + 1 of a
// step at 2t, 2t + 1 and columns 4t + 2, 4t + 3 at 2t + 8, 2t + 9.
__device__ __forceinline__ int fp8rs_q_col(int c) {
  const int o = c & 15, t = o >> 2, e = o & 3;
  return (c & ~15) + 2 * t + (e & 1) + ((e >> 1) << 3);
}

// The fp16 A fragments of V^T for O^T's 64-channel block mb (4 k-steps of 16 tokens) from a raw stage: two ldmatrix
// (x4, transposed) per thread, bytes regrouped by channel (prmt), converted. Warp w's fragment rows g and g + 8 are the
// stage's channels 64 mb + 16 w + 2g and + 1 (the epilogue maps them back: fp8rs_channel). kMask: tokens at or past
// `nv` (a partial tile; the stage holds stale or uninitialised bytes there) are zeros. kHide (with kMask; causal
// launches, a tile holding keys some query row does not see): the NaN bytes of tokens at or past `nh` are zeros too.
// The scorer gives such a row p = 0 for the key, but 0 * NaN in P V is NaN; the rows that see the key get NaN from its
// score already (the scorer converts its own K from the raw stage, V being K's first 512 channels), so only the rows
// that must not see it change: the rule of the Triton kernel's _hide_from_rows_that_do_not_see
// (kernels/triton/decode.py). On the raw bytes, in registers: the stage itself stays as loaded.
template <bool kMask, bool kHide = false>
__device__ __forceinline__ void fp8rs_load_v(uint32_t (&f)[16], const uint8_t* stage, int mb, int nv, int warp,
                                             int lane, int nh = Cfg::kBlockN) {
  static_assert(kMask || !kHide, "kHide is a mask of the masked form");
  // matrix i = lane / 8 of an x4: tokens 16 (i / 2) + 8 (i % 2) .. + 8 of the two k-steps, the warp's 16 channels
  const int row = 16 * (lane / 16) + 8 * ((lane / 8) % 2) + lane % 8;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t r[4];
    ldmatrix_x4_trans(r, stage + fp8rs_offset(row + 32 * h, 64 * mb + 16 * warp));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // r[i]: tokens 2t, 2t + 1 (+ 8 for odd i) of k-step 2h + i / 2, each with channels 2g, 2g + 1
      if (kMask) {
        const int tok = 32 * h + 16 * (i / 2) + 8 * (i % 2) + 2 * (lane % 4);
        uint32_t keep = tok >= nv ? 0u : (tok + 1 >= nv ? 0xFFFFu : ~0u);
        if (kHide) {
          // e4m3 NaN is S.1111.111 (e4m3 has no inf): + 1 on the low 7 bits carries into bit 7 of exactly those
          // bytes (never across bytes), and (bit 7) * 0xff spreads it over the byte
          const uint32_t nan = ((((r[i] & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) >> 7) * 0xffu;
          const uint32_t hidden = tok >= nh ? ~0u : (tok + 1 >= nh ? 0xFFFF0000u : 0u);
          keep &= ~(nan & hidden);
        }
        r[i] &= keep;
      }
      const uint2 v = e4m3x4_to_f16x4(__byte_perm(r[i], 0, 0x3120));  // (channel 2g: both tokens, 2g + 1: both)
      uint32_t* q = f + 4 * (2 * h + i / 2) + 2 * (i % 2);
      q[0] = v.x, q[1] = v.y;
    }
  }
}

// The stage channel of O^T's accumulator row `row` (0..63) of a 64-channel block (fp8rs_load_v's order).
__device__ __forceinline__ int fp8rs_channel(int row) { return (row & ~15) + 2 * (row & 7) + ((row >> 3) & 1); }

// Half of an item's output (channels 256 half .. + 256 of its rows) from sO ([kN][kOStride] fp32) into out (slot < 0)
// or its partial rows, as store_row_quad writes them, 4 channels per thread and 128 threads: pass k takes row
// 2 k + tid_wg / 64 (a warp shares it). The passes hold no branch around their loads and shuffles (a row past
// rows_per_kv_head reads the last row; only its stores are skipped), so that unrolled they overlap: as a loop of
// store_row_quad each pass waited for the last (loads, five shuffles, the scale): 4.6 / 9.2 us per item at 16 / 32
// rows (H100, b=64 L=8K; [notes], twenty-eighth session). v8 at 32 rows uses it.
template <typename T, int kN>
__device__ __forceinline__ void fp8t_rows_out(const DecodeParams& p, const float* sO, const float* sum, int half,
                                              float kv_scale, int req, int slot, int kvh, int tid_wg) {
  constexpr int kU = 4;  // passes at once (of kN / 2), the kernel's code growing with them
  const int heads_per_kv = p.heads_q / p.heads_kv, last = p.rows_per_kv_head - 1;
  const int chl = 4 * (tid_wg % 64), ch = Cfg::kHeadDimV / 2 * half + chl;
  // store_row_quad's layout of position chl: out's channels chl .. + 3, or a partial row's order
  const int so = slot < 0 ? chl : (chl & ~15) + 2 * ((chl & 15) / 4);
#pragma unroll 1
  for (int k0 = 0; k0 < kN / 2; k0 += kU) {
    float4 v[kU];
    float inv[kU], m[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int cr = min(2 * (k0 + u) + tid_wg / 64, last);
      const float total = sum[cr];
      inv[u] = total != 0.f ? kv_scale / total : 0.f;  // 0: no key; NaN (a bad block id): NaN
      const float* o = sO + cr * Fp8t::kOStride + so;
      if (slot < 0) {
        v[u] = *reinterpret_cast<const float4*>(o);
      } else {
        const float2 lo = *reinterpret_cast<const float2*>(o), hi = *reinterpret_cast<const float2*>(o + 8);
        v[u] = make_float4(lo.x, lo.y, hi.x, hi.y);
      }
      m[u] = fmaxf(fmaxf(fabsf(v[u].x), fabsf(v[u].y)), fmaxf(fabsf(v[u].z), fabsf(v[u].w)));
    }
    if (slot >= 0) {  // the quarter row's maximum, for its scale (the passes' shuffles interleaved)
#pragma unroll
      for (int d = 1; d < 32; d *= 2)
#pragma unroll
        for (int u = 0; u < kU; ++u) m[u] = fmaxf(m[u], __shfl_xor_sync(0xffffffffu, m[u], d));
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int c = 2 * (k0 + u) + tid_wg / 64;
      if (c > last) break;  // c grows with u
      store_quad<T>(p, v[u], m[u], ch, inv[u], req, c / heads_per_kv, kvh * heads_per_kv + c % heads_per_kv, slot);
    }
  }
}

// v7 (kRS = false) and v8 (kRS = true; kv_map: the cache's tensor map with 128-column boxes, common/launch.cuh make_kv_map).
// KvFmt, kSparse: v7's sparse launches (above); a dense launch reads fp8_e4m3.
template <typename T, int kN, bool kRS, int KvFmt = kKvFp8E4M3, bool kSparse = false>
__device__ __forceinline__ void fp8t_decode(const DecodeParams& p, const CUtensorMap* kv_map) {
  static_assert(kN == 16 || kN == 32, "16 or 32 query rows");
  static_assert(!kSparse || !kRS, "sparse launches run v7");
  static_assert(kSparse ? KvFmt != kKvSameAsQ : KvFmt == kKvFp8E4M3, "dense: fp8_e4m3; sparse: any fp8 cache");
  constexpr int kQChunks = KvFmt == kKvFp8DsV4 ? kDsV4HeadDim / 8 : Cfg::kChunksQK;  // q's 8-value chunks
  // registers of the converter and the accumulator (setmaxnreg; Fp8t)
  constexpr bool kRegsDs = kSparse && KvFmt == kKvFp8DsMla;
  constexpr int kRegsConv = kRegsDs ? Fp8t::kRegsConvDs : Fp8t::kRegsConv;
  constexpr int kRegsAcc = kRegsDs ? Fp8t::kRegsAccDs : Fp8t::kRegsAcc;
  using L = Gmma128Tile64;
  using G = GmmaEtap<__half, kN>;
  using S = Fp8tSmem<kRS>;
  constexpr int kStages = S::kStages;
  using TT = TypeTraits<T>;
  constexpr int kAcc = kN / 2;   // fp32 accumulators per thread of one m64 x kN tile
  constexpr int kCols = kN / 4;  // columns (query rows) per thread: c = 8 (k / 2) + 2 (lane % 4) + k % 2
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* smem_base = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  // v7: [2 stages][9 blocks][64][64] fp16; v8: [3 stages][5 boxes][64][128] fp8
  __half* sK = reinterpret_cast<__half*>(smem_base);
  __half* sQ = reinterpret_cast<__half*>(smem_base + S::kOffQ);
  __half* sP = reinterpret_cast<__half*>(smem_base + S::kOffP);  // [stages][kMaxRows x 64]
  float* sO = reinterpret_cast<float*>(smem_base + S::kOffO);    // [kN][kOStride]
  float* sColScale = reinterpret_cast<float*>(smem_base + S::kOffF);  // [32] 2^-e of each query row
  float* sAlpha = sColScale + Fp8t::kMaxRows;                         // [stages][32]
  float* sRed = sAlpha + kStages * Fp8t::kMaxRows;                    // [4 warps][32] column maxima
  float* sLRed = sRed + 4 * Fp8t::kMaxRows;                              // [4 warps][32] column sums
  float* sSum = sLRed + 4 * Fp8t::kMaxRows;                              // [2][32] an item's row sums, by parity
  float* sMax = sSum + 2 * Fp8t::kMaxRows;                               // [32] an item's row maxima
  int* sFlag = reinterpret_cast<int*>(smem_base + S::kOffFlag);          // [stages]
  int* sBad = reinterpret_cast<int*>(smem_base + S::kOffBad);            // [stages]
  uint8_t* sOk = smem_base + S::kOffOk;  // kSparse: [stages][8 row groups], bit i of group g: row 8 g + i has an id
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem_base + S::kOffBar);
  uint64_t* full = bars;
  uint64_t* empty = bars + kStages;
  uint64_t* p_ready = bars + 2 * kStages;
  uint64_t* sums_full = bars + 3 * kStages;
  uint64_t* sums_empty = bars + 3 * kStages + 2;
  // stage `st`, its phase for the it-th tile of the CTA
  auto stage_bytes = [&](uint32_t st) { return smem_base + st * S::kStageBytes; };
  auto phase_of = [](uint32_t it) { return (it / kStages) & 1u; };

  const int part = blockIdx.x, kvh = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % 32, tid_wg = tid % 128, warp = (tid / 32) % 4;
  const int wg = __shfl_sync(0xffffffff, tid / 128, 0);  // warp-uniform (see v6)
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(full + i, kRS ? 1 : 4);  // v8: the producer's arrive with the stage's byte count
      mbar_init(empty + i, 8);
      mbar_init(p_ready + i, 4 + 3);
      if (i < 2) {
        mbar_init(sums_full + i, 1);
        mbar_init(sums_empty + i, 128);
      }
    }
    fence_mbar_init();
  }
  __syncthreads();
  const int item_begin = p.part_offsets[part], item_end = p.part_offsets[part + 1];
  const int heads_per_kv = p.heads_q / p.heads_kv;
  const float kv_scale = KvFmt == kKvFp8E4M3 ? *p.kv_scale : 1.f;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  auto col_of = [&](int k) { return 8 * (k / 2) + 2 * (lane % 4) + (k % 2); };
  auto acc_row = [&](int i) { return 16 * warp + lane / 4 + 8 * ((i % 4) / 2); };
  auto acc_col = [](int i) { return 2 * (i / 4) + (i % 2); };
  auto desc = [](const void* base) { return gmma_desc_sw128_addr(smem_u32(base), 16, 1024); };

  if (wg == 0 && kRS) {
    // ================= v8: producer (one thread) =================
    // tile `it` as five 128-column boxes of its page (kv_map) into stage it % 3, once both consumers released the
    // stage; the boxes hold whatever the page has past the item's end (NaN in unused slots), which the consumers mask
    regs_dec<Fp8t::kRegsProd>();
    barrier_cta_unaligned(Fp8t::kBarRegs, Fp8t::kThreads);
    if (tid == 0) {
      const PageGeometry pg = page_geometry(p.page_size);
      uint32_t it = 0;
      // The query rows of the CTA's first item into L2 before its first tile, and of the next item four tiles before
      // an item's end, so that the scorer's loads of them hit L2: without, the first item's loads queued behind the
      // tiles' copies (H100, b=64 L=8K, graph us 138.0 -> 134.9 at 16 rows, 166.1 -> 162.9 at 32; without any query
      // loads 133.9 / 156.0; [notes], twenty-eighth session). Where an item's rows are one range (row stride 576, and
      // one query token or one KV head); a loop over query tokens spilled the producer's 40 registers.
      const bool q_pf = (reinterpret_cast<uintptr_t>(p.q) & 15) == 0 && p.q_stride_b % 8 == 0 &&
                        p.q_stride_h == Cfg::kHeadDimQK &&
                        (p.q_len == 1 || p.q_stride_s == (int64_t)heads_per_kv * Cfg::kHeadDimQK);
      auto prefetch_q = [&](int from) {  // the first item from `from`
        for (int item = from; item < item_end; ++item) {
          const int req = load_item(p, item).req;
          if (req < 0) continue;
          prefetch_l2_bulk(reinterpret_cast<const T*>(p.q) + (int64_t)req * p.q_stride_b +
                               (int64_t)kvh * heads_per_kv * Cfg::kHeadDimQK,
                           p.rows_per_kv_head * Cfg::kHeadDimQK * sizeof(T));
          return;
        }
      };
      if (q_pf) prefetch_q(item_begin);
      for (int item = item_begin; item < item_end; ++item) {
        const WorkItem w = load_item(p, item);
        const int req = w.req, tok_begin = w.tok_begin, tok_end = w.tok_end;
        if (req < 0) continue;
        const int32_t* table_row = p.block_table + (int64_t)req * p.bt_stride;
        int page = table_row[pg.index(tok_begin)];
        bool q_next = q_pf;
        for (int t0 = tok_begin; t0 < tok_end; t0 += Cfg::kBlockN, ++it) {
          const uint32_t st = it % kStages;
          const int t1 = t0 + Cfg::kBlockN, next = t1 < tok_end ? table_row[pg.index(t1)] : 0;  // read a tile ahead
          if (q_next && t0 + 4 * Cfg::kBlockN >= tok_end) {  // four tiles before the item's end
            prefetch_q(item + 1);
            q_next = false;
          }
          mbar_wait(empty + st, phase_of(it) ^ 1u);
          const bool ok = page_ok(p, page);
          page = ok ? page : 0;
          sBad[st] = !ok;  // published by the arrive below (the scorer read the stage's last flag before releasing it)
          mbar_arrive_expect_tx(full + st, S::kStageBytes);
#pragma unroll
          for (int b = 0; b < Fp8t::kBoxes; ++b)
            tma_load_4d(stage_bytes(st) + b * Fp8t::kBoxBytes, kv_map, full + st, 128 * b, kvh, pg.row(t0), page);
          page = next;
        }
      }
    }
    regs_inc<Fp8t::kRegsLaunch>();
  } else if (wg == 0) {
    // ================= converter =================
    regs_inc<kRegsConv>();
    barrier_cta_unaligned(Fp8t::kBarRegs, Fp8t::kThreads);
    const int r0 = 8 * warp + lane / 4, q4 = lane % 4;
    // L2 prefetches: one bulk copy per tile where a tile is one contiguous range (whole-tile pages of a single-head
    // cache whose items start on 64-token chunks), else one per 576-byte row from threads 0..63; none where the
    // cache is not 16-byte aligned
    // (kSparse: one per row, its token's data; fp8_ds_v4 rows lie at multiples of 576 bytes in their block)
    const bool pf_ok = (reinterpret_cast<uintptr_t>(p.kv) & 15) == 0 && p.kv_stride_block % 16 == 0 &&
                       (KvFmt == kKvFp8DsV4 || (p.kv_stride_tok % 16 == 0 && p.kv_stride_head % 16 == 0));
    const bool pf_whole = !kSparse && p.page_size % Cfg::kBlockN == 0 && p.kv_stride_tok == Cfg::kHeadDimQK;
    const uint8_t* kv = reinterpret_cast<const uint8_t*>(p.kv);
    // the table's pages; kSparse: the cache's, which its token ids count in (the table holds one id per token)
    const PageGeometry pg = page_geometry(kSparse ? p.sparse_page : p.page_size);
    using Rows = std::conditional_t<kSparse, Fp8tSparseRows<KvFmt>, Fp8tRows>;
    uint32_t it = 0;
    for (int item = item_begin; item < item_end; ++item) {
      const WorkItem w = load_item(p, item);
      const int req = w.req, tok_begin = w.tok_begin;
      if (req < 0) continue;
      // a sparse item ends at its list's length (topk_length), as in the scorer and the accumulator
      const int tok_end = kSparse ? min(w.tok_end, max(p.cache_seqlens[req], tok_begin)) : w.tok_end;
      const int n_tiles = (tok_end - tok_begin + Cfg::kBlockN - 1) / Cfg::kBlockN;
      const int32_t* table_row = p.block_table + (int64_t)req * p.bt_stride;
      // the largest block id this thread read for the item, as unsigned (loads.cuh; every page is read before its
      // tile is put, so the item's last tile carries the flags of all its pages)
      uint32_t max_id = 0;
      auto page_of = [&](int t) { return t < tok_end ? checked_page(p, table_row[pg.index(t)], max_id) : 0; };
      // a page for an L2 prefetch only (block 0 for a bad id; rows_pages flags it when the tile is loaded)
      auto pf_page_of = [&](int t) {
        const int page = t < tok_end ? table_row[pg.index(t)] : 0;
        return page_ok(p, page) ? page : 0;
      };
      // kSparse: the token ids of the rows (-1: none, and past the item's end), checked when loaded
      auto rows_pages = [&](int t0, int (&pg)[2]) {
        if constexpr (kSparse) {
          pg[0] = t0 + r0 < tok_end ? table_row[t0 + r0] : -1;
          pg[1] = t0 + r0 + 32 < tok_end ? table_row[t0 + r0 + 32] : -1;
        } else {
          pg[0] = page_of(t0 + r0);
          pg[1] = page_of(t0 + r0 + 32);
        }
      };
      auto load = [&](Rows& x, const int (&rows)[2], int t0) {
        if constexpr (kSparse)
          fp8t_load_sparse<KvFmt>(p, pg, x, rows, kvh, q4, max_id);
        else
          fp8t_load(p, pg, x, rows, t0, tok_end, kvh, r0, q4);
      };
      // the prefetch's page: of the tile (whole tiles: one page each) or of row tid_wg (kSparse: its id, -1 for none
      // or a bad one)
      const bool whole = pf_whole && tok_begin % Cfg::kBlockN == 0;
      auto pf_page = [&](int t0) {
        if constexpr (kSparse) {
          const int t = t0 + tid_wg % Cfg::kBlockN;
          const int id = t < tok_end ? table_row[t] : -1;
          return page_ok(p, id) ? id : -1;
        } else {
          return pf_page_of(t0 + (whole ? 0 : tid_wg % Cfg::kBlockN));
        }
      };
      auto prefetch = [&](int page, int t0) {
        if (!pf_ok || t0 >= tok_end) return;
        if constexpr (kSparse) {
          if (tid_wg < Cfg::kBlockN && page >= 0) {
            prefetch_l2_bulk(sparse_row(p, pg, page, kvh, KvFmt == kKvFp8DsV4), sparse_row_bytes<KvFmt>());
            if constexpr (KvFmt == kKvFp8DsV4)  // the 16 bytes that hold its scale bytes
              prefetch_l2_bulk(reinterpret_cast<const void*>(
                                   reinterpret_cast<uintptr_t>(ds_v4_scales(p, pg, page)) & ~uintptr_t(15)),
                               16);
          }
        } else if (whole) {
          if (tid_wg == 0)
            prefetch_l2_bulk(kv + paged_row_offset(p, pg, page, t0, kvh),
                             min(Cfg::kBlockN, tok_end - t0) * Cfg::kHeadDimQK);
        } else if (tid_wg < Cfg::kBlockN && t0 + tid_wg < tok_end) {
          prefetch_l2_bulk(kv + paged_row_offset(p, pg, page, t0 + tid_wg, kvh), Cfg::kHeadDimQK);
        }
      };
      // tile `it` of this CTA into stage it % 2 once both consumers released it (a fresh barrier's wait for the
      // previous phase passes), then the stage's full barrier (one arrive per warp)
      auto put = [&](Rows& x, int t0) {
        const uint32_t st = it & 1u;
        mbar_wait(empty + st, ((it >> 1) & 1u) ^ 1u);
        if constexpr (kSparse) {
          fp8t_store_sparse<KvFmt>(sK + st * (S::kStageBytes / 2), x, r0, q4);
          // the rows with an id, a byte per 8 rows: this warp's rows 8 warp .. + 8 and 32 + 8 warp .. + 8
          const uint32_t ok0 = __ballot_sync(0xffffffffu, x.ok & 1u), ok1 = __ballot_sync(0xffffffffu, x.ok & 2u);
          if (lane == 0) {  // published by its arrive below, as sBad
            sOk[8 * st + warp] = fp8t_row_byte(ok0);
            sOk[8 * st + 4 + warp] = fp8t_row_byte(ok1);
          }
        } else {
          fp8t_store(sK + st * (S::kStageBytes / 2), x, t0, tok_end, r0, q4);
        }
        const bool warp_bad = __any_sync(0xffffffffu, !page_ok(p, max_id));
        fence_proxy_async_smem();
        __syncwarp();
        if (lane == 0) {
          reinterpret_cast<uint8_t*>(sBad + st)[warp] = warp_bad;  // this warp's byte, published by its arrive
          mbar_arrive(full + st);
        }
        ++it;
      };
      Rows x, y;
      int pa[2], pb[2];
      rows_pages(tok_begin, pa);
      load(x, pa, tok_begin);
      // pages of tiles j + 1 / j + 2 for the register loads (pb / pa), of tiles j + A / j + A + 1 for the L2
      // prefetches (fa / fb; A = kPrefetchAhead): each read a whole iteration before its use
      constexpr int A = Fp8t::kPrefetchAhead;
      rows_pages(tok_begin + Cfg::kBlockN, pb);
      rows_pages(tok_begin + 2 * Cfg::kBlockN, pa);
#pragma unroll
      for (int k = 1; k < A; ++k) prefetch(pf_page(tok_begin + k * Cfg::kBlockN), tok_begin + k * Cfg::kBlockN);
      int fa = pf_page(tok_begin + A * Cfg::kBlockN), fb = pf_page(tok_begin + (A + 1) * Cfg::kBlockN);
      for (int j = 0; j < n_tiles; j += 2) {
        const int t0 = tok_begin + j * Cfg::kBlockN;
        // tile j + 1 into y while tile j is stored; tile j + A into L2
        if (j + 1 < n_tiles) load(y, pb, t0 + Cfg::kBlockN);
        rows_pages(t0 + 3 * Cfg::kBlockN, pb);
        prefetch(fa, t0 + A * Cfg::kBlockN);
        fa = pf_page(t0 + (A + 2) * Cfg::kBlockN);
        put(x, t0);
        // tile j + 2 into x while tile j + 1 is stored; tile j + A + 1 into L2
        if (j + 2 < n_tiles) load(x, pa, t0 + 2 * Cfg::kBlockN);
        rows_pages(t0 + 4 * Cfg::kBlockN, pa);
        prefetch(fb, t0 + (A + 1) * Cfg::kBlockN);
        fb = pf_page(t0 + (A + 3) * Cfg::kBlockN);
        if (j + 1 < n_tiles) put(y, t0 + Cfg::kBlockN);
      }
    }
    regs_dec<Fp8t::kRegsLaunch>();
  } else if (wg == 1) {
    // ================= scorer =================
    if constexpr (kRS)
      regs_inc<Fp8t::kRegsScorerRS>();
    else
      regs_dec<Fp8t::kRegsScorer>();
    barrier_cta_unaligned(Fp8t::kBarRegs, Fp8t::kThreads);
    const float score_scale = p.softmax_scale * kv_scale * kLog2e;
    uint32_t it = 0, n_items = 0;
    for (int item = item_begin; item < item_end; ++item) {
      const WorkItem w = load_item(p, item);
      const int req = w.req, tok_begin = w.tok_begin, slot = w.slot;
      if (req < 0) continue;
      const int seqlen = p.cache_seqlens[req];
      const int tok_end = kSparse ? min(w.tok_end, max(seqlen, tok_begin)) : w.tok_end;  // as the converter's
      const int n_tiles = (tok_end - tok_begin + Cfg::kBlockN - 1) / Cfg::kBlockN;
      // ---- the query tile in fp16: warp w takes rows w, w + 4, ...; lane the 16-byte chunks lane, lane + 32, ...
      // (fp8_ds_v4: D_qk 512, q's column block 8 zeros, as the stages')
      named_barrier(Fp8t::kBarScorer, 128);  // every warp's S^T of the previous item is done: sQ is free
      // every row's loads of a batch in flight before any is used (v8 at 32 rows: 167.7 -> 164.9 us at b=64 L=8K,
      // no change at 16; H100, [notes], twenty-eighth session). v8's scorer holds all its rows (kN / 4 x 12
      // registers); v7's (112 registers) spilled with two at 32 rows, so it keeps one row at a time
      constexpr int kQBatch = kRS ? kN / 4 : 1;
#pragma unroll 1
      for (int c0 = warp; c0 < kN; c0 += 4 * kQBatch) {
        uint4 v[kQBatch][3];
#pragma unroll
        for (int r = 0; r < kQBatch; ++r) {
          const int c = c0 + 4 * r;
          const bool valid = c < p.rows_per_kv_head;
          const T* src = reinterpret_cast<const T*>(p.q) + (int64_t)req * p.q_stride_b +
                         (int64_t)(valid ? c / heads_per_kv : 0) * p.q_stride_s +
                         (int64_t)(kvh * heads_per_kv + (valid ? c % heads_per_kv : 0)) * p.q_stride_h;
#pragma unroll
          for (int k = 0; k < 3; ++k) {
            const int chunk = lane + 32 * k;
            v[r][k] = valid && chunk < kQChunks ? *reinterpret_cast<const uint4*>(src + 8 * chunk)
                                                : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int r = 0; r < kQBatch; ++r) {
          const int c = c0 + 4 * r;
          float mx = 0.f;
#pragma unroll
          for (int k = 0; k < 3; ++k) {
            const uint32_t* u = reinterpret_cast<const uint32_t*>(&v[r][k]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 f = TT::to_float2(*reinterpret_cast<const typename TT::T2*>(u + e));
              mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));
            }
          }
#pragma unroll
          for (int o = 1; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
          int ex = 0;
          frexpf(mx, &ex);  // mx = f 2^ex, f in [0.5, 1): mx 2^(15 - ex) in [2^14, 2^15)
          const int sh = max(-126, min(126, 15 - ex));
          const float up = pow2i(sh);
#pragma unroll
          for (int k = 0; k < 3; ++k) {
            const int chunk = lane + 32 * k;
            if (chunk >= Cfg::kChunksQK) continue;
            const uint32_t* u = reinterpret_cast<const uint32_t*>(&v[r][k]);
            uint4 h;
            uint32_t* hw = reinterpret_cast<uint32_t*>(&h);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 f = TT::to_float2(*reinterpret_cast<const typename TT::T2*>(u + e));
              hw[e] = half2_bits(__floats2half2_rn(f.x * up, f.y * up));
            }
            if constexpr (kRS) {  // columns in fp8rs_gemm_s's order: (0 1 4 5) and (2 3 6 7) of the chunk apart
              *reinterpret_cast<uint2*>(sQ + q_tile_offset<kN>(c, fp8rs_q_col(8 * chunk))) = make_uint2(hw[0], hw[2]);
              *reinterpret_cast<uint2*>(sQ + q_tile_offset<kN>(c, fp8rs_q_col(8 * chunk + 2))) =
                  make_uint2(hw[1], hw[3]);
            } else {
              *reinterpret_cast<uint4*>(sQ + q_tile_offset<kN>(c, 8 * chunk)) = h;
            }
          }
          if (lane == 0) sColScale[c] = pow2i(-sh);
        }
      }
      fence_proxy_async_smem();
      named_barrier(Fp8t::kBarScorer, 128);
      float s_col[kCols], m_run[kCols], m_use[kCols], l_run[kCols];
      int limit[kCols];
#pragma unroll
      for (int k = 0; k < kCols; ++k) {
        s_col[k] = score_scale * sColScale[col_of(k)];
        m_run[k] = -INFINITY, m_use[k] = 0.f, l_run[k] = 0.f;
        limit[k] = p.causal ? seqlen - p.q_len + col_of(k) / heads_per_kv : seqlen - 1;
      }
      const int unmasked_end = min(tok_end, p.causal ? seqlen - p.q_len + 1 : seqlen);
      int bad_tiles = 0;  // nonzero once a tile of the item came with a bad-block-id flag (sBad)

      for (int j = 0; j < n_tiles; ++j, ++it) {
        const int t0 = tok_begin + j * Cfg::kBlockN;
        const uint32_t st = it % kStages;
        mbar_wait(full + st, phase_of(it));
        bad_tiles |= sBad[st];  // read before this warp releases the stage (empty), after which it is rewritten
        // kSparse: bit r set where token row r of the tile has an id (read before the release too)
        const uint64_t ok_rows = kSparse ? *reinterpret_cast<const uint64_t*>(sOk + 8 * st) : 0;
        // ---- S^T = K Q^T (etap_gemm_s; v8: fp8rs_gemm_s)
        float acc_s[kAcc];
        if constexpr (kRS) {
          fp8rs_gemm_s<typename GmmaFp8RS<kN>::Op, kN * 64>(stage_bytes(st), desc(sQ), acc_s, warp, lane);
        } else {
          etap_gemm_s<G, kN * 64>(desc(sK + st * (S::kStageBytes / 2)), desc(sQ), acc_s, [](int) {});
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + st);  // this warp's share of the stage is read

        // ---- scores in base 2; mask only tiles reaching past unmasked_end (kSparse: every tile, by its rows' ids)
        const bool masked = t0 + Cfg::kBlockN > unmasked_end;
        bool over = false;
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
          const int k = acc_col(i), t = t0 + acc_row(i);
          const bool hidden =
              kSparse ? !((ok_rows >> acc_row(i)) & 1u) : masked && !(t < tok_end && t <= limit[k]);
          acc_s[i] = hidden ? -INFINITY : acc_s[i] * s_col[k];
          over |= acc_s[i] - m_run[k] > 8.f;  // NaN (both -inf) compares false; a first key gives +inf
        }
        // conditional rescaling (FlashAttention-4): the column maxima are taken only when some score passes its
        // row's reference maximum by more than 2^8; P <= 2^8 is exact enough in fp16 and far from its range
        const bool fire = named_barrier_any(Fp8t::kBarScorer, 128, over);
        float alpha[kCols];
        if (fire) {
          float cmax[kCols];
#pragma unroll
          for (int k = 0; k < kCols; ++k) cmax[k] = -INFINITY;
#pragma unroll
          for (int i = 0; i < kAcc; ++i) cmax[acc_col(i)] = fmaxf(cmax[acc_col(i)], acc_s[i]);
#pragma unroll
          for (int k = 0; k < kCols; ++k) {
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) cmax[k] = fmaxf(cmax[k], __shfl_xor_sync(0xffffffff, cmax[k], o));
            if (lane < 4) sRed[warp * Fp8t::kMaxRows + col_of(k)] = cmax[k];
          }
          named_barrier(Fp8t::kBarScorer, 128);
#pragma unroll
          for (int k = 0; k < kCols; ++k) {
            const int c = col_of(k);
            const float tile_max = fmaxf(fmaxf(sRed[c], sRed[Fp8t::kMaxRows + c]),
                                         fmaxf(sRed[2 * Fp8t::kMaxRows + c], sRed[3 * Fp8t::kMaxRows + c]));
            const float m_new = fmaxf(m_run[k], tile_max);
            const float mu = m_new == -INFINITY ? 0.f : m_new;
            alpha[k] = exp2_ftz(m_run[k] - mu);
            m_run[k] = m_new;
            m_use[k] = mu;
          }
        } else {
#pragma unroll
          for (int k = 0; k < kCols; ++k) alpha[k] = 1.f;
        }
        // ---- P (fp32 in acc_s), row sums; P^T (fp16) and the rescale factors into shared memory
        float psum[kCols];
#pragma unroll
        for (int k = 0; k < kCols; ++k) psum[k] = 0.f;
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
          const int k = acc_col(i);
          acc_s[i] = exp2_ftz(acc_s[i] - m_use[k]);
          psum[k] += acc_s[i];
        }
#pragma unroll
        for (int k = 0; k < kCols; ++k) l_run[k] = l_run[k] * alpha[k] + psum[k];
        // the stage's P^T was last read by the accumulator for tile it - kStages, before it released the stage
        __half* pw = sP + st * (S::kPBytes / 2);
#pragma unroll
        for (int i = 0; i < kAcc; ++i)
          pw[L::offset(col_of(acc_col(i)), acc_row(i))] = __float2half_rn(acc_s[i]);
        if (warp == 0) {
          if (fire && lane < 4) {
#pragma unroll
            for (int k = 0; k < kCols; ++k) sAlpha[st * Fp8t::kMaxRows + col_of(k)] = alpha[k];
          }
          if (lane == 0) sFlag[st] = fire;
        }
        fence_proxy_async_smem();
        __syncwarp();
        // each writer of sAlpha releases its own stores (racecheck does not follow them through __syncwarp)
        if (lane == 0 || (warp == 0 && lane < 4)) mbar_arrive(p_ready + st);
      }

      // ---- the item's row sums and maxima; LSE; the sums to the accumulator
      const uint32_t par = n_items & 1u;
#pragma unroll
      for (int k = 0; k < kCols; ++k) {
        float l = l_run[k];
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) l += __shfl_xor_sync(0xffffffff, l, o);
        if (lane < 4) {
          sLRed[warp * Fp8t::kMaxRows + col_of(k)] = l;
          if (warp == 0) sMax[col_of(k)] = m_run[k];
        }
      }
      mbar_wait(sums_empty + par, ((n_items >> 1) & 1u) ^ 1u);  // the accumulator read the sums of
                                                                                   // item n - 2
      named_barrier(Fp8t::kBarScorer, 128);
      if (tid_wg < kN) {
        const int c = tid_wg;
        const float total = poison_sum(sLRed[c] + sLRed[Fp8t::kMaxRows + c] + sLRed[2 * Fp8t::kMaxRows + c] +
                                           sLRed[3 * Fp8t::kMaxRows + c],
                                       bad_tiles != 0);
        const int qi = c / heads_per_kv, head = kvh * heads_per_kv + c % heads_per_kv;
        const bool has_keys = total != 0.f;
        // what the accumulator divides the row by: the sum, and for a whole request's row with a sink s (sparse,
        // DeepSeek-V4) 2^(s log2 e - max) besides (etap's epilogue; s = +inf: out 0); a split request's rows take
        // the sink in the combine
        float div = total;  // NaN for a poisoned item: the accumulator's rows NaN too
        if (kSparse && slot < 0 && p.attn_sink != nullptr && has_keys && c < p.rows_per_kv_head)
          div += exp2f(p.attn_sink[head] * kLog2e - sMax[c]);
        sSum[par * Fp8t::kMaxRows + c] = div;
        if (c < p.rows_per_kv_head) {
          const float lse_val = has_keys ? (sMax[c] + log2f(total)) * kLn2 : (slot < 0 ? INFINITY : -INFINITY);
          store_item_lse(p, req, slot, qi, head, lse_val);
        }
      }
      named_barrier(Fp8t::kBarScorer, 128);  // the sums are written (and sLRed / sMax read)
      if (tid_wg == 0) mbar_arrive(sums_full + par);
      ++n_items;
    }
    if constexpr (kRS)
      regs_dec<Fp8t::kRegsLaunch>();
    else
      regs_inc<Fp8t::kRegsLaunch>();
  } else {
    // ================= accumulator =================
    regs_inc<kRS ? Fp8t::kRegsAccRS : kRegsAcc>();
    barrier_cta_unaligned(Fp8t::kBarRegs, Fp8t::kThreads);
    uint32_t it = 0, n_items = 0;
    for (int item = item_begin; item < item_end; ++item) {
      const WorkItem w = load_item(p, item);
      const int req = w.req, tok_begin = w.tok_begin, slot = w.slot;
      if (req < 0) continue;
      const int tok_end = kSparse ? min(w.tok_end, max(p.cache_seqlens[req], tok_begin)) : w.tok_end;  // as above
      const int n_tiles = (tok_end - tok_begin + Cfg::kBlockN - 1) / Cfg::kBlockN;
      // causal: the keys from here on are hidden from some query row (the scorer's unmasked_end; the CTA's tile holds
      // every row of the KV head, query token 0's among them), so their non-finite V values are cleaned before P V
      const int unmasked_end = p.causal ? min(tok_end, p.cache_seqlens[req] - p.q_len + 1) : tok_end;
      float acc_o[8][kAcc];
      etap_zero_acc_o(acc_o);
      for (int j = 0; j < n_tiles; ++j, ++it) {
        const uint32_t st = it % kStages, ph = phase_of(it);
        // P^T of the tile ready, O^T rescaled where the scorer moved a row's reference maximum
        auto wait_p = [&] {
          mbar_wait(p_ready + st, ph);
          if (sFlag[st]) {
            float alpha[kCols];
#pragma unroll
            for (int k = 0; k < kCols; ++k) alpha[k] = sAlpha[st * Fp8t::kMaxRows + col_of(k)];
#pragma unroll
            for (int mb = 0; mb < 8; ++mb)
#pragma unroll
              for (int i = 0; i < kAcc; ++i) acc_o[mb][i] *= alpha[acc_col(i)];
          }
        };
        // ---- O^T += V^T P^T (etap_gemm_pv; v8: register A fragments, two 64-channel blocks in flight, block 0
        // converted before P is ready)
        const int t0 = tok_begin + j * Cfg::kBlockN;
        const bool hide = p.causal && t0 + Cfg::kBlockN > unmasked_end;  // a causal tail tile (only such tiles pay)
        if constexpr (kRS) {
          const int nv = min(Cfg::kBlockN, tok_end - t0);
          // v8: the hidden keys' NaN bytes zeroed in the V^T fragments (fp8rs_load_v, kHide)
          auto load_v = [&](uint32_t(&f)[16], int mb) {
            if (hide)
              fp8rs_load_v<true, true>(f, stage_bytes(st), mb, nv, warp, lane, max(unmasked_end - t0, 0));
            else if (nv < Cfg::kBlockN)
              fp8rs_load_v<true>(f, stage_bytes(st), mb, nv, warp, lane);
            else
              fp8rs_load_v<false>(f, stage_bytes(st), mb, nv, warp, lane);
          };
          const uint64_t dp = desc(sP + st * (S::kPBytes / 2));
          uint32_t va[2][16];
          mbar_wait(full + st, ph);
          load_v(va[0], 0);
          wait_p();
#pragma unroll
          for (int mb = 0; mb < 8; ++mb) fence_regs<kAcc>(acc_o[mb]);
#pragma unroll
          for (int mb = 0; mb < 8; ++mb) {
            uint32_t(&f)[16] = va[mb & 1];
            if (mb >= 2) cute::warpgroup_wait<1>();  // the wgmmas of block mb - 2 have read these registers
            if (mb >= 1) load_v(f, mb);
            cute::warpgroup_arrive();
#pragma unroll
            for (int kt = 0; kt < 4; ++kt)
              gmma_rs_call<typename GmmaFp8RS<kN>::Op>(f + 4 * kt, dp + (uint64_t)((kt * 16 * 2) >> 4), acc_o[mb], true,
                                                       std::make_index_sequence<kAcc>{});
            cute::warpgroup_commit_batch();
          }
          cute::warpgroup_wait<0>();
#pragma unroll
          for (int mb = 0; mb < 8; ++mb) fence_regs<kAcc>(acc_o[mb]);
        } else {
          wait_p();
          // v7: the hidden keys' V rows of the fp16 stage, non-finite values to 0 (loads.cuh, clean_hidden_rows; the
          // rule of decode.py's _hide_from_rows_that_do_not_see). Here, not in the converter: the scorer's S^T must
          // still read the NaN (the rows that see the key get NaN from its score), and p_ready says all four scorer
          // warps are done with the stage. The converter rewrites it only after this warpgroup's empty arrive.
          if (hide) {
            clean_hidden_rows<__half>(sK + st * (S::kStageBytes / 2), max(unmasked_end - t0, 0),
                                      min(tok_end - t0, Cfg::kBlockN), tid_wg, 128);
            fence_proxy_async_smem();
            named_barrier(Fp8t::kBarAcc, 128);  // every thread's cleaning before any warp's wgmma reads the stage
          }
          etap_gemm_pv<G>(sK + st * (S::kStageBytes / 2), desc(sP + st * (S::kPBytes / 2)), acc_o);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + st);
      }

      // ---- out: half a row block (256 channels) at a time through sO, rows out 4 channels per thread
      const uint32_t par = n_items & 1u;
      mbar_wait(sums_full + par, (n_items >> 1) & 1u);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        named_barrier(Fp8t::kBarAcc, 128);  // sO's previous readers are done
#pragma unroll
        for (int mb = 0; mb < 4; ++mb)
#pragma unroll
          for (int i = 0; i < kAcc; ++i)
            sO[col_of(acc_col(i)) * Fp8t::kOStride + mb * 64 + (kRS ? fp8rs_channel(acc_row(i)) : acc_row(i))] =
                acc_o[4 * half + mb][i];
        named_barrier(Fp8t::kBarAcc, 128);
        // v8 at 32 rows: passes that overlap (H100, b=64 L=8K: 162.3 -> 157.0 us; at 16 rows 134.7 -> 135.2, so
        // 16 rows and v7, not measured, keep the loop; [notes], twenty-eighth session)
        if constexpr (kRS && kN == 32) {
          fp8t_rows_out<T, kN>(p, sO, sSum + par * Fp8t::kMaxRows, half, kv_scale, req, slot, kvh, tid_wg);
        } else
        for (int idx = tid_wg; idx < kN * 64; idx += 128) {
          const int c = idx / 64, chl = 4 * (idx % 64), ch = Cfg::kHeadDimV / 2 * half + chl;
          if (c >= p.rows_per_kv_head) break;  // idx grows with c; a warp shares c
          const float total = sSum[par * Fp8t::kMaxRows + c];
          const float inv = total != 0.f ? kv_scale / total : 0.f;  // 0: no key; NaN (a bad block id): NaN
          const int qi = c / heads_per_kv, head = kvh * heads_per_kv + c % heads_per_kv;
          // sO holds this half of the row: channel ch at chl; a warp holds one quarter row (store_row_quad)
          store_row_quad<T>(p, sO + c * Fp8t::kOStride, chl, ch, inv, req, qi, head, slot);
        }
      }
      mbar_arrive(sums_empty + par);  // this thread's reads of the sums are done
      ++n_items;
    }
    regs_dec<Fp8t::kRegsLaunch>();
  }
  if (p.fuse_combine) combine_in_grid<T, Fp8t::kThreads>(p, reinterpret_cast<int*>(smem_base));
}

}  // namespace mla_sm90
