// Per-CTA timeline of the decode kernels, for diagnosis only: compiled in with -DMLA_SM90_TIMELINE
// (`MLA_SM90_TIMELINE=1 python -m mla_dispatch build`, a separate extension), a no-op otherwise.
// Thread 0 of each CTA stamps %globaltimer (ns, one clock for the whole GPU) and clock64 (the SM's
// cycles) at fixed events; ci/sm90_timeline.py reads them back and prints where a call's time goes.
// The idea of stamping clock64 per item is the fourth session's throwaway build (NOTES.md).
#pragma once
#include <cstdint>

#include "params.h"

namespace mla_sm90 {

#ifdef MLA_SM90_TIMELINE
__device__ unsigned long long g_timeline[kTimelineCtas][kTimelineEvents][2];

// `dep` is an asm input, so the stamp waits for the load that produced it (a metadata value); thread `who` stamps.
__device__ __forceinline__ void stamp(int event, int dep = 0, int who = 0) {
  if (threadIdx.x != who || event < 0 || event >= kTimelineEvents) return;
  const int cta = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  if (cta >= kTimelineCtas) return;
  unsigned long long gt, ck;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt) : "r"(dep) : "memory");
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(ck) : "r"(dep) : "memory");
  g_timeline[cta][event][0] = gt;
  g_timeline[cta][event][1] = ck;
}
// Counter `i` (< kTimelineCounters) of the CTA := `cycles`, from thread `who`.
__device__ __forceinline__ void timeline_count(int i, long long cycles, int who) {
  const int cta = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  if (threadIdx.x != who || cta >= kTimelineCtas) return;
  g_timeline[cta][kTimelineCounterBase + i][0] = (unsigned long long)cycles;
}
// `stmt` with its SM cycles added to `total` (a long long)
#define MLA_TIMED(total, stmt)            \
  do {                                    \
    const long long t_timed_ = clock64(); \
    stmt;                                 \
    total += clock64() - t_timed_;        \
  } while (0)
#define MLA_CLOCK() clock64()
#else
__device__ __forceinline__ void stamp(int, int = 0, int = 0) {}
__device__ __forceinline__ void timeline_count(int, long long, int) {}
#define MLA_TIMED(total, stmt) stmt
#define MLA_CLOCK() 0ll  // the timeline's clock reads are not compiled in
#endif

// The events of item k (counted from the CTA's first item) are kTimelineItemBase + 4k + {0: metadata read,
// 1: Q and first tiles landed, 2: last tile done, 3: outputs stored}; items past kTimelineItems are not stamped.
__device__ __forceinline__ int item_event(int k, int phase) {
  return k < kTimelineItems ? kTimelineItemBase + 4 * k + phase : -1;
}

// The event of the CTA's mainloop step `n` (-1: not stamped).
__device__ __forceinline__ int step_event(int n) { return n < kTimelineSteps ? kTimelineStepBase + n : -1; }

}  // namespace mla_sm90
