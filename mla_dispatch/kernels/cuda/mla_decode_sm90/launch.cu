// Host launchers of the SM90 MLA decode family: the kernel instance of the plan's launch config (params.h,
// LaunchConfig) for (q dtype, kv format), and the split-KV combine. A config the kernels do not take is the
// binding's to refuse (binding.cpp, check_config); nothing here chooses another kernel. The instances themselves
// are compiled one (q dtype, kv format) per translation unit (instantiations/, launch_mainloop.cuh). No torch here,
// so CI can compile this translation unit with nvcc alone.
#include <cuda_runtime.h>

#include "common/combine.cuh"
#include "params.h"

namespace mla_sm90 {

// Defined in launch_mainloop.cuh, instantiated in instantiations/*.cu.
template <typename T, int KvFmt>
int launch_mainloop(const DecodeParams& p, const LaunchConfig& cfg, cudaStream_t stream);

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
