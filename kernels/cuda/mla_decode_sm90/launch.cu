// Host launchers of the SM90 MLA decode family: pick the template instance for
// (q dtype, kv format), set the shared-memory limit, launch, return the error.
// No torch here, so CI can compile this translation unit with nvcc alone.
#include <cuda_runtime.h>

#include "combine.cuh"
#include "mainloop.cuh"
#include "mainloop_wgmma.cuh"
#include "params.h"

namespace mla_sm90 {

int decode_smem_bytes() { return DecodeConfig::kSmemBytes; }

template <typename T, int KvFmt>
static cudaError_t launch_decode_t(const DecodeParams& p, int grid_parts, cudaStream_t stream) {
  // variant 1: warp-level mma.sync (mainloop.cuh); 2: wgmma (mainloop_wgmma.cuh);
  // 3: wgmma with S of tile j+1 issued under PV of tile j (mainloop_wgmma.cuh, kOverlap)
  // 4: wgmma with S split along D_qk between the warpgroups (mainloop_wgmma.cuh, kKSplit;
  //    bf16/fp16 caches only, fp8 caches run v2)
  auto kernel = p.variant == 1   ? mla_decode_kernel_v1<T, KvFmt>
                : p.variant == 3 ? mla_decode_kernel_v2<T, KvFmt, true>
                : p.variant == 4 ? mla_decode_kernel_v2<T, KvFmt, false, KvFmt == kKvSameAsQ>
                                 : mla_decode_kernel_v2<T, KvFmt, false>;
  const int vi = p.variant == 1 ? 0 : p.variant == 3 ? 2 : p.variant == 4 ? 3 : 1;
  static bool configured[4] = {false, false, false, false};  // per instantiation; a benign race sets the same value
  if (!configured[vi]) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, DecodeConfig::kSmemBytes);
    if (e != cudaSuccess) return e;
    configured[vi] = true;
  }
  dim3 grid(grid_parts, p.num_row_tiles, p.heads_kv);
  kernel<<<grid, DecodeConfig::kThreads, DecodeConfig::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
static cudaError_t launch_decode_fmt(const DecodeParams& p, int grid_parts, cudaStream_t stream) {
  switch (p.kv_format) {
    case kKvSameAsQ: return launch_decode_t<T, kKvSameAsQ>(p, grid_parts, stream);
    case kKvFp8E4M3: return launch_decode_t<T, kKvFp8E4M3>(p, grid_parts, stream);
    case kKvFp8DsMla: return launch_decode_t<T, kKvFp8DsMla>(p, grid_parts, stream);
    default: return cudaErrorInvalidValue;
  }
}

int launch_decode(const DecodeParams& p, int grid_parts, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return p.q_is_bf16 ? launch_decode_fmt<__nv_bfloat16>(p, grid_parts, s) : launch_decode_fmt<__half>(p, grid_parts, s);
}

int launch_combine(const CombineParams& p, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int rows = p.q_len * p.heads_q;
  if (p.batch == 0 || rows == 0) return 0;
  dim3 grid(rows, p.batch);
  if (p.q_is_bf16)
    mla_combine_kernel<__nv_bfloat16><<<grid, kCombineThreads, 0, s>>>(p);
  else
    mla_combine_kernel<__half><<<grid, kCombineThreads, 0, s>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace mla_sm90
