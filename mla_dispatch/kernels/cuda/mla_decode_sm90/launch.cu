// Host launchers of the SM90 MLA decode family: the plan's launch config (params.h, LaunchConfig) on its mainloop's
// launcher (mainloops.h: one folder per mainloop, its kernel instances compiled one (q dtype, kv format) per
// translation unit), and the split-KV combine. A config the kernels do not take is the binding's to refuse
// (binding.cpp, check_config); nothing here chooses another kernel. No torch here, so CI can compile this
// translation unit with nvcc alone.
#include <cuda_runtime.h>

#include "common/combine.cuh"
#include "mainloops.h"
#include "params.h"

namespace mla_sm90 {

// cfg's mainloop for q dtype T and cache format KvFmt: the pairs each mainloop takes (its folder's instantiation
// files); any other ends in cudaErrorInvalidValue.
template <typename T, int KvFmt>
static int launch_mainloop(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  constexpr bool k16Bit = KvFmt == kKvSameAsQ, kE4M3 = KvFmt == kKvFp8E4M3;
  switch (cfg.mainloop) {
    case kWgmma:
      return launch_wgmma<T, KvFmt>(p, cfg, stream);
    case kSeesaw:
      if constexpr (k16Bit) return launch_seesaw<T, KvFmt>(p, cfg, stream);
      break;
    case kEtap:
      return launch_etap<T, KvFmt>(p, cfg, stream);
    case kFp8tConvert:  // dense: fp8_e4m3; sparse: any fp8 cache
      if constexpr (!k16Bit) return launch_fp8t_convert<T, KvFmt>(p, cfg, stream);
      break;
    case kFp8tRegs:
      if constexpr (kE4M3) return launch_fp8t_regs<T, KvFmt>(p, cfg, stream);
      break;
    case kSeesawFp8:  // dense: fp8_e4m3; sparse: fp8_ds_mla, fp8_ds_v4
      if constexpr (!k16Bit) return launch_seesaw_fp8<T, KvFmt>(p, cfg, stream);
      break;
  }
  return cudaErrorInvalidValue;
}

template <typename T>
static int launch_format(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream) {
  switch (p.kv_format) {
    case kKvSameAsQ: return launch_mainloop<T, kKvSameAsQ>(p, cfg, stream);
    case kKvFp8E4M3: return launch_mainloop<T, kKvFp8E4M3>(p, cfg, stream);
    case kKvFp8DsMla: return launch_mainloop<T, kKvFp8DsMla>(p, cfg, stream);
    case kKvFp8DsV4: return launch_mainloop<T, kKvFp8DsV4>(p, cfg, stream);
    default: return cudaErrorInvalidValue;
  }
}

int launch_decode(const DecodeParams& params, const LaunchConfig& cfg, void* stream) {
  DecodeParams p = params;
  p.fuse_combine = cfg.fuse_combine ? 1 : 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return p.q_is_bf16 ? launch_format<__nv_bfloat16>(p, cfg, s) : launch_format<__half>(p, cfg, s);
}

int launch_combine(const CombineParams& p, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int rows = p.q_len * p.heads_q;
  // one part: nothing is split (a balanced schedule; a batch-invariant one splits requests inside a part)
  if (p.batch == 0 || rows == 0 || (p.num_parts <= 1 && !p.fixed_splits)) return 0;
  // one block row per request, or per part boundary where there are fewer boundaries (combine.cuh; a balanced
  // schedule only)
  const bool by_boundary = !p.fixed_splits && p.num_parts - 1 < p.batch;
  dim3 grid(rows, by_boundary ? p.num_parts - 1 : p.batch);
  if (p.q_is_bf16)
    by_boundary ? mla_combine_kernel<__nv_bfloat16, true><<<grid, kCombineThreads, 0, s>>>(p)
                : mla_combine_kernel<__nv_bfloat16, false><<<grid, kCombineThreads, 0, s>>>(p);
  else
    by_boundary ? mla_combine_kernel<__half, true><<<grid, kCombineThreads, 0, s>>>(p)
                : mla_combine_kernel<__half, false><<<grid, kCombineThreads, 0, s>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace mla_sm90
