// Host launcher of mainloop etap (mainloops.h): one tile of 16 or 32 rows (LaunchConfig::tile_rows) per KV head; KV
// by TMA (16-bit caches, whole-tile pages: LaunchConfig::tma_loads) or cp.async, fp8 caches through registers and
// 16 rows only (kEtapFp8MaxRows).
#pragma once
#include "common/launch.cuh"
#include "etap/etap.cuh"
#include "mainloops.h"

namespace mla_sm90 {

static_assert(2 * Etap::kSmemBytes > kSmemPerSm, "one CTA per SM");

template <typename T, int kN, int KvFmt>
int launch_etap_rows(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  const dim3 grid(p.num_parts, 1, p.heads_kv);
  CUtensorMap map{};
  if constexpr (KvFmt == kKvSameAsQ) {
    if (cfg.tma_loads) {
      if (!cached_kv_map<T>(p, &map)) return kLaunchNoTensorMap;
      return launch_kernel(mla_decode_etap<T, kN, true>, grid, DecodeConfig::kThreads, Etap::kSmemBytes, cfg, stream,
                           p, map);
    }
  }
  return launch_kernel(mla_decode_etap<T, kN, false, KvFmt>, grid, DecodeConfig::kThreads, Etap::kSmemBytes, cfg,
                       stream, p, map);
}

template <typename T, int KvFmt>
int launch_etap(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  static_assert(KvFmt != kKvFp8DsV4, "etap does not read fp8_ds_v4 caches");
  const bool rows16 = cfg.tile_rows == 16;
  if constexpr (KvFmt == kKvSameAsQ)
    return rows16 ? launch_etap_rows<T, 16, KvFmt>(p, cfg, stream) : launch_etap_rows<T, 32, KvFmt>(p, cfg, stream);
  else if (rows16)  // fp8 caches: 16 rows (kEtapFp8MaxRows)
    return launch_etap_rows<T, 16, KvFmt>(p, cfg, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mla_sm90
