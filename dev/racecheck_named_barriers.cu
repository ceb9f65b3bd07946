// Does compute-sanitizer's racecheck report hazards across barriers in a kernel that has none? (GPU machine)
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -lineinfo -o /tmp/rnb dev/racecheck_named_barriers.cu
//   compute-sanitizer --tool racecheck /tmp/rnb            # named barriers with ids, as v6 has them now
//   compute-sanitizer --tool racecheck /tmp/rnb syncthreads # __syncthreads for the CTA-wide points, as v6 had them
//   compute-sanitizer --tool racecheck /tmp/rnb named nowgbar  # the tile loop without its per-warpgroup barriers
//
// The cuda_sm90 kernel etap (v6; kernels/cuda/mla_decode_sm90/etap/etap.cuh) gets racecheck reports of a write just
// before a CTA-wide barrier against a read just after it, from different warpgroups (docs/notes/cuda_sm90.md, fifteenth
// session). This kernel has v6's barrier structure and nothing else: two warpgroups, each walking every other tile
// with its own 128-thread named barrier (ids 1, 2; trip counts differ by one where the tile count is odd, and
// warpgroup 1 spins a while per tile so the two drift apart), then CTA-wide sync points where values written by one
// warpgroup are read by the other. Every access pair is ordered by a barrier that all 256 threads reach, so any
// hazard racecheck reports here is not a race. `nowgbar` computes the same tile maxima in registers, without the
// per-warpgroup barriers (and their shared memory), to tell whether those barriers are what confuses the tool. The
// program checks its outputs and prints "outputs ok" or the first wrong element.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>

__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <bool kSyncthreads>
__device__ __forceinline__ void cta_sync(int id) {
  if constexpr (kSyncthreads) {
    __syncthreads();
  } else {
    bar_sync(id, 256);
  }
}

// out[block][256]: the value each thread reads from the other end of the block's merge buffer
template <bool kSyncthreads, bool kWgBarriers>
__global__ void __launch_bounds__(256, 1) two_warpgroups(float* out, int tiles_base, int items, long spin) {
  __shared__ float red[2][4][8];  // [warpgroup][warp][column]: per-tile partial maxima, as v6's `red`
  __shared__ float sM[2][8];      // [warpgroup][column]: end-of-item maxima, as v6's sM
  __shared__ float sO[256];       // the merge buffer, as v6's sO
  const int tid = threadIdx.x, lane = tid % 32, warp = (tid / 32) % 4;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  float acc = 0.f;
  for (int item = 0; item < items; ++item) {
    const int num_tiles = tiles_base + (blockIdx.x + item) % 3;
    float m = -1.f;
    for (int j = wg; j < num_tiles; j += 2) {
      if (wg == 1) {  // drift: warpgroup 1 reaches its barriers later than warpgroup 0
        const long long t0 = clock64();
        while (clock64() - t0 < spin) {
        }
      }
      if constexpr (kWgBarriers) {
        if (lane < 8) red[wg][warp][lane] = (float)(j * 8 + lane + warp);
        bar_sync(1 + wg, 128);
        const float t = fmaxf(fmaxf(red[wg][0][lane % 8], red[wg][1][lane % 8]),
                              fmaxf(red[wg][2][lane % 8], red[wg][3][lane % 8]));
        m = fmaxf(m, t);
        bar_sync(1 + wg, 128);  // every warp has read red before the next tile writes it
      } else {
        m = fmaxf(m, (float)(j * 8 + lane % 8 + 3));
      }
    }
    cta_sync<kSyncthreads>(3);  // both loops done
    if (warp == 0 && lane < 8) sM[wg][lane] = m;
    cta_sync<kSyncthreads>(4);
    const float merged = fmaxf(sM[0][lane % 8], sM[1][lane % 8]);
    if (wg == 1) sO[tid] = merged + (float)tid;
    cta_sync<kSyncthreads>(5);
    if (wg == 0) sO[tid] = sO[tid + 128] + merged;
    cta_sync<kSyncthreads>(6);
    acc += sO[255 - tid];
    cta_sync<kSyncthreads>(7);  // sO and sM are rewritten by the next item
  }
  out[blockIdx.x * 256 + tid] = acc;
}

// The same computation on the host.
static float expected(int block, int tid, int tiles_base, int items) {
  float acc = 0.f;
  for (int item = 0; item < items; ++item) {
    const int num_tiles = tiles_base + (block + item) % 3;
    auto wg_max = [&](int wg, int col) {
      float m = -1.f;
      for (int j = wg; j < num_tiles; j += 2) m = std::max(m, (float)(j * 8 + col + 3));
      return m;
    };
    auto merged = [&](int t) { return std::max(wg_max(0, t % 32 % 8), wg_max(1, t % 32 % 8)); };
    const int r = 255 - tid;  // the element this thread reads
    const float v = r >= 128 ? merged(r) + (float)r : (merged(r + 128) + (float)(r + 128)) + merged(r);
    acc += v;
  }
  return acc;
}

int main(int argc, char** argv) {
  const bool syncthreads = argc > 1 && std::strcmp(argv[1], "syncthreads") == 0;
  const bool wg_barriers = !(argc > 2 && std::strcmp(argv[2], "nowgbar") == 0);
  using Kernel = void (*)(float*, int, int, long);
  const Kernel kernel = syncthreads ? (wg_barriers ? two_warpgroups<true, true> : two_warpgroups<true, false>)
                                    : (wg_barriers ? two_warpgroups<false, true> : two_warpgroups<false, false>);
  const int blocks = 132, items = 3;
  float* out = nullptr;
  cudaMalloc(&out, blocks * 256 * sizeof(float));
  std::vector<float> host(blocks * 256);
  int bad = 0;
  for (int tiles_base = 1; tiles_base <= 4; ++tiles_base) {
    for (long spin : {0L, 2000L}) {
      cudaMemset(out, 0xff, blocks * 256 * sizeof(float));  // NaN
      kernel<<<blocks, 256>>>(out, tiles_base, items, spin);
      cudaMemcpy(host.data(), out, host.size() * sizeof(float), cudaMemcpyDeviceToHost);
      for (int b = 0; b < blocks && !bad; ++b)
        for (int t = 0; t < 256 && !bad; ++t)
          if (host[b * 256 + t] != expected(b, t, tiles_base, items)) {
            std::printf("wrong: tiles_base %d spin %ld block %d thread %d: %g, expected %g\n", tiles_base, spin, b, t,
                        host[b * 256 + t], expected(b, t, tiles_base, items));
            bad = 1;
          }
    }
  }
  const cudaError_t err = cudaDeviceSynchronize();
  std::printf("%s barriers, %s: %s, %s\n", syncthreads ? "__syncthreads" : "named",
              wg_barriers ? "per-warpgroup barriers in the loop" : "no barrier in the loop", cudaGetErrorString(err),
              bad ? "outputs WRONG" : "outputs ok");
  cudaFree(out);
  return bad || err != cudaSuccess;
}
