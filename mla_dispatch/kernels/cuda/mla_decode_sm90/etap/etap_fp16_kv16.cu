// The etap kernel instances of q dtype fp16 over a fp16 cache (etap/launch.cuh).
#include "etap/launch.cuh"

namespace mla_sm90 {
template int launch_etap<__half, kKvSameAsQ>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
