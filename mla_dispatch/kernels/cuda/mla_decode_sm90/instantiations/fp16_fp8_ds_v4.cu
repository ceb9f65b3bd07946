// The decode kernel of q dtype fp16 over an fp8_ds_v4 cache (DeepSeek-V4; launch_mainloop.cuh: v2's sparse instance).
#include "../launch_mainloop.cuh"

namespace mla_sm90 {
MLA_SM90_INSTANTIATE_LAUNCH(__half, kKvFp8DsV4)
}  // namespace mla_sm90
