// The mainloops' host launchers (config.h, Mainloop), one folder each: <mainloop>/launch.cuh defines
// launch_<mainloop><T, KvFmt>, which runs the plan's launch config (params.h, LaunchConfig) with that mainloop's kernel
// instance for q dtype T and cache format KvFmt, and <mainloop>/<dtype>_<format>.cu instantiates it for each pair the
// mainloop takes (launch.cu calls no others). Each returns 0, a cudaError_t value or kLaunchNoTensorMap; a config its
// instances do not take (the binding refuses it first: binding.cpp, check_config) ends in cudaErrorInvalidValue.
#pragma once
#include <cuda_runtime.h>

#include "params.h"

namespace mla_sm90 {

#define MLA_SM90_DECLARE_LAUNCHER(name)     \
  template <typename T, int KvFmt>          \
  int name(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream);

MLA_SM90_DECLARE_LAUNCHER(launch_wgmma)         // wgmma/: any cache (fp8_ds_v4: its sparse instance only)
MLA_SM90_DECLARE_LAUNCHER(launch_seesaw)        // seesaw/: bf16/fp16 caches
MLA_SM90_DECLARE_LAUNCHER(launch_etap)          // etap/: any cache (fp8_ds_v4: sparse only; sparse: fp8 caches)
MLA_SM90_DECLARE_LAUNCHER(launch_fp8t_convert)  // fp8t/: fp8_e4m3 caches (sparse: any fp8 cache)
MLA_SM90_DECLARE_LAUNCHER(launch_fp8t_regs)     // fp8t/: fp8_e4m3 caches
MLA_SM90_DECLARE_LAUNCHER(launch_seesaw_fp8)    // seesaw_fp8/: fp8_e4m3 caches (sparse: fp8_ds_mla, fp8_ds_v4)

#undef MLA_SM90_DECLARE_LAUNCHER

}  // namespace mla_sm90
