// The seesaw kernel instances of q dtype fp16 over a fp16 cache (seesaw/launch.cuh).
#include "seesaw/launch.cuh"

namespace mla_sm90 {
template int launch_seesaw<__half, kKvSameAsQ>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
