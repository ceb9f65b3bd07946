// The etap kernel instances of q dtype bf16 over a bf16 cache (etap/launch.cuh).
#include "etap/launch.cuh"

namespace mla_sm90 {
template int launch_etap<__nv_bfloat16, kKvSameAsQ>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
