// Host launcher of mainloop seesaw (mainloops.h): bf16/fp16 caches by TMA, the row tiles of a part alone or paired in
// clusters (LaunchConfig::paired).
#pragma once
#include "common/launch.cuh"
#include "mainloops.h"
#include "seesaw/seesaw.cuh"

namespace mla_sm90 {

static_assert(2 * SeesawPair::kSmemBytes > kSmemPerSm, "one CTA per SM");

template <typename T, int KvFmt>
int launch_seesaw(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  static_assert(KvFmt == kKvSameAsQ, "seesaw reads bf16/fp16 caches");
  CUtensorMap map;
  if (!cached_kv_map<T>(p, &map)) return kLaunchNoTensorMap;
  const dim3 grid(p.num_parts, p.num_row_tiles, p.heads_kv);
  if (cfg.paired)
    return launch_kernel(mla_decode_seesaw<T, true>, grid, DecodeConfig::kThreads, SeesawPair::kSmemBytes, cfg, stream,
                         p, map);
  return launch_kernel(mla_decode_seesaw<T, false>, grid, DecodeConfig::kThreads, SeesawPair::kSmemBytes, cfg, stream,
                       p, map);
}

}  // namespace mla_sm90
