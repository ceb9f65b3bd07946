// Host launcher of mainloop seesaw_fp8 (mainloops.h): seesaw's schedule for fp8_e4m3 caches, the raw 64-column boxes
// by TMA, and for sparse launches over fp8_ds_mla / fp8_ds_v4 caches, the rows gathered by id; never paired.
#pragma once
#include "common/launch.cuh"
#include "mainloops.h"
#include "seesaw_fp8/seesaw_fp8.cuh"

namespace mla_sm90 {

template <typename T, int KvFmt>
int launch_seesaw_fp8(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  static_assert(KvFmt == kKvFp8E4M3 || KvFmt == kKvFp8DsMla || KvFmt == kKvFp8DsV4,
                "seesaw_fp8 reads fp8_e4m3 caches (sparse launches: fp8_ds_mla and fp8_ds_v4)");
  CUtensorMap map{};  // (a sparse launch gathers its rows by id: no tensor map)
  if (KvFmt == kKvFp8E4M3 && !cached_kv_map<uint8_t, true>(p, &map)) return kLaunchNoTensorMap;
  return launch_kernel(mla_decode_seesaw_fp8<T, KvFmt>, dim3(p.num_parts, p.num_row_tiles, p.heads_kv),
                       SeesawFp8::kThreads, SeesawPair::kSmemBytes, cfg, stream, p, map);
}

}  // namespace mla_sm90
