// Host launchers of the SM90 MLA decode family: pick the template instance for
// (q dtype, kv format), set the shared-memory limit, launch, return the error.
// No torch here, so CI can compile this translation unit with nvcc alone.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

#include "combine.cuh"
#include "mainloop_etap.cuh"
#include "mainloop_fp8t.cuh"
#include "mainloop_seesaw.cuh"
#include "mainloop_wgmma.cuh"
#include "params.h"

namespace mla_sm90 {

int decode_smem_bytes() {
  int b = Seesaw::kSmemBytes > DecodeConfig::kSmemBytes ? Seesaw::kSmemBytes : DecodeConfig::kSmemBytes;
  b = Etap::kSmemBytes > b ? Etap::kSmemBytes : b;
  b = Fp8tSmem<false>::kSmemBytes > b ? Fp8tSmem<false>::kSmemBytes : b;
  return Fp8tSmem<true>::kSmemBytes > b ? Fp8tSmem<true>::kSmemBytes : b;
}

// The driver's cuTensorMapEncodeTiled through the runtime (no -lcuda at link time).
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
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

// Variant 5's view of a bf16/fp16 cache [num_blocks, page_size, h_kv, 576] as a 4-D tensor
// (576, h_kv, page_size, num_blocks), boxes of 64 columns x 64 tokens, 128-byte swizzle; with T = uint8_t
// variant 8's view of an fp8_e4m3 cache, boxes of 128 columns (the last one's upper half past column 575: zeros);
// with kRaw64 (T = uint8_t) variant 9's: boxes of 64 columns x 64 tokens, unswizzled (mainloop_seesaw.cuh,
// seesaw_fp8_converter). False when TMA cannot address it (alignment, strides, no driver entry point).
template <typename T, bool kRaw64 = false>
static bool make_kv_map(const DecodeParams& p, CUtensorMap* map) {
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
static bool cached_kv_map(const DecodeParams& p, CUtensorMap* map) {
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

// Blocks of `kernel` the whole of device `dev` holds at once for a cooperative launch (0: none; cached
// per device and kernel, the queries are not free).
static int64_t coresident_blocks(int dev, const void* kernel, int threads, int smem_bytes) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, int64_t> cache;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(dev, kernel);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int coop = 0, sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes) !=
          cudaSuccess) {
    cudaGetLastError();
    coop = 0;
  }
  const int64_t n = coop ? (int64_t)sms * per_sm : 0;
  cache.emplace(key, n);
  return n;
}

// Allow `kernel` `bytes` of dynamic shared memory (over the default 48 KB) on the current device.
// cudaFuncSetAttribute acts on the current device's context only, so the opt-in is remembered per
// (device, kernel): a process that launches on a second GPU opts in there too. The device goes to *dev_out if given.
static cudaError_t opt_in_smem(const void* kernel, int bytes, int* dev_out = nullptr) {
  static std::mutex mu;
  static std::set<std::pair<int, const void*>> done;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev_out) *dev_out = dev;
  const auto key = std::make_pair(dev, kernel);
  std::lock_guard<std::mutex> lock(mu);
  if (done.count(key)) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) done.insert(key);
  return e;
}

// Launch a decode kernel. With p.fuse_combine the kernel merges the split rows itself after a
// grid-wide barrier (combine.cuh), which needs every CTA resident at once: that is a cooperative
// launch, possible when the grid fits the GPU (the persistent grid is sized to it, except when
// h_kv x row tiles alone exceed the SM count), on a device that supports it. The v2 kernel (also
// wherever v5 or v6 fall back to it), v6, v7 and v8 have the combine tail (`has_tail`); v5 has
// none: it runs where batches are large and the second kernel measured as fast, and its code size is
// sensitive (NOTES.md). Otherwise, or if the cooperative launch itself is refused (e.g. fewer SMs under
// MPS than the device reports), the flag is cleared, *combined = false, and the caller launches the
// combine kernel.
// `threads` per CTA: DecodeConfig::kThreads (launch_grid), or v7's Fp8t::kThreads.
template <typename... Args>
static cudaError_t launch_grid_threads(void (*kernel)(DecodeParams, Args...), dim3 grid, int threads, int smem_bytes,
                                       cudaStream_t stream, bool has_tail, DecodeParams p, bool* combined,
                                       Args... args) {
  const int64_t ctas = (int64_t)grid.x * grid.y * grid.z;
  if (!has_tail || p.num_parts <= 1) p.fuse_combine = 0;  // one part: no request is split
  if (p.fuse_combine) {
    int dev = 0;
    cudaGetDevice(&dev);
    // units of the tail: < num_parts split requests x rows x 4, counted in an int with a stride of ctas x 8
    const int64_t units = (int64_t)p.num_parts * p.q_len * p.heads_q * 4 + ctas * 8;
    p.fuse_combine = p.num_parts <= kFusedMaxSplits && units < INT32_MAX &&
                     ctas <= coresident_blocks(dev, reinterpret_cast<const void*>(kernel), threads, smem_bytes);
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.fuse_combine ? 1 : 0;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, p, args...);
  if (p.fuse_combine && (e == cudaErrorCooperativeLaunchTooLarge || e == cudaErrorNotSupported)) {
    cudaGetLastError();  // clear it; launch plainly, the combine kernel follows
    p.fuse_combine = 0;
    cfg.numAttrs = 0;
    e = cudaLaunchKernelEx(&cfg, kernel, p, args...);
  }
  *combined = e == cudaSuccess && p.fuse_combine != 0;
  return e;
}

template <typename... Args>
static cudaError_t launch_grid(void (*kernel)(DecodeParams, Args...), dim3 grid, int smem_bytes, cudaStream_t stream,
                               bool has_tail, DecodeParams p, bool* combined, Args... args) {
  return launch_grid_threads(kernel, grid, DecodeConfig::kThreads, smem_bytes, stream, has_tail, p, combined, args...);
}

// A launch of v5 CTAs over `grid` in clusters of two along y (the row tiles of a part); `attr` is filled with the
// cluster shape and must outlive the launch.
static cudaLaunchConfig_t v5_pair_config(dim3 grid, cudaStream_t stream, cudaLaunchAttribute* attr) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = 1;
  attr->val.clusterDim.y = 2;
  attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(DecodeConfig::kThreads);
  cfg.dynamicSmemBytes = Seesaw::kSmemBytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// How many clusters of two v5 CTAs device `dev` holds at once (0 if the query fails); once per device,
// after the kernel's shared-memory opt-in there.
template <typename T>
static int v5_max_pairs(int dev) {
  static std::mutex mu;
  static std::map<int, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(dev);
  if (it != cache.end()) return it->second;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = v5_pair_config(dim3(1, 2, 1), nullptr, &attr);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, mla_decode_kernel_v5<T, true>, &cfg) != cudaSuccess) {
    cudaGetLastError();
    clusters = 0;
  }
  cache.emplace(dev, clusters);
  return clusters;
}

// v5 runs the two row-tile CTAs of a part as a cluster (mainloop_seesaw.cuh, kPaired) where the row tiles
// come in pairs and the whole grid fits the GPU as such clusters at once (the H100 holds 66, all 132 SMs):
// 1-6% faster on the FlashMLA grid (NOTES.md, "Eighteenth session"). Otherwise, or if the device refuses
// the cluster launch, each CTA runs alone.
template <typename T>
static cudaError_t launch_v5(const DecodeParams& p, const CUtensorMap& map, int grid_parts, cudaStream_t stream,
                             bool* combined) {
  auto alone = mla_decode_kernel_v5<T, false>;
  auto paired = mla_decode_kernel_v5<T, true>;
  int dev = 0;
  cudaError_t e = opt_in_smem(reinterpret_cast<const void*>(alone), Seesaw::kSmemBytes, &dev);
  if (e == cudaSuccess) e = opt_in_smem(reinterpret_cast<const void*>(paired), Seesaw::kSmemBytes);
  if (e != cudaSuccess) return e;
  const dim3 grid(grid_parts, p.num_row_tiles, p.heads_kv);
  const int64_t pairs = (int64_t)grid.x * grid.y * grid.z / 2;
  if (p.num_row_tiles % 2 == 0 && pairs <= v5_max_pairs<T>(dev)) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = v5_pair_config(grid, stream, &attr);
    e = cudaLaunchKernelEx(&cfg, paired, p, map);  // v5 has no combine tail: fuse_combine unread
    if (e != cudaErrorInvalidClusterSize && e != cudaErrorLaunchOutOfResources && e != cudaErrorNotSupported) {
      *combined = false;
      return e;
    }
    cudaGetLastError();  // clear it; launch without clusters
  }
  return launch_grid(alone, grid, Seesaw::kSmemBytes, stream, false, p, combined, map);
}

template <typename T, int kN, bool kTma, int KvFmt = kKvSameAsQ>
static cudaError_t launch_v6(const DecodeParams& p, const CUtensorMap& map, int grid_parts, cudaStream_t stream,
                             bool* combined) {
  auto kernel = mla_decode_kernel_v6<T, kN, kTma, KvFmt>;
  const cudaError_t e = opt_in_smem(reinterpret_cast<const void*>(kernel), Etap::kSmemBytes);
  if (e != cudaSuccess) return e;
  return launch_grid(kernel, dim3(grid_parts, 1, p.heads_kv), Etap::kSmemBytes, stream, true, p, combined, map);
}

// v6 with TMA loads where the cache allows (page_size % 64 == 0 and a tensor map), else with cp.async.
template <typename T, int kN>
static cudaError_t launch_v6_any(const DecodeParams& p, int grid_parts, cudaStream_t stream, bool* combined) {
  CUtensorMap map{};
  if (p.page_size % DecodeConfig::kBlockN == 0 && cached_kv_map<T>(p, &map))
    return launch_v6<T, kN, true>(p, map, grid_parts, stream, combined);
  return launch_v6<T, kN, false>(p, map, grid_parts, stream, combined);
}

// v7 (mainloop_fp8t.cuh): fp8_e4m3 caches with <= 32 query rows per KV head, three warpgroups.
template <typename T, int kN>
static cudaError_t launch_v7(const DecodeParams& p, int grid_parts, cudaStream_t stream, bool* combined) {
  auto kernel = mla_decode_kernel_v7<T, kN>;
  constexpr int smem = Fp8tSmem<false>::kSmemBytes;
  const cudaError_t e = opt_in_smem(reinterpret_cast<const void*>(kernel), smem);
  if (e != cudaSuccess) return e;
  return launch_grid_threads(kernel, dim3(grid_parts, 1, p.heads_kv), Fp8t::kThreads, smem, stream, true, p, combined);
}

// v8: v7's warpgroups with the tile's raw bytes by tensor copies (whole-tile pages) and the conversion in the
// consumers' registers; anything TMA cannot address runs v7.
template <typename T, int kN>
static cudaError_t launch_v8(const DecodeParams& p, int grid_parts, cudaStream_t stream, bool* combined) {
  CUtensorMap map{};
  if (p.page_size % DecodeConfig::kBlockN != 0 || !cached_kv_map<uint8_t>(p, &map))
    return launch_v7<T, kN>(p, grid_parts, stream, combined);
  auto kernel = mla_decode_kernel_v8<T, kN>;
  constexpr int smem = Fp8tSmem<true>::kSmemBytes;
  const cudaError_t e = opt_in_smem(reinterpret_cast<const void*>(kernel), smem);
  if (e != cudaSuccess) return e;
  return launch_grid_threads(kernel, dim3(grid_parts, 1, p.heads_kv), Fp8t::kThreads, smem, stream, true, p, combined,
                             map);
}

// v9: v5's schedule for fp8_e4m3 caches, a third warpgroup converting the tiles (mainloop_seesaw.cuh, kFp8); CTAs
// alone (no pairs), no combine tail.
template <typename T>
static cudaError_t launch_v9(const DecodeParams& p, const CUtensorMap& map, int grid_parts, cudaStream_t stream,
                             bool* combined) {
  auto kernel = mla_decode_kernel_v5<T, false, true>;
  const cudaError_t e = opt_in_smem(reinterpret_cast<const void*>(kernel), Seesaw::kSmemBytes);
  if (e != cudaSuccess) return e;
  return launch_grid_threads(kernel, dim3(grid_parts, p.num_row_tiles, p.heads_kv), Seesaw::kThreadsFp8,
                             Seesaw::kSmemBytes, stream, false, p, combined, map);
}

template <typename T, int KvFmt>
static cudaError_t launch_decode_t(const DecodeParams& p, int grid_parts, cudaStream_t stream, bool* combined) {
  // variant 2: wgmma (mainloop_wgmma.cuh)
  // 5: two tiles in flight, TMA loads (mainloop_seesaw.cuh; bf16/fp16 caches with page_size % 64 == 0
  //    and q_len <= 64, anything else runs v2)
  if constexpr (KvFmt == kKvFp8E4M3) {
    // 9: v5's schedule for fp8_e4m3 caches (whole-tile pages, q_len <= 64; anything else runs v2)
    if (p.variant == 9 && p.page_size % DecodeConfig::kBlockN == 0 && p.q_len <= Seesaw::kMaxQLen) {
      CUtensorMap map;
      if (!cached_kv_map<uint8_t, true>(p, &map)) return cudaErrorInvalidValue;
      return launch_v9<T>(p, map, grid_parts, stream, combined);
    }
  }
  if (p.variant == 7 || p.variant == 8) {
    // 7: fp8_e4m3 caches with <= 32 query rows per KV head (mainloop_fp8t.cuh); 8: the same with tensor copies and
    // register A fragments (whole-tile pages that TMA can address; others run 7); anything else runs as variant 6
    if constexpr (KvFmt == kKvFp8E4M3) {
      if (p.rows_per_kv_head <= Fp8t::kMaxRows) {
        if (p.variant == 8)
          return p.rows_per_kv_head <= 16 ? launch_v8<T, 16>(p, grid_parts, stream, combined)
                                          : launch_v8<T, 32>(p, grid_parts, stream, combined);
        return p.rows_per_kv_head <= 16 ? launch_v7<T, 16>(p, grid_parts, stream, combined)
                                        : launch_v7<T, 32>(p, grid_parts, stream, combined);
      }
    }
    DecodeParams q = p;
    q.variant = 6;
    return launch_decode_t<T, KvFmt>(q, grid_parts, stream, combined);
  }
  if constexpr (KvFmt != kKvSameAsQ) {
    // 6 with an fp8 cache: <= 16 query rows per KV head (the register-staged tile does not fit
    // beside 32 rows' accumulators); anything else runs v2
    if (p.variant == 6 && p.rows_per_kv_head <= 16) {
      const CUtensorMap none{};
      return launch_v6<T, 16, false, KvFmt>(p, none, grid_parts, stream, combined);
    }
  }
  if constexpr (KvFmt == kKvSameAsQ) {
    // 6: tokens on the wgmma M side (mainloop_etap.cuh; bf16/fp16 caches, <= 32 query rows per
    //    KV head, any page size; anything else runs v2)
    if (p.variant == 6 && p.rows_per_kv_head <= Etap::kMaxRows)
      return p.rows_per_kv_head <= 16 ? launch_v6_any<T, 16>(p, grid_parts, stream, combined)
                                      : launch_v6_any<T, 32>(p, grid_parts, stream, combined);
    if (p.variant == 5 && p.page_size % DecodeConfig::kBlockN == 0 && p.q_len <= Seesaw::kMaxQLen) {
      // a cache v5 should take but TMA cannot address is an error, not a silent v2 run
      CUtensorMap map;
      if (!cached_kv_map<T>(p, &map)) return cudaErrorInvalidValue;
      return launch_v5<T>(p, map, grid_parts, stream, combined);
    }
  }
  auto kernel = mla_decode_kernel_v2<T, KvFmt>;
  const cudaError_t e = opt_in_smem(reinterpret_cast<const void*>(kernel), DecodeConfig::kSmemBytes);
  if (e != cudaSuccess) return e;
  return launch_grid(kernel, dim3(grid_parts, p.num_row_tiles, p.heads_kv), DecodeConfig::kSmemBytes, stream, true,
                     p, combined);
}

template <typename T>
static cudaError_t launch_decode_fmt(const DecodeParams& p, int grid_parts, cudaStream_t stream, bool* combined) {
  switch (p.kv_format) {
    case kKvSameAsQ: return launch_decode_t<T, kKvSameAsQ>(p, grid_parts, stream, combined);
    case kKvFp8E4M3: return launch_decode_t<T, kKvFp8E4M3>(p, grid_parts, stream, combined);
    case kKvFp8DsMla: return launch_decode_t<T, kKvFp8DsMla>(p, grid_parts, stream, combined);
    default: return cudaErrorInvalidValue;
  }
}

int launch_decode(const DecodeParams& p, int grid_parts, void* stream, bool* combined) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  *combined = false;
  return p.q_is_bf16 ? launch_decode_fmt<__nv_bfloat16>(p, grid_parts, s, combined)
                     : launch_decode_fmt<__half>(p, grid_parts, s, combined);
}

int launch_combine(const CombineParams& p, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int rows = p.q_len * p.heads_q;
  if (p.batch == 0 || rows == 0 || p.num_parts <= 1) return 0;  // one part: nothing is split
  // one block row per request, or per part boundary where there are fewer boundaries (combine.cuh)
  const bool by_boundary = p.num_parts - 1 < p.batch;
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
