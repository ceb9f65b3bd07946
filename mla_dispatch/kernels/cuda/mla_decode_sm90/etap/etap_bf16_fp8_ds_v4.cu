// The etap kernel instances of q dtype bf16 over an fp8_ds_v4 cache (DeepSeek-V4; sparse only) (etap/launch.cuh).
#include "etap/launch.cuh"

namespace mla_sm90 {
template int launch_etap<__nv_bfloat16, kKvFp8DsV4>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
