// The decode kernels of q dtype bf16 over an fp8_ds_mla cache (launch_mainloop.cuh).
#include "../launch_mainloop.cuh"

namespace mla_sm90 {
MLA_SM90_INSTANTIATE_LAUNCH(__nv_bfloat16, kKvFp8DsMla)
}  // namespace mla_sm90
