// The seesaw kernel instances of q dtype bf16 over a bf16 cache (seesaw/launch.cuh).
#include "seesaw/launch.cuh"

namespace mla_sm90 {
template int launch_seesaw<__nv_bfloat16, kKvSameAsQ>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
