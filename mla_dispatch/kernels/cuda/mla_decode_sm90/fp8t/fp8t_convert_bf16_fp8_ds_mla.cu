// The fp8t_convert kernel instances of q dtype bf16 over an fp8_ds_mla cache (fp8t/launch.cuh): sparse launches only.
#include "fp8t/launch.cuh"

namespace mla_sm90 {
template int launch_fp8t_convert<__nv_bfloat16, kKvFp8DsMla>(const DecodeParams&, const LaunchConfig&, cudaStream_t);
}  // namespace mla_sm90
