// Host launcher of mainloop etap (mainloops.h): one tile of 16 or 32 rows (LaunchConfig::tile_rows) per KV head; KV
// by TMA (16-bit caches, whole-tile pages: LaunchConfig::tma_loads) or cp.async, fp8 caches through registers and
// 16 rows only (kEtapFp8MaxRows); sparse launches (DecodeParams::sparse) over fp8 caches, fp8_ds_v4 among them, in
// as many 16-row tiles as the rows need (grid y).
#pragma once
#include "common/launch.cuh"
#include "etap/etap.cuh"
#include "mainloops.h"

namespace mla_sm90 {

static_assert(2 * Etap::kSmemBytes > kSmemPerSm, "one CTA per SM");

template <typename T, int kN, int KvFmt>
int launch_etap_rows(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  const dim3 grid(p.num_parts, (p.rows_per_kv_head + kN - 1) / kN, p.heads_kv);  // row tiles: one unless sparse
  CUtensorMap map{};
  if constexpr (KvFmt == kKvSameAsQ) {
    if (cfg.tma_loads) {
      if (!cached_kv_map<T>(p, &map)) return kLaunchNoTensorMap;
      return launch_kernel(mla_decode_etap<T, kN, true>, grid, DecodeConfig::kThreads, Etap::kSmemBytes, cfg, stream,
                           p, map);
    }
  } else if (p.sparse) {
    return launch_kernel(mla_decode_etap<T, kN, false, KvFmt, true>, grid, DecodeConfig::kThreads, Etap::kSmemBytes,
                         cfg, stream, p, map);
  }
  if constexpr (KvFmt != kKvFp8DsV4)
    return launch_kernel(mla_decode_etap<T, kN, false, KvFmt>, grid, DecodeConfig::kThreads, Etap::kSmemBytes, cfg,
                         stream, p, map);
  return cudaErrorInvalidValue;  // fp8_ds_v4 decodes sparse only
}

template <typename T, int KvFmt>
int launch_etap(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  const bool rows16 = cfg.tile_rows == 16;
  if constexpr (KvFmt == kKvSameAsQ) {
    if (p.sparse) return cudaErrorInvalidValue;  // sparse: fp8 caches only
    return rows16 ? launch_etap_rows<T, 16, KvFmt>(p, cfg, stream) : launch_etap_rows<T, 32, KvFmt>(p, cfg, stream);
  } else if (rows16) {  // fp8 caches: 16 rows (kEtapFp8MaxRows)
    return launch_etap_rows<T, 16, KvFmt>(p, cfg, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace mla_sm90
