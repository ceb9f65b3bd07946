// The split-KV schedule of a plan, computed on the device in one launch issued from the extension (schedule.cu):
// the plan's part of the host path, without Triton's launcher or torch ops. Plain C++ (no torch, no CUDA headers):
// shared by the binding (binding.cpp) and the kernel's translation unit.
#pragma once
#include <cstdint>

namespace mla_sm90 {

// Largest batch the one-block schedule takes (mla_dispatch/metadata/schedule.py, TRITON_SCHEDULE_MAX_BATCH: the
// plan computes larger ones with torch).
constexpr int kScheduleMaxBatch = 8192;
// Largest number of split-KV parts it takes (a plan has one per SM at most, times its programs per SM).
constexpr int kScheduleMaxParts = 8192;

// Buffers of one plan (mla_dispatch/metadata/split_plan.py, SplitKVPlan), all int32 and contiguous, every element
// rewritten by the launch: the schedule (metadata/schedule.py, SplitKVSchedule), the first partial slot of each
// request (metadata/combine.py, first_slots) and a copy of the lengths the schedule was made for.
struct ScheduleParams {
  const int32_t* seqlens;  // [batch], the caller's lengths (negative: 0; past capacity: capacity)
  int32_t* items;          // [batch + num_parts, 4]: (request, token begin, token end, slot); -1 rows are padding
  int32_t* part_offsets;   // [num_parts + 1]
  int32_t* num_splits;     // [batch]
  int32_t* slot_req;       // [batch + num_parts]: the request of each partial slot, -1 unused
  int32_t* first_slot;     // [batch]
  int32_t* lengths;        // [batch]: seqlens, copied
  int32_t* workspace;      // [5 * batch + 2 * num_parts]: int64 ends [batch], flags, their prefix sums, slot bases
  int batch, num_parts, chunk_size, overhead;
  int64_t capacity;        // tokens a table row addresses; INT32_MAX: no bound
};

// Returns 0 or a cudaError_t value. batch in [1, kScheduleMaxBatch], num_parts in [1, kScheduleMaxParts],
// chunk_size >= 1, overhead >= 1 (the binding checks them).
int launch_split_kv_schedule(const ScheduleParams& p, void* stream);

}  // namespace mla_sm90
