// The decode kernels of q dtype bf16 over a bf16 cache (launch_mainloop.cuh).
#include "../launch_mainloop.cuh"

namespace mla_sm90 {
MLA_SM90_INSTANTIATE_LAUNCH(__nv_bfloat16, kKvSameAsQ)
}  // namespace mla_sm90
