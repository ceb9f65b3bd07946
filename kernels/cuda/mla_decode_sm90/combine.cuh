// Combine of split-KV partial results (LSE-weighted merge), one warp per
// (request, query token, head) row; requests that were not split exit at once.
// Same arithmetic as mla_dispatch.metadata.combine_splits.
#pragma once
#include <cmath>
#include <cstdint>

#include "config.cuh"
#include "params.h"

namespace mla_sm90 {

// One 512-thread block per (request, row): thread (g, c) = (tid / 128, tid % 128)
// owns channels 4c..4c+3 of slots g, g+4, g+8, ...; the slot loop is unrolled so
// several 16-byte loads are in flight per thread, and the four slot groups are
// summed through shared memory. (v1 walked the slots one dependent load at a
// time with one warp per row: ~30 us for 64 splits of 128 heads.)
constexpr int kCombineChannelThreads = 128;  // x 4 channels = 512
constexpr int kCombineSlotGroups = 4;
constexpr int kCombineThreads = kCombineChannelThreads * kCombineSlotGroups;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads) mla_combine_kernel(const __grid_constant__ CombineParams p) {
  using TT = TypeTraits<T>;
  const int b = blockIdx.y;
  const int n = p.num_splits[b];
  if (n <= 1) return;
  const int rows = p.q_len * p.heads_q;
  const int row = blockIdx.x;
  const int i = row / p.heads_q, h = row % p.heads_q;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int group = tid / kCombineChannelThreads, c = tid % kCombineChannelThreads;
  const int64_t first = p.first_slot[b];
  const float* __restrict__ plse = p.partial_lse + first * rows + row;
  __shared__ float red[kCombineThreads / 32];
  __shared__ float4 part_acc[kCombineSlotGroups - 1][kCombineChannelThreads];
  __shared__ float part_den[kCombineSlotGroups - 1][kCombineChannelThreads];

  float m = -INFINITY;
  for (int s = tid; s < n; s += kCombineThreads) m = fmaxf(m, plse[(int64_t)s * rows]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int w = 1; w < kCombineThreads / 32; ++w) m = fmaxf(m, red[w]);

  T* dst = reinterpret_cast<T*>(p.out) + (int64_t)b * p.out_stride_b + (int64_t)i * p.out_stride_s +
           (int64_t)h * p.out_stride_h + c * 4;
  float* lse_dst = p.lse + (int64_t)b * p.lse_stride_b + (int64_t)h * p.lse_stride_h + i;
  if (m == -INFINITY) {  // no slot saw a key
    if (group == 0) {
      *reinterpret_cast<typename TT::T2*>(dst) = TT::from_float2(0.f, 0.f);
      *reinterpret_cast<typename TT::T2*>(dst + 2) = TT::from_float2(0.f, 0.f);
      if (c == 0) *lse_dst = INFINITY;
    }
    return;
  }
  const float4* __restrict__ src =
      reinterpret_cast<const float4*>(p.partial_out + (first * rows + row) * DecodeConfig::kHeadDimV) + c;
  const int64_t slot_stride4 = (int64_t)rows * DecodeConfig::kHeadDimV / 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float denom = 0.f;
#pragma unroll 4
  for (int s = group; s < n; s += kCombineSlotGroups) {
    const float l = plse[(int64_t)s * rows];
    const float w = l == -INFINITY ? 0.f : __expf(l - m);  // a -inf slot wrote out = 0
    const float4 v = src[s * slot_stride4];
    denom += w;
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
  }
  if (group > 0) {
    part_acc[group - 1][c] = acc;
    part_den[group - 1][c] = denom;
  }
  __syncthreads();
  if (group != 0) return;
#pragma unroll
  for (int g = 0; g < kCombineSlotGroups - 1; ++g) {
    const float4 v = part_acc[g][c];
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
    denom += part_den[g][c];
  }
  const float inv = 1.f / denom;
  *reinterpret_cast<typename TT::T2*>(dst) = TT::from_float2(acc.x * inv, acc.y * inv);
  *reinterpret_cast<typename TT::T2*>(dst + 2) = TT::from_float2(acc.z * inv, acc.w * inv);
  if (c == 0) *lse_dst = m + logf(denom);
}

}  // namespace mla_sm90
