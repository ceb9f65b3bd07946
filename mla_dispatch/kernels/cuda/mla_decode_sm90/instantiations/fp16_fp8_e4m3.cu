// The decode kernels of q dtype fp16 over an fp8_e4m3 cache (launch_mainloop.cuh).
#include "../launch_mainloop.cuh"

namespace mla_sm90 {
MLA_SM90_INSTANTIATE_LAUNCH(__half, kKvFp8E4M3)
}  // namespace mla_sm90
