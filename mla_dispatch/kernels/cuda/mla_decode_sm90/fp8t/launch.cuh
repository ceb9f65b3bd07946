// Host launchers of mainloops fp8t_convert and fp8t_regs (mainloops.h): fp8_e4m3 caches, 16 or 32 query rows per KV
// head (LaunchConfig::tile_rows), three warpgroups; fp8t_convert's sparse launches (DecodeParams::sparse) over any
// fp8 cache, fp8_ds_v4 among them.
#pragma once
#include "common/launch.cuh"
#include "fp8t/fp8t_convert.cuh"
#include "fp8t/fp8t_regs.cuh"
#include "mainloops.h"

namespace mla_sm90 {

static_assert(2 * Fp8tSmem<false>::kSmemBytes > kSmemPerSm && 2 * Fp8tSmem<true>::kSmemBytes > kSmemPerSm,
              "one CTA per SM");

template <typename T, int kN, int KvFmt, bool kSparse>
int launch_fp8t_convert_rows(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  return launch_kernel(mla_decode_fp8t_convert<T, kN, KvFmt, kSparse>, dim3(p.num_parts, 1, p.heads_kv),
                       Fp8t::kThreads, Fp8tSmem<false>::kSmemBytes, cfg, stream, p);
}

// fp8t_regs: the raw tile by TMA (128-column boxes).
template <typename T, int kN>
int launch_fp8t_regs_rows(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  CUtensorMap map;
  if (!cached_kv_map<uint8_t>(p, &map)) return kLaunchNoTensorMap;
  return launch_kernel(mla_decode_fp8t_regs<T, kN>, dim3(p.num_parts, 1, p.heads_kv), Fp8t::kThreads,
                       Fp8tSmem<true>::kSmemBytes, cfg, stream, p, map);
}

template <typename T, int KvFmt>
int launch_fp8t_convert(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  static_assert(KvFmt != kKvSameAsQ, "fp8t_convert reads fp8 caches");
  if (p.sparse)
    return cfg.tile_rows == 16 ? launch_fp8t_convert_rows<T, 16, KvFmt, true>(p, cfg, stream)
                               : launch_fp8t_convert_rows<T, 32, KvFmt, true>(p, cfg, stream);
  if constexpr (KvFmt == kKvFp8E4M3)
    return cfg.tile_rows == 16 ? launch_fp8t_convert_rows<T, 16, KvFmt, false>(p, cfg, stream)
                               : launch_fp8t_convert_rows<T, 32, KvFmt, false>(p, cfg, stream);
  return cudaErrorInvalidValue;  // dense launches: fp8_e4m3 only
}

template <typename T, int KvFmt>
int launch_fp8t_regs(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  static_assert(KvFmt == kKvFp8E4M3, "fp8t_regs reads fp8_e4m3 caches");
  return cfg.tile_rows == 16 ? launch_fp8t_regs_rows<T, 16>(p, cfg, stream)
                             : launch_fp8t_regs_rows<T, 32>(p, cfg, stream);
}

}  // namespace mla_sm90
