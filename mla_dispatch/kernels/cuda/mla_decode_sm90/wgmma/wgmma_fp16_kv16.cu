// The wgmma kernel instances of q dtype fp16 over a fp16 cache (wgmma/launch.cuh).
#include "wgmma/launch.cuh"

namespace mla_sm90 {
template int launch_wgmma<__half, kKvSameAsQ>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
