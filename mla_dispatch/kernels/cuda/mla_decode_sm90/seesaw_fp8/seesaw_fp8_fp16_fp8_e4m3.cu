// The seesaw_fp8 kernel instances of q dtype fp16 over an fp8_e4m3 cache (seesaw_fp8/launch.cuh).
#include "seesaw_fp8/launch.cuh"

namespace mla_sm90 {
template int launch_seesaw_fp8<__half, kKvFp8E4M3>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
