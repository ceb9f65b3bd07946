// What mainloops seesaw (seesaw/seesaw.cuh) and seesaw_fp8 (seesaw_fp8/seesaw_fp8.cuh, the same schedule with a
// converting warpgroup) share of the paired-tile schedule (the "seesaw" of FlashMLA's SM90 kernel): the column blocks
// of a tile, the consumers' named barriers, the layout after Q, K and P, and a consumer warpgroup's steps of a pair.
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "common/gmma.cuh"
#include "common/loads.cuh"
#include "common/ptx.cuh"
#include "common/traits.cuh"

namespace mla_sm90 {

struct SeesawPair {
  static constexpr int kBlocks = Cfg::kHeadDimQK / 64;  // column blocks of a tile, one mbarrier each
  // the steady-state pair leaves its tiles unmasked: query lengths up to kSeesawMaxQLen (config.h)
  static constexpr int kMaxQLen = kSeesawMaxQLen;
  // named barriers (0 = __syncthreads)
  static constexpr int kBarScale0 = 1, kBarScale1 = 2, kBarP0 = 3, kBarP1 = 4, kBarWg = 5;  // 5, 6: per warpgroup
  // mbarriers: full [stage][column block]; seesaw_fp8 also empty [stage][early, late], raw [stage] (the raw TMA copy
  // of blocks 0..7) and rope [stage] (of block 8). seesaw leaves those eight unused: both kernels lay out shared
  // memory alike
  static constexpr int kBars = 2 * kBlocks + 8;
  // after the mbarriers, int flags of bad block ids: [0] the current item's, [1 + stage] seesaw_fp8's per tile in the
  // stage
  static constexpr int kBadFlags = 4;
  // then a sparse seesaw_fp8's tile words, 4 per stage: the tile's row mask (64 bits: row r holds a key) and a byte
  // per converter warp, nonzero where the warp met a bad id
  static constexpr int kTileWords = 8;
  static constexpr int kSmemBytes = 2 * (Cfg::kQElems + Cfg::kStages * Cfg::kKElems + Cfg::kPElems) +
                                    7 * Cfg::kBlockM * (int)sizeof(float) + kBars * 8 + kBadFlags * 4 +
                                    kTileWords * 4 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the SM90 per-block limit");
};

// A consumer warpgroup's steps of a pair, the same in seesaw and seesaw_fp8 (where they refill or release the stages,
// and in which order S takes the column blocks, differs). Over the warpgroup's registers: acc_o, its 256 output
// channels (m64n256, 128 per thread); acc_s, the S tile of 64 tokens (m64n64, 32 per thread); row_local, the thread's
// two rows of the tile (lane: its lane); sM, the running row maxima (base 2) in shared memory. They were the kernels'
// lambdas, and are left to the optimiser's inlining as those were (not __forceinline__); the kernels' SASS did not
// change with the move.

// Descriptor bases go through an empty asm per use: the operand addresses are loop
// invariant, and ptxas would otherwise keep every k-step's 64-bit descriptor live
// across the loop ([notes], v4) and spill.
__device__ inline uint64_t seesaw_desc(const void* base) {
  uint32_t a = smem_u32(base);
  asm volatile("" : "+r"(a));
  a = __shfl_sync(0xffffffff, a, 0);  // warp-uniform: the descriptor math runs in uniform registers
  return gmma_desc_sw128_addr(a, 16, 1024);
}
// the same for V, read MN-major
__device__ inline uint64_t seesaw_desc_v(const void* base) {
  uint32_t a = smem_u32(base);
  asm volatile("" : "+r"(a));
  a = __shfl_sync(0xffffffff, a, 0);  // warp-uniform: the descriptor math runs in uniform registers
  return gmma_desc_sw128_addr(a, 64 * 64 * 2, 1024);
}

// softmax of the S tile of tile j (tokens tok_begin + 64 j ..) against the running max in sM; returns this thread's
// per-row scale for the old accumulators; acc_s becomes P (fp32, base-2 exponent).
// kMask: tokens at or past tok_end or past a causal row's limit become -inf (the token index computed in the masked
// loop, as the lambda did: a first tile offset passed in changed seesaw's SASS, 120 more instructions). A tile
// followed by at least 65 more tokens of the item needs no mask (q_len <= kMaxQLen), so
// the steady-state pair skips it, as FlashMLA's kernel does for all but the last tiles.
// The maximum is taken over raw scores (score_scale > 0) and the scale folded into the
// exponent's FFMA: p = 2^(s * scale - m).
// kBits (sparse seesaw_fp8, in place of kMask): token n of the tile becomes -inf unless bit n of `bits` is set.
// An item's tile pairs (a, a + 1), a = 0, 2, 4, ..., each run as pair(a, has_b, next_a, next_b): whether tiles a + 1,
// a + 2 and a + 3 exist, as std::bool_constant template arguments (a runtime branch around a wgmma still in flight makes
// ptxas serialise every wgmma of the kernel, C7515; FlashMLA specialises its pair the same way).
template <class Pair>
__device__ __forceinline__ void seesaw_pairs(int num_tiles, Pair&& pair) {
  using T_ = std::true_type;
  using F_ = std::false_type;
  for (int a = 0; a < num_tiles; a += 2) {
    if (a + 3 < num_tiles) pair(a, T_{}, T_{}, T_{});
    else if (a + 2 < num_tiles) pair(a, T_{}, T_{}, F_{});
    else if (a + 1 < num_tiles) pair(a, T_{}, F_{}, F_{});
    else pair(a, F_{}, F_{}, F_{});
  }
}

template <bool kMask, bool kBits = false>
__device__ inline void seesaw_softmax(float (&acc_s)[32], float* sM, const int (&row_local)[2], int lane,
                                      int tok_begin, int j, int tok_end, const int (&limit)[2], float score_scale,
                                      float (&scale)[2], float (&psum)[2], uint64_t bits = 0) {
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = e >> 1;
      float& s = acc_s[4 * n + e];
      if constexpr (kBits) {
        s = (bits >> (n * 8 + (lane % 4) * 2 + (e & 1))) & 1u ? s : -INFINITY;
      } else if constexpr (kMask) {
        const int t = tok_begin + j * Cfg::kBlockN + n * 8 + (lane % 4) * 2 + (e & 1);
        s = (t < tok_end && t <= limit[h]) ? s : -INFINITY;
      }
      tile_max[h] = fmaxf(tile_max[h], s);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffff, tile_max[h], 1));
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffff, tile_max[h], 2));
    const float m_old = sM[row_local[h]];
    const float m_new = fmaxf(m_old, tile_max[h] * score_scale);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    scale[h] = exp2_ftz(m_old - m_use);
    psum[h] = 0.f;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 2 * h; e < 2 * h + 2; ++e) {
        acc_s[4 * n + e] = exp2_ftz(fmaf(acc_s[4 * n + e], score_scale, -m_use));
        psum[h] += acc_s[4 * n + e];
      }
    }
    __syncwarp();  // every lane of the quad has read sM before it moves
    if (lane % 4 == 0) sM[row_local[h]] = m_new;
  }
}
// O *= s per row (skipped by a warp whose 16 rows all kept their maximum: most pairs once a row has seen many tokens)
__device__ inline void seesaw_scale_o(float (&acc_o)[128], const float (&s)[2]) {
  if (!__any_sync(0xffffffff, s[0] != 1.f || s[1] != 1.f)) return;
#pragma unroll
  for (int n = 0; n < 32; ++n) {
    acc_o[4 * n + 0] *= s[0];
    acc_o[4 * n + 1] *= s[0];
    acc_o[4 * n + 2] *= s[1];
    acc_o[4 * n + 3] *= s[1];
  }
}
// P (acc_s, times per-row factors) as wgmma A fragments: k-step kt = accumulators 8kt .. 8kt+8.
template <typename T>
__device__ inline void seesaw_pack_p(const float (&acc_s)[32], uint32_t (&rp)[16], const float (&f)[2]) {
  using TT = TypeTraits<T>;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float fi = f[(i & 1)];
    typename TT::T2 v = TT::from_float2(acc_s[2 * i] * fi, acc_s[2 * i + 1] * fi);
    rp[i] = *reinterpret_cast<uint32_t*>(&v);
  }
}
// the same P into a [64 x 64] K-major swizzled tile (A operand of the other warpgroup)
template <typename T>
__device__ inline void seesaw_store_p(T* sP, const uint32_t (&rp)[16], const int (&row_local)[2], int lane) {
  using L = Gmma128Tile64;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int n = i / 2, h = i & 1;
    const int col = n * 8 + (lane % 4) * 2;
    *reinterpret_cast<uint32_t*>(sP + L::offset(row_local[h], col)) = rp[i];
  }
}
// O += P V over warpgroup wg's 256 channels (column blocks 4 wg .. 4 wg + 3) of stage `st`, P in registers
template <typename T>
__device__ inline void seesaw_pv_rs(float (&acc_o)[128], const uint32_t (&rp)[16], const T* st, int wg) {
  using RS = GmmaRS<T>;
  const uint64_t dv = seesaw_desc_v(st + (4 * wg) * 64 * 64);
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    const uint64_t off = (uint64_t)((kt * 16 * 64 * (int)sizeof(T)) >> 4);
    gmma_rs_call<typename RS::PV>(rp + 4 * kt, dv + off, acc_o, true, std::make_index_sequence<128>{});
  }
}
// the same with P in shared memory (the other warpgroup's)
template <typename T>
__device__ inline void seesaw_pv_ss(float (&acc_o)[128], const T* sP, const T* st, int wg) {
  using SS = Gmma<T>;
  const uint64_t dp = seesaw_desc(sP), dv = seesaw_desc_v(st + (4 * wg) * 64 * 64);
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    const uint64_t off_p = (uint64_t)((kt * 16 * (int)sizeof(T)) >> 4);
    const uint64_t off_v = (uint64_t)((kt * 16 * 64 * (int)sizeof(T)) >> 4);
    gmma_call<typename SS::PV>(dp + off_p, dv + off_v, acc_o, true, std::make_index_sequence<128>{});
  }
}

// Causal: warpgroup wg's V columns (blocks 4 wg .. 4 wg + 4) of the keys some row of the tile at t0 (in `stage`; the
// item's tokens end at tok_end) does not see, non-finite values to 0 (loads.cuh, clean_hidden_rows), then a sync of
// the warpgroup; the tile's S must be done. kMask (the softmax's): a tile followed by tile j + 2 has >= 65 tokens of
// the item after it, so none of its keys is hidden (q_len <= kMaxQLen): the steady-state pair holds no cleaning code.
template <typename T, bool kMask>
__device__ inline void seesaw_fix_hidden(T* stage, int t0, int tok_end, int unmasked_end, int causal, int tid_wg,
                                         int wg) {
  if constexpr (!kMask) return;
  if (causal && t0 + Cfg::kBlockN > unmasked_end) {
    clean_hidden_rows<T>(stage, max(unmasked_end - t0, 0), min(Cfg::kBlockN, tok_end - t0), tid_wg, 128, 4 * wg, 4);
    fence_proxy_async_smem();
    named_barrier(SeesawPair::kBarWg + wg, 128);
  }
}

}  // namespace mla_sm90
