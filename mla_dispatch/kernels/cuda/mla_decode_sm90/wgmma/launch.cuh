// Host launcher of mainloop wgmma (mainloops.h): 64-row tiles, any cache; its sparse instance for sparse launches
// (DecodeParams::sparse), the only one over fp8_ds_v4 caches (DeepSeek-V4 decodes sparse).
#pragma once
#include "common/launch.cuh"
#include "mainloops.h"
#include "wgmma/wgmma.cuh"

namespace mla_sm90 {

static_assert(2 * DecodeConfig::kSmemBytes > kSmemPerSm, "one CTA per SM");

template <typename T, int KvFmt>
int launch_wgmma(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  const dim3 grid(p.num_parts, p.num_row_tiles, p.heads_kv);
  if constexpr (KvFmt == kKvFp8DsV4) {
    if (!p.sparse) return cudaErrorInvalidValue;
    return launch_kernel(mla_decode_wgmma<T, KvFmt, true>, grid, DecodeConfig::kThreads, DecodeConfig::kSmemBytes, cfg,
                         stream, p);
  } else {
    if (p.sparse)
      return launch_kernel(mla_decode_wgmma<T, KvFmt, true>, grid, DecodeConfig::kThreads, DecodeConfig::kSmemBytes,
                           cfg, stream, p);
    return launch_kernel(mla_decode_wgmma<T, KvFmt, false>, grid, DecodeConfig::kThreads, DecodeConfig::kSmemBytes,
                         cfg, stream, p);
  }
}

}  // namespace mla_sm90
