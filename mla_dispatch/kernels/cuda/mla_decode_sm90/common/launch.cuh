// Host side shared by the mainloops' launchers (<mainloop>/launch.cuh): the TMA descriptor of the cache, the
// shared-memory opt-in, and the launch with the plan's attributes. No torch here, so CI can compile with nvcc alone.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

#include "common/traits.cuh"
#include "params.h"

namespace mla_sm90 {

// The shared memory of an SM: every decode kernel takes more than half of it, so one CTA per SM (each mainloop's
// launch.cuh asserts it), which the plan counts on where every CTA of a grid must be resident at once (cooperative
// launches, seesaw's clusters; backends/cuda_sm90.py, launch_config).
constexpr int kSmemPerSm = 228 * 1024;

// The driver's cuTensorMapEncodeTiled through the runtime (no -lcuda at link time).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q);
#else  // CUDA 12.4: the unversioned lookup (removed in CUDA 13)
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// seesaw's (and etap's) view of a bf16/fp16 cache [num_blocks, page_size, h_kv, 576] as a 4-D tensor
// (576, h_kv, page_size, num_blocks), boxes of 64 columns x 64 tokens, 128-byte swizzle; with T = uint8_t
// fp8t_regs' view of an fp8_e4m3 cache, boxes of 128 columns (the last one's upper half past column 575: zeros);
// with kRaw64 (T = uint8_t) seesaw_fp8's: boxes of 64 columns x 64 tokens, unswizzled (seesaw_fp8/seesaw_fp8.cuh,
// seesaw_fp8_converter). False when TMA cannot address it (alignment, strides, no driver entry point).
template <typename T, bool kRaw64 = false>
bool make_kv_map(const DecodeParams& p, CUtensorMap* map) {
  static_assert(!kRaw64 || sizeof(T) == 1, "raw boxes are of an fp8 cache");
  const auto encode = tensor_map_encoder();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(p.kv) % 16 != 0) return false;
  const cuuint64_t e = sizeof(T);
  const cuuint64_t dims[4] = {(cuuint64_t)DecodeConfig::kHeadDimQK, (cuuint64_t)p.heads_kv, (cuuint64_t)p.page_size,
                              (cuuint64_t)p.num_blocks};
  const cuuint64_t strides[3] = {(cuuint64_t)p.kv_stride_head * e, (cuuint64_t)p.kv_stride_tok * e,
                                 (cuuint64_t)p.kv_stride_block * e};
  for (cuuint64_t s : strides)
    if (s % 16 != 0 || s >= (cuuint64_t(1) << 40)) return false;
  const cuuint32_t box[4] = {kRaw64 ? 64u : (cuuint32_t)(128 / sizeof(T)), 1, (cuuint32_t)DecodeConfig::kBlockN, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  if constexpr (sizeof(T) == 2)
    dtype = TypeTraits<T>::kIsBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encode(map, dtype, 4, const_cast<void*>(p.kv), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, kRaw64 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// make_kv_map once per cache: a decode step launches once per layer over the same few caches, and each
// encode is host work in front of the launch. The key holds every input of the encode, so an entry is right
// for any tensor with that address, shape, strides and dtype (T: one cache per dtype).
struct KvMapKey {
  const void* kv;
  int64_t num_blocks, stride_block, stride_tok, stride_head;
  int heads_kv, page_size;
  bool operator==(const KvMapKey& o) const {
    return kv == o.kv && num_blocks == o.num_blocks && stride_block == o.stride_block && stride_tok == o.stride_tok &&
           stride_head == o.stride_head && heads_kv == o.heads_kv && page_size == o.page_size;
  }
};
struct KvMapKeyHash {
  size_t operator()(const KvMapKey& k) const {
    size_t h = std::hash<const void*>()(k.kv);
    for (int64_t v : {k.num_blocks, k.stride_block, k.stride_tok, k.stride_head, (int64_t)k.heads_kv,
                      (int64_t)k.page_size})
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

template <typename T, bool kRaw64 = false>
bool cached_kv_map(const DecodeParams& p, CUtensorMap* map) {
  static std::mutex mu;
  static std::unordered_map<KvMapKey, CUtensorMap, KvMapKeyHash> cache;
  const KvMapKey key{p.kv, p.num_blocks, p.kv_stride_block, p.kv_stride_tok, p.kv_stride_head, p.heads_kv,
                     p.page_size};
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = cache.find(key);
    if (it != cache.end()) {
      *map = it->second;
      return true;
    }
  }
  if (!make_kv_map<T, kRaw64>(p, map)) return false;
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() >= 4096) cache.clear();  // bound the memory where caches come and go
  cache.emplace(key, *map);
  return true;
}

// Allow `kernel` `bytes` of dynamic shared memory (over the default 48 KB) on the current device.
// cudaFuncSetAttribute acts on the current device's context only, so the opt-in is remembered per
// (device, kernel): a process that launches on a second GPU opts in there too.
inline cudaError_t opt_in_smem(const void* kernel, int bytes) {
  static std::mutex mu;
  static std::set<std::pair<int, const void*>> done;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const auto key = std::make_pair(dev, kernel);
  std::lock_guard<std::mutex> lock(mu);
  if (done.count(key)) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) done.insert(key);
  return e;
}

// Launch `kernel` over `grid` with the config's attributes: a cooperative launch where it merges the split rows
// itself (combine_in_grid after a grid-wide barrier: every CTA resident at once), clusters of two along y where
// seesaw's row tiles are paired.
template <typename... Args>
cudaError_t launch_kernel(void (*kernel)(DecodeParams, Args...), dim3 grid, int threads, int smem_bytes,
                                 const LaunchConfig& cfg, cudaStream_t stream, const DecodeParams& p, Args... args) {
  const cudaError_t e = opt_in_smem(reinterpret_cast<const void*>(kernel), smem_bytes);
  if (e != cudaSuccess) return e;
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t launch{};
  launch.gridDim = grid;
  launch.blockDim = dim3(threads);
  launch.dynamicSmemBytes = smem_bytes;
  launch.stream = stream;
  launch.attrs = attr;
  if (cfg.fuse_combine) {
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
    launch.numAttrs = 1;
  } else if (cfg.paired) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 1;
    attr[0].val.clusterDim.y = 2;
    attr[0].val.clusterDim.z = 1;
    launch.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&launch, kernel, p, args...);
}

}  // namespace mla_sm90
