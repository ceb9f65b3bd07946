// The constants and shared memory of the paired-tile schedule (the "seesaw" of FlashMLA's SM90 kernel), shared by
// mainloops seesaw (seesaw/seesaw.cuh) and seesaw_fp8 (seesaw_fp8/seesaw_fp8.cuh, the same schedule with a converting
// warpgroup): the column blocks of a tile, the consumers' named barriers and the layout after Q, K and P.
#pragma once
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
  static constexpr int kSmemBytes = 2 * (Cfg::kQElems + Cfg::kStages * Cfg::kKElems + Cfg::kPElems) +
                                    7 * Cfg::kBlockM * (int)sizeof(float) + kBars * 8 + kBadFlags * 4 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the SM90 per-block limit");
};

}  // namespace mla_sm90
