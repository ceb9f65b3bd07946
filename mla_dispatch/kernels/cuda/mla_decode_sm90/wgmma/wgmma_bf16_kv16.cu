// The wgmma kernel instances of q dtype bf16 over a bf16 cache (wgmma/launch.cuh).
#include "wgmma/launch.cuh"

namespace mla_sm90 {
template int launch_wgmma<__nv_bfloat16, kKvSameAsQ>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
