// The fp8t_convert kernel instances of q dtype fp16 over an fp8_e4m3 cache (fp8t/launch.cuh), dense and sparse.
#include "fp8t/launch.cuh"

namespace mla_sm90 {
template int launch_fp8t_convert<__half, kKvFp8E4M3>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
