// [notes]: docs/notes/cuda_sm90.md, the development history these comments cite
// Host/device parameter block of the SM90 MLA decode kernel family.
// Plain C++ (no torch, no CUDA headers needed): shared by the torch binding
// (binding.cpp, host compiler) and the kernels/launchers (launch.cu, nvcc).
#pragma once
#include <cstdint>

#include "config.h"

namespace mla_sm90 {

// A split request's partial row (one query row's output over part of its keys), as the decode writes it and the
// combine reads it back. The workspace gives each row kPartialRowBytes (an fp32 [512] row); the row uses 1152 of
// them, so the decode writes and the combine reads 56% of the bytes fp32 rows would take:
// - bytes 0 .. 1023: 512 fp16 values. In each block of 16 channels, positions 4q .. 4q + 3 hold channels
//   2q, 2q + 1, 8 + 2q, 9 + 2q: the four values lane q of an mma/wgmma accumulator quad holds, so the quad's four
//   8-byte stores fill one 32-byte sector;
// - bytes 1024 + 32k .. + 31: the signed shift s of quarter row k (channels 128k ..), repeated over the sector:
//   the stored values are out * 2^s, with s putting the quarter's largest magnitude in [2^14, 2^15) (epilogue.cuh,
//   partial_shift), where fp16 keeps all 11 significant bits and cannot overflow.
// Every store fills whole 32-byte sectors ([notes], twelfth and thirteenth sessions: partly written sectors cost
// more). fp16 rounds 8x finer than bf16: bf16 partial rows fell outside docs/design.md §5's cosine bound.
constexpr int kPartialRowBytes = 2048;
constexpr int kPartialShiftByte = 1024;
constexpr int kPartialShiftStride = 32;  // one sector per quarter row

struct DecodeParams {
  // q [B, s_q, h_q, 576] (last dim contiguous), element strides
  const void* q;
  int64_t q_stride_b, q_stride_s, q_stride_h;
  // kv [num_blocks, page_size, h_kv, D or 656] (last dim contiguous), element strides
  // (bytes for fp8 formats: one element is one byte there)
  const void* kv;
  int64_t kv_stride_block, kv_stride_tok, kv_stride_head;
  const int32_t* block_table;  // [B, max_blocks]
  int64_t bt_stride;
  const int32_t* cache_seqlens;  // [B]
  const float* kv_scale;         // [1] device pointer, fp8_e4m3 only, else nullptr
  // split-KV schedule (mla_dispatch/metadata/schedule.py): items [max_items, 4], part_offsets [P+1]
  const int32_t* items;
  const int32_t* part_offsets;
  int num_parts;
  // outputs
  void* out;  // [B, s_q, h_q, 512] in q dtype
  int64_t out_stride_b, out_stride_s, out_stride_h;
  float* lse;  // [B, h_q, s_q] fp32
  int64_t lse_stride_b, lse_stride_h;
  void* partial_out;   // [max_slots, s_q, h_q] rows of kPartialRowBytes (fp32 [.., 512] workspace), contiguous
  float* partial_lse;  // [max_slots, s_q, h_q] fp32, contiguous
  const int32_t* num_splits;  // [B] (schedule), read by the fused combine
  const int32_t* first_slot;  // [B]
  // 1: the kernel merges the split rows itself after a grid-wide barrier (combine.cuh, combine_in_grid); only in
  // cooperative launches: LaunchConfig::fuse_combine, set by the launcher (launch.cu)
  int fuse_combine;
  // geometry
  int batch, q_len, heads_q, heads_kv, page_size;
  int64_t num_blocks;    // kv_cache.size(0) (the TMA tensor maps)
  // min(num_blocks, 2^31), set by the binding: a block-table entry `id` names a block of the cache iff
  // (uint32_t)id < block_ids (a negative id is 2^31 or more as unsigned); loads.cuh, page_ok
  uint32_t block_ids;
  int rows_per_kv_head;  // s_q * h_q / h_kv
  int num_row_tiles;     // ceil(rows_per_kv_head / 64)
  float softmax_scale;
  int causal;
  int kv_format;  // KvFormat
  int q_is_bf16;  // 1: bf16, 0: fp16
  // 1: DeepSeek Sparse Attention (DSA) top-k decode, run as a dense decode of one query token per request (the plan
  // flattens (b, s) into requests and passes `indices` as the block table; backends/cuda_sm90.py, sparse_view).
  // The table then holds cache token ids, block * sparse_page + offset, one per token (page_size is 1 for the
  // table, block_ids counts tokens), read from the cache's own blocks (loads.cuh, sparse_token_elem); an id of -1
  // is a skipped top-k slot, masked out of the softmax and never read, not a bad id (loads.cuh,
  // load_kv_async_sparse). wgmma's sparse instances, and etap's and fp8t_convert's over fp8 caches (binding.cpp,
  // check_config).
  int sparse;
  int sparse_page;  // sparse: the cache's page size (kv_cache.size(1))
  // sparse only, optional (nullptr): fp32 [h_q] attention sinks (DeepSeek-V4): a finished row is scaled by
  // 1 / (1 + exp(sink - lse)), its lse unchanged (the epilogue for a whole request, the combine for a split one)
  const float* attn_sink;
};

// The launch a plan chose (mla_dispatch/backends/cuda_sm90.py, Sm90Launch), run as given: the binding checks it
// against the call (binding.cpp, check_config) and the launcher builds no other.
struct LaunchConfig {
  int mainloop;       // Mainloop (config.h)
  int tile_rows;      // query rows of a CTA tile: kBlockM (v2, v5, v9: grid y = the row tiles) or 16 / 32 (v6-v8)
  bool tma_loads;     // KV tiles by TMA: a tensor map of the cache (v5, v8, v9; v6 on whole-tile 16-bit pages)
  bool paired;        // v5: the two row-tile CTAs of a part in a cluster
  bool fuse_combine;  // the split rows merged by the decode launch itself (a cooperative launch)
  bool fixed_splits;  // a batch-invariant schedule: any request may be split anywhere; the combine runs per request
};

struct CombineParams {
  const void* partial_out;   // [max_slots, s_q, h_q] partial rows (DecodeParams)
  const float* partial_lse;  // [max_slots, s_q, h_q]
  const int32_t* num_splits;  // [B]
  const int32_t* first_slot;  // [B]
  // the schedule (DecodeParams::items, part_offsets): the combine launched per part boundary finds
  // the request a boundary splits from the first item of the part after it (combine.cuh)
  const int32_t* items;
  const int32_t* part_offsets;
  int num_parts;
  int fixed_splits;  // LaunchConfig::fixed_splits: one block row per request, never per part boundary
  void* out;
  int64_t out_stride_b, out_stride_s, out_stride_h;
  float* lse;
  int64_t lse_stride_b, lse_stride_h;
  int batch, q_len, heads_q;
  int q_is_bf16;
  const float* attn_sink;  // DecodeParams::attn_sink
};

#ifdef __CUDACC__
#define MLA_SM90_HD __host__ __device__
#else
#define MLA_SM90_HD
#endif
// The combine's view of a decode launch (the combine kernel's parameters, and the fused tail's).
inline MLA_SM90_HD CombineParams combine_params(const DecodeParams& d) {
  CombineParams c{};
  c.partial_out = d.partial_out;
  c.partial_lse = d.partial_lse;
  c.num_splits = d.num_splits;
  c.first_slot = d.first_slot;
  c.items = d.items;
  c.part_offsets = d.part_offsets;
  c.num_parts = d.num_parts;
  c.out = d.out;
  c.out_stride_b = d.out_stride_b;
  c.out_stride_s = d.out_stride_s;
  c.out_stride_h = d.out_stride_h;
  c.lse = d.lse;
  c.lse_stride_b = d.lse_stride_b;
  c.lse_stride_h = d.lse_stride_h;
  c.batch = d.batch;
  c.q_len = d.q_len;
  c.heads_q = d.heads_q;
  c.q_is_bf16 = d.q_is_bf16;
  c.attn_sink = d.attn_sink;
  return c;
}

// Launchers (launch.cu). Return 0 on success, a cudaError_t value, or kLaunchNoTensorMap.
// launch_decode runs cfg as given, over the grid (p.num_parts, row tiles, p.heads_kv); without cfg.fuse_combine
// launch_combine must follow.
constexpr int kLaunchNoTensorMap = -1;  // cfg.tma_loads, but TMA cannot address the cache (or no driver entry point)
int launch_decode(const DecodeParams& p, const LaunchConfig& cfg, void* stream);
int launch_combine(const CombineParams& p, void* stream);

}  // namespace mla_sm90
