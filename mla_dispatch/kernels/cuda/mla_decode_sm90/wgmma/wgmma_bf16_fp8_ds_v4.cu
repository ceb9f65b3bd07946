// The wgmma kernel instances of q dtype bf16 over an fp8_ds_v4 cache (DeepSeek-V4) (wgmma/launch.cuh).
#include "wgmma/launch.cuh"

namespace mla_sm90 {
template int launch_wgmma<__nv_bfloat16, kKvFp8DsV4>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
