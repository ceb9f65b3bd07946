// The etap kernel instances of q dtype fp16 over an fp8_e4m3 cache (etap/launch.cuh).
#include "etap/launch.cuh"

namespace mla_sm90 {
template int launch_etap<__half, kKvFp8E4M3>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
