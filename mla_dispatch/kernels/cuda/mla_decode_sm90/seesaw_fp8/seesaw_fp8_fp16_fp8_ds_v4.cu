// The seesaw_fp8 kernel instances of q dtype fp16 over an fp8_ds_v4 cache, sparse only (seesaw_fp8/launch.cuh).
#include "seesaw_fp8/launch.cuh"

namespace mla_sm90 {
template int launch_seesaw_fp8<__half, kKvFp8DsV4>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
