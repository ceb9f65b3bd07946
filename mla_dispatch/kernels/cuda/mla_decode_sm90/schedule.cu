// The split-KV schedule in one launch of one thread block, issued from the extension (binding.cpp,
// split_kv_schedule): the same contract, bit for bit, as the torch reference (mla_dispatch/metadata/schedule.py,
// split_kv_schedule) and the Triton launch it replaces on this backend's host path
// (mla_dispatch/metadata/schedule_triton.py, whose docstring derives each step). Requests are laid end to end on a
// cost axis, ceil(L / chunk) + overhead units each, cut into num_parts equal parts (FlashMLA's get_mla_metadata,
// csrc/smxx/decode/get_decoding_sched_meta); each position of a cut is known in closed form, so the block computes
// the whole schedule in five phases separated by barriers (global writes of the block are visible to it after
// __syncthreads):
//   1. the cost axis (an int64 prefix sum over requests); each request start is a cut at a known merged position;
//   2. part boundaries as cuts: the request a boundary falls in, by binary search over the request ends;
//   3. compaction: an exclusive prefix sum of the valid cuts' flags gives each item its row;
//   4. splits, first slots (a prefix sum over split requests), request-start items, padding rows, part offsets;
//   5. boundary items.
// It also writes the first partial slot of each request and a copy of the lengths (a plan's own, which the decode
// kernels read: docs/design.md §2, "Stale plans"). No torch here, so CI compiles it with nvcc alone.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "schedule.h"

namespace mla_sm90 {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
__device__ __forceinline__ int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Exclusive prefix sum over n values, each thread taking a contiguous run of ceil(n / kThreads): value(i) is called
// twice per element (it recomputes, nothing is held), store(i, exclusive prefix) once. Returns the total (every
// thread). `scratch` holds kWarps + 1 values of T in shared memory.
template <typename T, typename Value, typename Store>
__device__ T block_exclusive_scan(int n, Value value, Store store, T* scratch) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int per = (n + kThreads - 1) / kThreads;
  const int lo = min(tid * per, n), hi = min(lo + per, n);
  T local = 0;
  for (int i = lo; i < hi; ++i) local += value(i);
  // inclusive scan of the threads' sums within each warp, then over the warps' totals
  T incl = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T up = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += up;
  }
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    T w = lane < kWarps ? scratch[lane] : T(0);
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const T up = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += up;
    }
    if (lane < kWarps) scratch[lane] = w;  // inclusive totals of warps 0 .. lane
    if (lane == kWarps - 1) scratch[kWarps] = w;
  }
  __syncthreads();
  T running = incl - local + (warp > 0 ? scratch[warp - 1] : T(0));
  for (int i = lo; i < hi; ++i) {
    const T v = value(i);
    store(i, running);
    running += v;
  }
  const T total = scratch[kWarps];
  __syncthreads();  // scratch is reused by the next scan
  return total;
}

// Number of the first n entries of the sorted array `a` that are <= x (searchsorted(a, x, right=True)).
__device__ __forceinline__ int count_le(const int64_t* a, int n, int64_t x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (a[mid] <= x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

struct Axis {  // the cost axis, per request
  int64_t len, chunks, start, end;
};

struct Bound {  // a part boundary as a cut (the Triton kernel's phase 2, lane p)
  bool is_bound, at_start, valid;
  int req, req_c, pos;
  int64_t tok_begin, tok_end;
};

__global__ void __launch_bounds__(kThreads, 1) split_kv_schedule_kernel(const ScheduleParams p) {
  __shared__ int64_t scratch64[kWarps + 1];
  __shared__ int32_t scratch32[kWarps + 1];
  __shared__ int64_t total_s, per_part_s;
  const int B = p.batch, P = p.num_parts, n_rows = B + P, tid = threadIdx.x;
  const int64_t chunk = p.chunk_size, overhead = p.overhead, cap = p.capacity;
  int64_t* ws_end = reinterpret_cast<int64_t*>(p.workspace);  // [B]
  int32_t* ws_flag = p.workspace + 2 * B;                      // [B + P]
  int32_t* ws_excl = ws_flag + n_rows;                         // [B + P]
  int32_t* ws_slot_base = ws_excl + n_rows;                    // [B]

  auto len_of = [&](int b) { return clamp64(p.seqlens[b], 0, cap); };
  auto cost_of = [&](int b) { return cdiv(len_of(b), chunk) + overhead; };

  // -- phase 1: the cost axis (ends), the lengths' copy; request starts as cuts ------------------------------------
  for (int b = tid; b < B; b += kThreads) p.lengths[b] = p.seqlens[b];
  const int64_t total = block_exclusive_scan<int64_t>(
      B, cost_of, [&](int b, int64_t excl) { ws_end[b] = excl + cost_of(b); }, scratch64);
  if (tid == 0) {
    total_s = total;
    per_part_s = cdiv(total, P);
  }
  __syncthreads();
  const int64_t per_part = per_part_s;
  auto axis = [&](int b) {
    Axis a;
    a.len = len_of(b);
    a.chunks = cdiv(a.len, chunk);
    a.end = ws_end[b];
    a.start = a.end - (a.chunks + overhead);
    return a;
  };
  // the interval a request start opens ends at its request's end or the next boundary
  auto start_tok_end = [&](const Axis& a) {
    const int64_t next = min(a.end, (a.start / per_part + 1) * per_part);
    return min(max(next - a.start - overhead, int64_t(0)) * chunk, a.len);
  };
  auto start_valid = [&](const Axis& a) { return start_tok_end(a) > 0 || a.chunks == 0; };
  auto start_pos = [&](int b, const Axis& a) { return b + int(clamp64(cdiv(a.start, per_part) - 1, 0, P - 1)); };
  auto next_pos = [&](int b, const Axis& a) { return b + 1 + int(clamp64(cdiv(a.end, per_part) - 1, 0, P - 1)); };
  for (int b = tid; b < B; b += kThreads) {
    const Axis a = axis(b);
    ws_flag[start_pos(b, a)] = start_valid(a) ? 1 : 0;
  }
  __syncthreads();

  // -- phase 2: part boundaries T_p = p * per_part as cuts (p = 1 .. P-1) -----------------------------------------
  auto bound = [&](int q) {
    Bound r;
    r.is_bound = q >= 1 && q < P;
    const int64_t t = int64_t(q) * per_part;
    const bool on_axis = r.is_bound && t < total_s;
    r.req = r.is_bound ? count_le(ws_end, B, t) : 0;
    r.req_c = min(r.req, B - 1);
    const int64_t r_end = ws_end[r.req_c], r_len = len_of(r.req_c);
    const int64_t r_start = r_end - (cdiv(r_len, chunk) + overhead);
    r.at_start = on_axis && r_start == t;
    const int64_t r_next = min(r_end, t + per_part), tok0 = r_start + overhead;
    r.tok_begin = min(max(t - tok0, int64_t(0)) * chunk, r_len);
    r.tok_end = min(max(r_next - tok0, int64_t(0)) * chunk, r_len);
    r.valid = on_axis && !r.at_start && r.tok_end > r.tok_begin;
    r.pos = q - 1 + min(r.req + 1, B);
    return r;
  };
  for (int q = tid; q < P; q += kThreads) {
    const Bound r = bound(q);
    if (r.is_bound) ws_flag[r.pos] = r.valid ? 1 : 0;
  }
  __syncthreads();

  // -- phase 3: compaction, an exclusive prefix sum over the merged cuts (n_rows - 1 of them) ---------------------
  const int n_items = block_exclusive_scan<int32_t>(
      n_rows, [&](int m) { return m < n_rows - 1 ? ws_flag[m] : 0; }, [&](int m, int32_t e) { ws_excl[m] = e; },
      scratch32);
  __syncthreads();

  // -- phase 4: splits and first slots per request; request-start items; padding rows; part offsets --------------
  auto splits_of = [&](int b) {
    const Axis a = axis(b);
    return ws_excl[next_pos(b, a)] - ws_excl[start_pos(b, a)];
  };
  const int n_slots = block_exclusive_scan<int32_t>(
      B, [&](int b) { const int s = splits_of(b); return s > 1 ? s : 0; },
      [&](int b, int32_t first) {
        const Axis a = axis(b);
        const int first_item = ws_excl[start_pos(b, a)];
        const int splits = ws_excl[next_pos(b, a)] - first_item;
        p.num_splits[b] = splits;
        p.first_slot[b] = first;
        ws_slot_base[b] = first - first_item;
        if (start_valid(a)) {
          const int slot = splits > 1 ? first : -1;
          int32_t* row = p.items + int64_t(first_item) * 4;
          row[0] = b;
          row[1] = 0;
          row[2] = int32_t(start_tok_end(a));
          row[3] = slot;
          if (splits > 1) p.slot_req[first] = b;
        }
      },
      scratch32);
  for (int m = tid; m < n_rows; m += kThreads) {
    if (m >= n_items) {
      int32_t* row = p.items + int64_t(m) * 4;
      row[0] = -1;
      row[1] = 0;
      row[2] = 0;
      row[3] = -1;
    }
    if (m >= n_slots) p.slot_req[m] = -1;
  }
  // part q starts after every cut below T_q: before boundary q and before a request start it ties with
  for (int q = tid; q <= P; q += kThreads) {
    int cut = n_rows - 1;
    if (q == 0) cut = 0;
    else if (q < P) {
      const Bound r = bound(q);
      cut = r.pos - (r.at_start ? 1 : 0);
    }
    p.part_offsets[q] = ws_excl[cut];
  }
  __syncthreads();  // num_splits and the slot bases are read below

  // -- phase 5: boundary items --------------------------------------------------------------------------------------
  for (int q = tid; q < P; q += kThreads) {
    const Bound r = bound(q);
    if (!r.valid) continue;
    const int row_i = ws_excl[r.pos];
    const bool split = p.num_splits[r.req_c] > 1;
    const int slot = split ? row_i + ws_slot_base[r.req_c] : -1;
    int32_t* row = p.items + int64_t(row_i) * 4;
    row[0] = r.req_c;
    row[1] = int32_t(r.tok_begin);
    row[2] = int32_t(r.tok_end);
    row[3] = slot;
    if (split) p.slot_req[slot] = r.req_c;
  }
}

}  // namespace

int launch_split_kv_schedule(const ScheduleParams& p, void* stream) {
  split_kv_schedule_kernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace mla_sm90
