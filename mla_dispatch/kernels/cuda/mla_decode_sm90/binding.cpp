// Torch binding of the SM90 MLA decode family: argument checks (messages name
// the argument, the expected and the given value), the check of the plan's launch
// config (check_config: a config no kernel takes is refused, never replaced),
// parameter packing, the op registration (namespace mla_dispatch; fake
// implementations live in mla_dispatch/backends/cuda_sm90.py), and the same
// function as a plain Python function of the extension module for eager calls
// (see the end of this file).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "params.h"
#include "schedule.h"

namespace {

constexpr int64_t kDQK = mla_sm90::kHeadDimQK, kDV = mla_sm90::kHeadDimV, kDsMlaBytes = mla_sm90::kDsMlaTokenBytes;

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// Messages are built by plain string concatenation, only on failure (c10::str
// streaming of integers crashed in this error path on the device build).
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, double v) { s += std::to_string(v); }
template <typename I, typename = std::enable_if_t<std::is_integral_v<I>>>
inline void append(std::string& s, I v) { s += std::to_string(v); }
template <typename... A>
std::string cat(const A&... a) {
  std::string s;
  (append(s, a), ...);
  return s;
}
std::string dev_str(const at::Device& d) { return d.is_cuda() ? "cuda:" + std::to_string(d.index()) : "cpu"; }
std::string dtype_str(at::ScalarType t) { return std::string(c10::toString(t)); }

#define MLA_CHECK(cond, ...)                                                 \
  do {                                                                       \
    if (!(cond)) {                                                           \
      const std::string mla_msg_ = cat("cuda_sm90_decode: ", __VA_ARGS__);   \
      TORCH_CHECK_VALUE(false, mla_msg_);                                    \
    }                                                                        \
  } while (0)

void check_cuda_int32(const at::Tensor& t, const char* name, int64_t dims, const at::Device& dev) {
  MLA_CHECK(t.device() == dev, name, " must be on ", dev_str(dev), ", got ", dev_str(t.device()));
  MLA_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", dtype_str(t.scalar_type()));
  MLA_CHECK(t.dim() == dims, name, " must be ", dims, "-D, got shape ", shape_str(t));
}

// Vector loads and stores: every token/row start (the first `dims` strides) must be `bytes`-aligned.
bool aligned(const at::Tensor& t, int64_t dims, int64_t bytes) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes != 0) return false;
  for (int64_t d = 0; d < dims; ++d)
    if ((t.stride(d) * t.element_size()) % bytes != 0) return false;
  return true;
}
bool aligned16(const at::Tensor& t, int64_t dims) { return aligned(t, dims, 16); }

// Whether two indices of `t` may address one element (an expanded tensor: a stride of 0): the kernel's stores to
// it would race and keep one request's value. The test api.py's _overlaps_itself makes: sorted by stride, every
// dimension must step past all that the smaller ones reach.
bool overlaps_itself(const at::Tensor& t) {
  if (t.is_contiguous()) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dimensions of size > 1
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return true;
    reach += stride * (size - 1);
  }
  return false;
}

void check_kv_format(int64_t kv_format) {
  MLA_CHECK(kv_format >= 0 && kv_format <= 3,
            "kv_format must be 0 (q dtype), 1 (fp8_e4m3), 2 (fp8_ds_mla) or 3 (fp8_ds_v4), got ", kv_format);
}

// The arguments that change per call (per layer): q, the cache and its scale, out, lse.
void check_call(const at::Tensor& q, const at::Tensor& kv, const c10::optional<at::Tensor>& kv_scale,
                const at::Tensor& out, const at::Tensor& lse, int64_t kv_format, bool tma_loads) {
  MLA_CHECK(q.is_cuda(), "q must be a CUDA tensor, got device ", dev_str(q.device()));
  const at::Device dev = q.device();
  MLA_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
            "q must be bfloat16 or float16, got ", dtype_str(q.scalar_type()));
  const int64_t d_qk = kv_format == mla_sm90::kKvFp8DsV4 ? mla_sm90::kDsV4HeadDim : kDQK;
  MLA_CHECK(q.dim() == 4 && q.size(3) == d_qk, "q must be [B, s_q, h_q, ", d_qk, "], got ", shape_str(q));
  MLA_CHECK(q.stride(3) == 1, "q must be contiguous in its last dim");
  const int64_t B = q.size(0), s_q = q.size(1), h_q = q.size(2);
  check_kv_format(kv_format);
  MLA_CHECK(kv.device() == dev, "kv_cache must be on ", dev_str(dev), ", got ", dev_str(kv.device()));
  MLA_CHECK(kv.dim() == 4, "kv_cache must be 4-D [num_blocks, page_size, h_kv, D], got ", shape_str(kv));
  MLA_CHECK(kv.stride(3) == 1, "kv_cache must be contiguous in its last dim");
  // a bad block id is replaced by block 0 (loads.cuh, page_ok), which must exist
  MLA_CHECK(kv.size(0) >= 1 && kv.size(1) >= 1, "kv_cache needs num_blocks >= 1 and page_size >= 1, got shape ",
            shape_str(kv));
  if (kv_format == 0) {
    MLA_CHECK(kv.scalar_type() == q.scalar_type(), "kv_cache dtype must equal q's (", dtype_str(q.scalar_type()),
              "), got ", dtype_str(kv.scalar_type()));
    MLA_CHECK(kv.size(3) == kDQK, "kv_cache last dim must be 576, got ", kv.size(3));
  } else if (kv_format == 1) {
    MLA_CHECK(kv.element_size() == 1, "fp8_e4m3 kv_cache must have 1-byte elements, got ", dtype_str(kv.scalar_type()));
    MLA_CHECK(kv.size(3) == kDQK, "kv_cache last dim must be 576, got ", kv.size(3));
    MLA_CHECK(kv_scale.has_value() && kv_scale->device() == dev && kv_scale->scalar_type() == at::kFloat &&
                  kv_scale->numel() == 1,
              "kv_scale must be a float32 tensor of one element on ", dev_str(dev), " for fp8_e4m3");
  } else if (kv_format == mla_sm90::kKvFp8DsV4) {
    // one KV head; the blocks' bytes are read as laid out (config.h, kDsV4*), 16-byte vectors from 16-byte boundaries
    MLA_CHECK(kv.element_size() == 1, "fp8_ds_v4 kv_cache must have 1-byte elements, got ",
              dtype_str(kv.scalar_type()));
    MLA_CHECK(kv.size(2) == 1 && kv.size(3) == mla_sm90::kDsV4TokenBytes,
              "fp8_ds_v4 kv_cache must be [num_blocks, page_size, 1, 584], got ", shape_str(kv));
    MLA_CHECK((kv.size(1) == 1 || kv.stride(1) == mla_sm90::kDsV4TokenBytes) &&
                  (kv.size(0) == 1 || kv.stride(0) >= kv.size(1) * mla_sm90::kDsV4TokenBytes),
              "fp8_ds_v4 kv_cache blocks must be contiguous (strides [>= page_size * 584, 584, *, 1]), got strides ",
              kv.stride(0), ", ", kv.stride(1));
    MLA_CHECK(aligned(kv, 1, 16), "fp8_ds_v4 kv_cache blocks must start at 16-byte boundaries");
  } else {
    MLA_CHECK(kv.element_size() == 1, "fp8_ds_mla kv_cache must have 1-byte elements, got ",
              dtype_str(kv.scalar_type()));
    MLA_CHECK(kv.size(3) == kDsMlaBytes, "fp8_ds_mla kv_cache last dim must be 656 bytes, got ", kv.size(3));
    MLA_CHECK(kv.stride(2) % 16 == 0 && kv.stride(1) % 16 == 0 && kv.stride(0) % 16 == 0,
              "fp8_ds_mla kv_cache strides must be multiples of 16 bytes");
  }
  const int64_t h_kv = kv.size(2);
  MLA_CHECK(h_kv >= 1 && h_q % h_kv == 0, "h_q (", h_q, ") must be a multiple of h_kv (", h_kv, ")");
  MLA_CHECK(out.device() == dev && out.scalar_type() == q.scalar_type() && out.dim() == 4 && out.size(0) == B &&
                out.size(1) == s_q && out.size(2) == h_q && out.size(3) == kDV && out.stride(3) == 1,
            "out must be [", B, ", ", s_q, ", ", h_q, ", 512] ", dtype_str(q.scalar_type()), " on ", dev_str(dev),
            ", got ", shape_str(out), " ", dtype_str(out.scalar_type()));
  MLA_CHECK(lse.device() == dev && lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == B &&
                lse.size(1) == h_q && lse.size(2) == s_q && lse.stride(2) == 1,
            "lse must be float32 [", B, ", ", h_q, ", ", s_q, "] on ", dev_str(dev), ", got ", shape_str(lse), " ",
            dtype_str(lse.scalar_type()));
  MLA_CHECK(!overlaps_itself(out), "out must not overlap itself (two of its elements share memory: an expanded "
            "tensor?)");
  MLA_CHECK(!overlaps_itself(lse), "lse must not overlap itself (two of its elements share memory: an expanded "
            "tensor?)");
  MLA_CHECK(aligned16(q, 3), "q rows must start at 16-byte boundaries");
  // the epilogues store two channels (4 bytes) at a time; a misaligned store would be a device fault, which
  // poisons the CUDA context, so refuse the row here
  MLA_CHECK(aligned(out, 3, 4), "out rows must start at 4-byte boundaries (even strides)");
  if (kv_format != mla_sm90::kKvFp8DsV4)  // (fp8_ds_v4: its blocks, checked above)
    MLA_CHECK(aligned16(kv, 3), "kv_cache tokens must start at 16-byte boundaries");
  // a tensor map of the cache (common/launch.cuh, make_kv_map): the same 16-byte rule, and strides below 2^40 bytes
  if (tma_loads)
    MLA_CHECK(kv.stride(0) * kv.element_size() < (int64_t(1) << 40),
              "tma_loads=true needs kv_cache block strides below 2^40 bytes, got ", kv.stride(0) * kv.element_size());
}

// What the launch config is checked against: the problem's shape and the schedule's parts.
struct Geometry {
  int64_t kv_format, q_len, heads_q, heads_kv, page_size, num_parts;
  bool sparse = false;  // DecodeParams::sparse
};

// The plan's launch config (params.h, LaunchConfig; backends/cuda_sm90.py, launch_config and MAINLOOPS apply the same
// rules) against the problem it launches. A config that no kernel instance takes, or that would run wrong, is refused
// here with the field and what it must be; the launcher runs the config it is given.
void check_config(const mla_sm90::LaunchConfig& c, const Geometry& g) {
  using namespace mla_sm90;
  const int64_t m = c.mainloop, rows = g.q_len * (g.heads_q / g.heads_kv);
  MLA_CHECK(m == kWgmma || m == kSeesaw || m == kEtap || m == kFp8tConvert || m == kFp8tRegs || m == kSeesawFp8,
            "variant must be 2 (wgmma), 5 (two tiles in flight), 6 (tokens on M), 7 (tokens on M, fp8_e4m3, a "
            "converting warpgroup), 8 (tokens on M, fp8_e4m3 converted in registers) or 9 (5 for fp8_e4m3), got ", m);
  const bool seesaw = m == kSeesaw || m == kSeesawFp8, on_m = m == kEtap || m == kFp8tConvert || m == kFp8tRegs;
  const bool fp8 = g.kv_format != kKvSameAsQ;
  if (m == kSeesaw) MLA_CHECK(!fp8, "variant 5 needs a bf16/fp16 cache (kv_format 0), got kv_format ", g.kv_format);
  // (sparse: variant 7 takes any fp8 cache, variant 9 fp8_ds_mla and fp8_ds_v4, below)
  if (((m == kSeesawFp8 || m == kFp8tConvert) && !g.sparse) || m == kFp8tRegs)
    MLA_CHECK(g.kv_format == kKvFp8E4M3, "variant ", m, " needs an fp8_e4m3 cache (kv_format 1), got kv_format ",
              g.kv_format);
  if (seesaw) MLA_CHECK(g.q_len <= kSeesawMaxQLen, "variant ", m, " needs s_q <= ", kSeesawMaxQLen, ", got ", g.q_len);
  // tile_rows: one tile of 16 or 32 rows per KV head (tokens on M; a sparse v6 launch: row tiles of its fp8 tile,
  // kEtapFp8MaxRows rows), else row tiles of kBlockM
  const bool on_m_tiles = g.sparse && m == kEtap;
  if (on_m_tiles) {
    MLA_CHECK(c.tile_rows == kEtapFp8MaxRows, "tile_rows must be ", kEtapFp8MaxRows,
              " for a sparse launch of variant 6 (its fp8 tile), got ", c.tile_rows);
  } else if (on_m) {
    const int64_t max_rows = m != kEtap ? kFp8tMaxRows : fp8 ? kEtapFp8MaxRows : kEtapMaxRows;
    MLA_CHECK(rows <= max_rows, "variant ", m, " needs <= ", max_rows,
              " query rows per KV head (s_q * h_q / h_kv), got ", rows);
    MLA_CHECK((c.tile_rows == 16 || (c.tile_rows == 32 && max_rows >= 32)) && rows <= c.tile_rows, "tile_rows must be ",
              max_rows >= 32 ? "16 or 32" : "16", " and hold the ", rows, " query rows per KV head for variant ", m,
              ", got ", c.tile_rows);
  } else {
    MLA_CHECK(c.tile_rows == kBlockM, "tile_rows must be ", kBlockM, " for variant ", m, ", got ", c.tile_rows);
  }
  // tma_loads: boxes of one page per 64-token tile (a sparse launch gathers its rows by id)
  const bool tma = (seesaw && !g.sparse) || m == kFp8tRegs;
  if (m == kEtap && c.tma_loads)
    MLA_CHECK(!fp8, "tma_loads must be false for variant 6 with an fp8 cache (kv_format ", g.kv_format, ")");
  else if (m != kEtap)
    MLA_CHECK(c.tma_loads == tma, "tma_loads must be ", tma ? "true" : "false", " for variant ", m);
  if (c.tma_loads)
    MLA_CHECK(g.page_size % kBlockN == 0, "tma_loads=true (variant ", m, ") needs page_size % ", kBlockN,
              " == 0, got ", g.page_size);
  // paired: v5's row tiles in clusters of two
  const int64_t row_tiles =
      on_m_tiles ? (rows + kEtapFp8MaxRows - 1) / kEtapFp8MaxRows : on_m ? 1 : (rows + kBlockM - 1) / kBlockM;
  if (c.paired)
    MLA_CHECK(m == kSeesaw && row_tiles % 2 == 0, "paired=true needs variant 5 and an even number of ", kBlockM,
              "-row tiles per KV head, got variant ", m, " and ", row_tiles);
  // sparse: the flattened view of a top-k decode (params.h, DecodeParams::sparse), which v2 masks, v6 and v7 over
  // an fp8 cache, and v9 over the scaled fp8 caches
  if (g.sparse) {
    const bool scaled = g.kv_format == kKvFp8DsMla || g.kv_format == kKvFp8DsV4;
    MLA_CHECK(m == kWgmma || ((m == kEtap || m == kFp8tConvert) && fp8) || (m == kSeesawFp8 && scaled),
              "sparse=true needs variant 2, variant 6 or 7 with an fp8 cache, or variant 9 with an fp8_ds_mla or "
              "fp8_ds_v4 cache (the mainloops that skip -1 top-k slots), got variant ", m, " and kv_format ",
              g.kv_format);
    MLA_CHECK(g.q_len == 1, "sparse=true runs the flattened view: s_q 1 (one request per query position), got s_q ",
              g.q_len);
  }
  // fuse_combine: the combine tail of a cooperative launch
  if (c.fuse_combine) {
    // the tail lists at most kFusedMaxSplits split requests, one per part boundary: a balanced schedule's
    MLA_CHECK(!c.fixed_splits, "fuse_combine must be false with fixed_splits=true (a batch-invariant schedule "
              "splits any number of requests; the second kernel merges them per request)");
    MLA_CHECK(!seesaw, "fuse_combine must be false for variant ", m, " (it has no combine tail)");
    MLA_CHECK(g.num_parts <= kFusedMaxSplits, "fuse_combine=true needs num_parts <= ", kFusedMaxSplits, ", got ",
              g.num_parts);
    // the tail's units: < num_parts split requests x rows x 4, counted in an int with a stride of CTAs x 8
    const int64_t units = g.num_parts * g.q_len * g.heads_q * 4 + g.num_parts * row_tiles * g.heads_kv * 8;
    MLA_CHECK(units < INT32_MAX, "fuse_combine=true: ", units, " merge units overflow an int32 counter");
  }
}

// The arguments a plan owns (schedule, workspace, options), against the call's B, s_q, h_q and device.
void check_plan(int64_t B, int64_t s_q, int64_t h_q, const at::Device& dev, const at::Tensor& block_table,
                const at::Tensor& cache_seqlens, const at::Tensor& items, const at::Tensor& part_offsets,
                const at::Tensor& partial_out, const at::Tensor& partial_lse, const at::Tensor& num_splits,
                const at::Tensor& first_slot, double softmax_scale) {
  check_cuda_int32(block_table, "block_table", 2, dev);
  MLA_CHECK(block_table.size(0) == B && block_table.stride(1) == 1, "block_table must be [", B,
            ", max_blocks] with contiguous rows, got ", shape_str(block_table));
  check_cuda_int32(cache_seqlens, "cache_seqlens", 1, dev);
  MLA_CHECK(cache_seqlens.size(0) == B && cache_seqlens.is_contiguous(), "cache_seqlens must be contiguous [", B,
            "], got ", shape_str(cache_seqlens));
  check_cuda_int32(items, "items", 2, dev);
  MLA_CHECK(items.size(1) == 4 && items.is_contiguous(), "items must be contiguous [max_items, 4], got ",
            shape_str(items));
  check_cuda_int32(part_offsets, "part_offsets", 1, dev);
  MLA_CHECK(part_offsets.size(0) >= 2 && part_offsets.is_contiguous(), "part_offsets must be [num_parts + 1]");
  check_cuda_int32(num_splits, "num_splits", 1, dev);
  check_cuda_int32(first_slot, "first_slot", 1, dev);
  MLA_CHECK(num_splits.size(0) == B && first_slot.size(0) == B, "num_splits and first_slot must be [", B, "]");
  const int64_t max_slots = partial_lse.size(0);
  // the kernels' scratch: one kPartialRowBytes row per (slot, query row), which they fill in their own format
  static_assert(mla_sm90::kPartialRowBytes == kDV * sizeof(float), "partial rows are the workspace's fp32 rows");
  MLA_CHECK(partial_out.device() == dev && partial_out.scalar_type() == at::kFloat && partial_out.is_contiguous() &&
                partial_out.dim() == 4 && partial_out.size(1) == s_q && partial_out.size(2) == h_q &&
                partial_out.size(3) == kDV && partial_out.size(0) == max_slots,
            "partial_out must be contiguous float32 [max_slots, ", s_q, ", ", h_q, ", 512], got ",
            shape_str(partial_out));
  MLA_CHECK(partial_lse.device() == dev && partial_lse.scalar_type() == at::kFloat && partial_lse.is_contiguous() &&
                partial_lse.dim() == 3 && partial_lse.size(1) == s_q && partial_lse.size(2) == h_q,
            "partial_lse must be contiguous float32 [max_slots, ", s_q, ", ", h_q, "], got ", shape_str(partial_lse));
  MLA_CHECK(max_slots >= items.size(0), "partial buffers need max_slots >= max_items (", items.size(0), "), got ",
            max_slots);
  MLA_CHECK(aligned16(partial_out, 3), "partial_out must be 16-byte aligned");
  MLA_CHECK(softmax_scale > 0, "softmax_scale must be > 0, got ", softmax_scale);
}

// The plan's part of the parameter block (pointers into the schedule and workspace).
mla_sm90::DecodeParams plan_params(const at::Tensor& block_table, const at::Tensor& cache_seqlens,
                                   const at::Tensor& items, const at::Tensor& part_offsets,
                                   const at::Tensor& partial_out, const at::Tensor& partial_lse,
                                   const at::Tensor& num_splits, const at::Tensor& first_slot, double softmax_scale,
                                   bool causal, int64_t kv_format) {
  mla_sm90::DecodeParams p{};
  p.block_table = block_table.data_ptr<int32_t>();
  p.bt_stride = block_table.stride(0);
  p.cache_seqlens = cache_seqlens.data_ptr<int32_t>();
  p.items = items.data_ptr<int32_t>();
  p.part_offsets = part_offsets.data_ptr<int32_t>();
  p.num_parts = static_cast<int>(part_offsets.size(0) - 1);
  p.partial_out = partial_out.data_ptr<float>();
  p.partial_lse = partial_lse.data_ptr<float>();
  p.num_splits = num_splits.data_ptr<int32_t>();
  p.first_slot = first_slot.data_ptr<int32_t>();
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.causal = causal ? 1 : 0;
  p.kv_format = static_cast<int>(kv_format);
  return p;
}

// The call's part: q, the cache, its scale, out, lse and the geometry they carry (checked by check_call).
void set_call_params(mla_sm90::DecodeParams& p, const at::Tensor& q, const at::Tensor& kv,
                     const c10::optional<at::Tensor>& kv_scale, const at::Tensor& out, const at::Tensor& lse) {
  p.q = q.data_ptr();
  p.q_stride_b = q.stride(0); p.q_stride_s = q.stride(1); p.q_stride_h = q.stride(2);
  p.kv = kv.data_ptr();
  p.kv_stride_block = kv.stride(0); p.kv_stride_tok = kv.stride(1); p.kv_stride_head = kv.stride(2);
  p.kv_scale = p.kv_format == mla_sm90::kKvFp8E4M3 ? kv_scale->data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.out_stride_b = out.stride(0); p.out_stride_s = out.stride(1); p.out_stride_h = out.stride(2);
  p.lse = lse.data_ptr<float>();
  p.lse_stride_b = lse.stride(0); p.lse_stride_h = lse.stride(1);
  const int64_t s_q = q.size(1), h_q = q.size(2), h_kv = kv.size(2);
  p.batch = static_cast<int>(q.size(0)); p.q_len = static_cast<int>(s_q); p.heads_q = static_cast<int>(h_q);
  p.heads_kv = static_cast<int>(h_kv); p.page_size = static_cast<int>(kv.size(1));
  p.num_blocks = kv.size(0);
  p.block_ids = static_cast<uint32_t>(std::min<int64_t>(p.num_blocks, int64_t(1) << 31));
  p.rows_per_kv_head = static_cast<int>(s_q * (h_q / h_kv));
  p.num_row_tiles = (p.rows_per_kv_head + 63) / 64;
  p.q_is_bf16 = q.scalar_type() == at::kBFloat16;
}

mla_sm90::LaunchConfig launch_config(int64_t variant, int64_t tile_rows, bool tma_loads, bool paired,
                                     bool fuse_combine, bool fixed_splits) {
  return {static_cast<int>(variant), static_cast<int>(tile_rows), tma_loads, paired, fuse_combine, fixed_splits};
}

// The decode launch, then the combine launch unless the decode merges the split rows itself.
void launch(const mla_sm90::DecodeParams& p, const mla_sm90::LaunchConfig& cfg, const at::Device& dev) {
  if (p.batch == 0) return;
  const c10::cuda::CUDAGuard guard(dev);
  void* stream = at::cuda::getCurrentCUDAStream(dev.index()).stream();
  int err = mla_sm90::launch_decode(p, cfg, stream);
  TORCH_CHECK(err != mla_sm90::kLaunchNoTensorMap,
              "cuda_sm90_decode: tma_loads=true, but no TMA tensor map describes this kv_cache (its address, strides, "
              "or no cuTensorMapEncodeTiled in the driver)");
  if (err != 0) {
    const std::string msg = cat("cuda_sm90_decode: kernel launch failed: ",
                                cudaGetErrorString(static_cast<cudaError_t>(err)),
                                cfg.fuse_combine ? " (fuse_combine=true: a cooperative launch, every CTA of the grid "
                                                   "resident at once; plan with fuse_combine=False)"
                                                 : "",
                                cfg.paired ? " (paired=true: clusters of two CTAs)" : "");
    TORCH_CHECK(false, msg);
  }
  if (cfg.fuse_combine) return;  // the split rows were merged inside the decode launch

  mla_sm90::CombineParams c = mla_sm90::combine_params(p);
  c.fixed_splits = cfg.fixed_splits ? 1 : 0;
  err = mla_sm90::launch_combine(c, stream);
  TORCH_CHECK(err == 0, "cuda_sm90_decode: combine launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void cuda_sm90_decode(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                      const at::Tensor& cache_seqlens, const at::Tensor& items, const at::Tensor& part_offsets,
                      const c10::optional<at::Tensor>& kv_scale, const at::Tensor& out, const at::Tensor& lse,
                      const at::Tensor& partial_out, const at::Tensor& partial_lse, const at::Tensor& num_splits,
                      const at::Tensor& first_slot, double softmax_scale, bool causal, int64_t kv_format,
                      int64_t variant, int64_t tile_rows, bool tma_loads, bool paired, bool fuse_combine,
                      bool fixed_splits, bool sparse, const c10::optional<at::Tensor>& attn_sink) {
  check_call(q, kv, kv_scale, out, lse, kv_format, tma_loads);
  MLA_CHECK(!sparse || !causal, "sparse=true cannot be causal (the top-k indexer chose the keys)");
  MLA_CHECK(sparse || kv_format != mla_sm90::kKvFp8DsV4, "kv_format 3 (fp8_ds_v4) needs sparse=true");
  if (attn_sink.has_value()) {
    MLA_CHECK(sparse, "attn_sink needs sparse=true (the sparse instances apply it)");
    MLA_CHECK(attn_sink->device() == q.device() && attn_sink->scalar_type() == at::kFloat && attn_sink->dim() == 1 &&
                  attn_sink->size(0) == q.size(2) && attn_sink->stride(0) == 1,
              "attn_sink must be a contiguous float32 [h_q=", q.size(2), "] tensor on ", dev_str(q.device()), ", got ",
              shape_str(*attn_sink), " ", dtype_str(attn_sink->scalar_type()));
  }
  check_plan(q.size(0), q.size(1), q.size(2), q.device(), block_table, cache_seqlens, items, part_offsets, partial_out,
             partial_lse, num_splits, first_slot, softmax_scale);
  const mla_sm90::LaunchConfig cfg = launch_config(variant, tile_rows, tma_loads, paired, fuse_combine, fixed_splits);
  check_config(cfg, {kv_format, q.size(1), q.size(2), kv.size(2), kv.size(1), part_offsets.size(0) - 1, sparse});
  mla_sm90::DecodeParams p = plan_params(block_table, cache_seqlens, items, part_offsets, partial_out, partial_lse,
                                         num_splits, first_slot, softmax_scale, causal, kv_format);
  set_call_params(p, q, kv, kv_scale, out, lse);
  if (sparse) {  // the table holds cache token ids (params.h, DecodeParams::sparse)
    MLA_CHECK(kv.size(0) * kv.size(1) <= (int64_t(1) << 31), "sparse=true needs num_blocks * page_size <= 2^31 "
              "(int32 token ids), got ", kv.size(0) * kv.size(1));
    p.sparse = 1;
    p.sparse_page = p.page_size;
    p.attn_sink = attn_sink.has_value() ? attn_sink->data_ptr<float>() : nullptr;
    p.page_size = 1;
    p.block_ids = static_cast<uint32_t>(kv.size(0) * kv.size(1));
  }
  launch(p, cfg, q.device());
}

// One plan's decode bound once: the schedule, workspace and launch config are checked and packed when the plan is
// made, so an eager call passes five tensors and checks only those (backends/cuda_sm90.py, CudaSM90Backend.bind).
// The launch config is the plan's, read-only.
class PlannedDecode {
 public:
  PlannedDecode(at::Tensor block_table, at::Tensor cache_seqlens, at::Tensor items, at::Tensor part_offsets,
                at::Tensor partial_out, at::Tensor partial_lse, at::Tensor num_splits, at::Tensor first_slot,
                at::ScalarType q_dtype, at::ScalarType kv_dtype, int64_t q_len, int64_t heads_q, int64_t heads_kv,
                int64_t page_size, int64_t kv_dim, double softmax_scale, bool causal, int64_t kv_format,
                int64_t variant, int64_t tile_rows, bool tma_loads, bool paired, bool fuse_combine,
                bool fixed_splits)
      : cfg_(launch_config(variant, tile_rows, tma_loads, paired, fuse_combine, fixed_splits)),
        block_table_(std::move(block_table)),
        cache_seqlens_(std::move(cache_seqlens)), items_(std::move(items)), part_offsets_(std::move(part_offsets)),
        partial_out_(std::move(partial_out)), partial_lse_(std::move(partial_lse)), num_splits_(std::move(num_splits)),
        first_slot_(std::move(first_slot)), dev_(block_table_.device()), q_dtype_(q_dtype), kv_dtype_(kv_dtype),
        batch_(num_splits_.size(0)), q_len_(q_len), heads_q_(heads_q), heads_kv_(heads_kv), page_size_(page_size),
        kv_dim_(kv_dim), kv_format_(kv_format) {
    MLA_CHECK(dev_.is_cuda(), "block_table must be a CUDA tensor, got device ", dev_str(dev_));
    check_kv_format(kv_format);
    check_plan(batch_, q_len, heads_q, dev_, block_table_, cache_seqlens_, items_, part_offsets_, partial_out_,
               partial_lse_, num_splits_, first_slot_, softmax_scale);
    MLA_CHECK(heads_kv >= 1 && heads_q % heads_kv == 0, "heads_q (", heads_q, ") must be a multiple of heads_kv (",
              heads_kv, ")");
    check_config(cfg_, {kv_format, q_len, heads_q, heads_kv, page_size, part_offsets_.size(0) - 1});
    base_ = plan_params(block_table_, cache_seqlens_, items_, part_offsets_, partial_out_, partial_lse_, num_splits_,
                        first_slot_, softmax_scale, causal, kv_format);
  }

  // Launch on these tensors if they are what the plan was made for and pass check_call, and return (out, lse);
  // out and lse are allocated here when not given (at::empty costs less host time than a Python torch.empty).
  // Otherwise return nothing, having launched nothing: the caller's checked path then raises the error that
  // names the argument. A launch error raises.
  std::optional<std::tuple<at::Tensor, at::Tensor>> run(const at::Tensor& q, const at::Tensor& kv,
                                                        const std::optional<at::Tensor>& kv_scale,
                                                        const std::optional<at::Tensor>& out,
                                                        const std::optional<at::Tensor>& lse) const {
    if (q.dim() != 4 || q.scalar_type() != q_dtype_ || q.device() != dev_ || q.size(0) != batch_ ||
        q.size(1) != q_len_ || q.size(2) != heads_q_ || kv.dim() != 4 || kv.scalar_type() != kv_dtype_ ||
        kv.size(1) != page_size_ || kv.size(2) != heads_kv_ || kv.size(3) != kv_dim_ ||
        (kv_format_ != mla_sm90::kKvFp8E4M3 && kv_scale.has_value()))
      return std::nullopt;
    at::Tensor o = out.has_value() ? *out : at::empty({batch_, q_len_, heads_q_, kDV}, q.options());
    at::Tensor l = lse.has_value() ? *lse : at::empty({batch_, heads_q_, q_len_}, q.options().dtype(at::kFloat));
    try {
      check_call(q, kv, kv_scale, o, l, kv_format_, cfg_.tma_loads);
    } catch (const c10::Error&) {
      return std::nullopt;
    }
    mla_sm90::DecodeParams p = base_;
    set_call_params(p, q, kv, kv_scale, o, l);
    launch(p, cfg_, dev_);
    return std::make_tuple(std::move(o), std::move(l));
  }

  const mla_sm90::LaunchConfig& config() const { return cfg_; }

 private:
  mla_sm90::LaunchConfig cfg_;
  at::Tensor block_table_, cache_seqlens_, items_, part_offsets_, partial_out_, partial_lse_, num_splits_, first_slot_;
  at::Device dev_;
  at::ScalarType q_dtype_, kv_dtype_;
  int64_t batch_, q_len_, heads_q_, heads_kv_, page_size_, kv_dim_, kv_format_;
  mla_sm90::DecodeParams base_;
};

// A plan's split-KV schedule (schedule.cu) written into its buffers (mla_dispatch/metadata/split_plan.py): one
// launch on the current stream, no allocation, no host synchronisation (so it can run between CUDA-graph replays,
// or be captured). capacity < 0: no bound. The buffers and parameters are checked and packed once, when a plan's
// buffers are bound (PlannedSchedule); each run checks only the lengths it reads (a plan_decode or update of
// cuda_sm90 is this run and little else).
#define SCHED_CHECK(cond, ...)                                             \
  do {                                                                     \
    if (!(cond)) {                                                         \
      const std::string msg_ = cat("split_kv_schedule: ", __VA_ARGS__);    \
      TORCH_CHECK_VALUE(false, msg_);                                      \
    }                                                                      \
  } while (0)

class PlannedSchedule {
 public:
  PlannedSchedule(at::Tensor items, at::Tensor part_offsets, at::Tensor num_splits, at::Tensor slot_req,
                  at::Tensor first_slot, at::Tensor lengths, at::Tensor workspace, int64_t chunk_size,
                  int64_t overhead, int64_t capacity)
      : items_(std::move(items)), part_offsets_(std::move(part_offsets)), num_splits_(std::move(num_splits)),
        slot_req_(std::move(slot_req)), first_slot_(std::move(first_slot)), lengths_(std::move(lengths)),
        workspace_(std::move(workspace)), dev_(lengths_.device()) {
    SCHED_CHECK(dev_.is_cuda(), "lengths must be a CUDA tensor, got device ", dev_str(dev_));
    SCHED_CHECK(lengths_.dim() == 1, "lengths must be 1-D, got ", shape_str(lengths_));
    const int64_t B = lengths_.size(0), P = items_.size(0) - B;
    SCHED_CHECK(B >= 1 && B <= mla_sm90::kScheduleMaxBatch, "batch must be in [1, ", mla_sm90::kScheduleMaxBatch,
                "], got ", B);
    SCHED_CHECK(P >= 1 && P <= mla_sm90::kScheduleMaxParts,
                "items must have batch + num_parts rows with num_parts in [1, ", mla_sm90::kScheduleMaxParts,
                "], got ", items_.size(0), " rows for batch ", B);
    const std::pair<const at::Tensor*, std::pair<const char*, std::vector<int64_t>>> expected[] = {
        {&items_, {"items", {B + P, 4}}}, {&part_offsets_, {"part_offsets", {P + 1}}},
        {&num_splits_, {"num_splits", {B}}}, {&slot_req_, {"slot_req", {B + P}}},
        {&first_slot_, {"first_slot", {B}}}, {&lengths_, {"lengths", {B}}}};
    for (const auto& [t, want] : expected) {
      if (t->device() == dev_ && t->scalar_type() == at::kInt && t->is_contiguous() &&
          t->sizes().equals(at::IntArrayRef(want.second)))
        continue;
      std::string shape = "[";
      for (size_t i = 0; i < want.second.size(); ++i) shape += (i ? ", " : "") + std::to_string(want.second[i]);
      SCHED_CHECK(false, want.first, " must be a contiguous int32 tensor of shape ", shape, "] on ", dev_str(dev_),
                  ", got ", shape_str(*t), " ", dtype_str(t->scalar_type()), " on ", dev_str(t->device()));
    }
    SCHED_CHECK(workspace_.device() == dev_ && workspace_.scalar_type() == at::kInt && workspace_.is_contiguous() &&
                    workspace_.numel() >= 5 * B + 2 * P &&
                    reinterpret_cast<uintptr_t>(workspace_.data_ptr()) % 8 == 0,
                "workspace must be a contiguous 8-byte aligned int32 tensor of >= ", 5 * B + 2 * P,
                " elements on ", dev_str(dev_));
    SCHED_CHECK(chunk_size >= 1 && overhead >= 1, "chunk_size and overhead must be >= 1, got ", chunk_size, " and ",
                overhead);
    p_.items = items_.data_ptr<int32_t>();
    p_.part_offsets = part_offsets_.data_ptr<int32_t>();
    p_.num_splits = num_splits_.data_ptr<int32_t>();
    p_.slot_req = slot_req_.data_ptr<int32_t>();
    p_.first_slot = first_slot_.data_ptr<int32_t>();
    p_.lengths = lengths_.data_ptr<int32_t>();
    p_.workspace = workspace_.data_ptr<int32_t>();
    p_.batch = static_cast<int>(B);
    p_.num_parts = static_cast<int>(P);
    p_.chunk_size = static_cast<int>(std::min<int64_t>(chunk_size, INT32_MAX));
    p_.overhead = static_cast<int>(std::min<int64_t>(overhead, INT32_MAX));
    p_.capacity = capacity < 0 ? INT32_MAX : std::min<int64_t>(capacity, INT32_MAX);
  }

  // The schedule of the lengths cache_seqlens holds (int32 [batch] on the buffers' device; the buffers' own lengths
  // copy may be passed too), on the current stream.
  void run(const at::Tensor& cache_seqlens) const {
    if (!(cache_seqlens.device() == dev_ && cache_seqlens.scalar_type() == at::kInt && cache_seqlens.dim() == 1 &&
          cache_seqlens.size(0) == p_.batch && cache_seqlens.is_contiguous()))
      SCHED_CHECK(false, "cache_seqlens must be a contiguous int32 tensor of shape [", p_.batch, "] on ",
                  dev_str(dev_), ", got ", shape_str(cache_seqlens), " ", dtype_str(cache_seqlens.scalar_type()),
                  " on ", dev_str(cache_seqlens.device()));
    mla_sm90::ScheduleParams p = p_;
    p.seqlens = cache_seqlens.data_ptr<int32_t>();
    const c10::cuda::CUDAGuard guard(dev_);
    const int err = mla_sm90::launch_split_kv_schedule(p, at::cuda::getCurrentCUDAStream(dev_.index()).stream());
    TORCH_CHECK(err == 0, "split_kv_schedule: launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
  }

 private:
  at::Tensor items_, part_offsets_, num_splits_, slot_req_, first_slot_, lengths_, workspace_;
  at::Device dev_;
  mla_sm90::ScheduleParams p_{};
};
#undef SCHED_CHECK

// The same, bound and run in one call (tests, and any caller without a plan's buffers kept).
void split_kv_schedule(const at::Tensor& cache_seqlens, const at::Tensor& items, const at::Tensor& part_offsets,
                       const at::Tensor& num_splits, const at::Tensor& slot_req, const at::Tensor& first_slot,
                       const at::Tensor& lengths, const at::Tensor& workspace, int64_t chunk_size, int64_t overhead,
                       int64_t capacity) {
  PlannedSchedule(items, part_offsets, num_splits, slot_req, first_slot, lengths, workspace, chunk_size, overhead,
                  capacity)
      .run(cache_seqlens);
}

}  // namespace

// FRAGMENT: other extensions of this project may define ops in the same namespace.
TORCH_LIBRARY_FRAGMENT(mla_dispatch, m) {
  m.def(
      "cuda_sm90_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_seqlens, Tensor items, "
      "Tensor part_offsets, Tensor? kv_scale, Tensor(a!) out, Tensor(b!) lse, Tensor(c!) partial_out, "
      "Tensor(d!) partial_lse, Tensor num_splits, Tensor first_slot, float softmax_scale, bool causal, "
      "int kv_format, int variant, int tile_rows, bool tma_loads, bool paired, bool fuse_combine, "
      "bool fixed_splits, bool sparse=False, Tensor? attn_sink=None) -> ()");
}

TORCH_LIBRARY_IMPL(mla_dispatch, CUDA, m) { m.impl("cuda_sm90_decode", &cuda_sm90_decode); }

// For eager calls on plain tensors, without the dispatcher (backends/cuda_sm90.py takes these only outside
// torch.compile and with no TorchDispatchMode active, so tracing, fake tensors and functionalization still see
// the op). An op call with 18 arguments (22 now, with the launch config) costs ~2.8 us of host time (schema parsing,
// dispatch), a pybind11 call of the same signature ~0.6 us (this project's CPU host, a stand-in with an empty body);
// PlannedDecode.run takes five arguments and checks only those.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cuda_sm90_decode", &cuda_sm90_decode, "the op cuda_sm90_decode, called without the dispatcher");
  m.def("split_kv_schedule", &split_kv_schedule,
        "split_kv_schedule(cache_seqlens, items, part_offsets, num_splits, slot_req, first_slot, lengths, workspace, "
        "chunk_size, overhead, capacity): a plan's split-KV schedule in one launch (schedule.cu)");
  pybind11::class_<PlannedSchedule>(m, "PlannedSchedule",
                                    "a plan's split-KV schedule buffers and parameters, checked and packed once")
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t,
                          int64_t, int64_t>(),
           pybind11::arg("items"), pybind11::arg("part_offsets"), pybind11::arg("num_splits"),
           pybind11::arg("slot_req"), pybind11::arg("first_slot"), pybind11::arg("lengths"),
           pybind11::arg("workspace"), pybind11::arg("chunk_size"), pybind11::arg("overhead"),
           pybind11::arg("capacity"))
      .def("run", &PlannedSchedule::run, "run(cache_seqlens): the schedule of these lengths, one launch");
  pybind11::class_<PlannedDecode>(m, "PlannedDecode",
                                  "one plan's decode: schedule, workspace and launch config bound once")
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor, at::ScalarType, at::ScalarType, int64_t, int64_t, int64_t, int64_t, int64_t,
                          double, bool, int64_t, int64_t, int64_t, bool, bool, bool, bool>(),
           pybind11::arg("block_table"), pybind11::arg("cache_seqlens"), pybind11::arg("items"),
           pybind11::arg("part_offsets"), pybind11::arg("partial_out"), pybind11::arg("partial_lse"),
           pybind11::arg("num_splits"), pybind11::arg("first_slot"), pybind11::arg("q_dtype"),
           pybind11::arg("kv_dtype"), pybind11::arg("q_len"), pybind11::arg("heads_q"), pybind11::arg("heads_kv"),
           pybind11::arg("page_size"), pybind11::arg("kv_dim"), pybind11::arg("softmax_scale"),
           pybind11::arg("causal"), pybind11::arg("kv_format"), pybind11::arg("variant"), pybind11::arg("tile_rows"),
           pybind11::arg("tma_loads"), pybind11::arg("paired"), pybind11::arg("fuse_combine"),
           pybind11::arg("fixed_splits"))
      .def("run", &PlannedDecode::run,
           "run(q, kv_cache, kv_scale, out, lse) -> (out, lse) or None: launched (out and lse allocated when None), "
           "or None (nothing done) when an argument does not match the plan")
      .def_property_readonly("variant", [](const PlannedDecode& d) { return d.config().mainloop; })
      .def_property_readonly("tile_rows", [](const PlannedDecode& d) { return d.config().tile_rows; })
      .def_property_readonly("tma_loads", [](const PlannedDecode& d) { return d.config().tma_loads; })
      .def_property_readonly("paired", [](const PlannedDecode& d) { return d.config().paired; })
      .def_property_readonly("fuse_combine", [](const PlannedDecode& d) { return d.config().fuse_combine; })
      .def_property_readonly("fixed_splits", [](const PlannedDecode& d) { return d.config().fixed_splits; });
}
