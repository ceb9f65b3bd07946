// Torch binding of the SM90 MLA decode family: argument checks (messages name
// the argument, the expected and the given value), parameter packing, the op
// registration (namespace mla_dispatch; fake implementations live in
// mla_dispatch/backends/cuda_sm90.py), and the same function as a plain Python
// function of the extension module for eager calls (see the end of this file).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <string>
#include <type_traits>

#include "params.h"

namespace {

constexpr int64_t kDQK = 576, kDV = 512, kDsMlaBytes = 656;

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

void cuda_sm90_decode(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table,
                      const at::Tensor& cache_seqlens, const at::Tensor& items, const at::Tensor& part_offsets,
                      const c10::optional<at::Tensor>& kv_scale, const at::Tensor& out, const at::Tensor& lse,
                      const at::Tensor& partial_out, const at::Tensor& partial_lse, const at::Tensor& num_splits,
                      const at::Tensor& first_slot, double softmax_scale, bool causal, int64_t kv_format,
                      int64_t variant, bool fuse_combine) {
  MLA_CHECK(q.is_cuda(), "q must be a CUDA tensor, got device ", dev_str(q.device()));
  const at::Device dev = q.device();
  MLA_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
            "q must be bfloat16 or float16, got ", dtype_str(q.scalar_type()));
  MLA_CHECK(q.dim() == 4 && q.size(3) == kDQK, "q must be [B, s_q, h_q, 576], got ", shape_str(q));
  MLA_CHECK(q.stride(3) == 1, "q must be contiguous in its last dim");
  const int64_t B = q.size(0), s_q = q.size(1), h_q = q.size(2);
  MLA_CHECK(kv_format >= 0 && kv_format <= 2, "kv_format must be 0 (q dtype), 1 (fp8_e4m3) or 2 (fp8_ds_mla), got ",
            kv_format);
  MLA_CHECK(kv.device() == dev, "kv_cache must be on ", dev_str(dev), ", got ", dev_str(kv.device()));
  MLA_CHECK(kv.dim() == 4, "kv_cache must be 4-D [num_blocks, page_size, h_kv, D], got ", shape_str(kv));
  MLA_CHECK(kv.stride(3) == 1, "kv_cache must be contiguous in its last dim");
  if (kv_format == 0) {
    MLA_CHECK(kv.scalar_type() == q.scalar_type(), "kv_cache dtype must equal q's (", dtype_str(q.scalar_type()), "), got ",
              dtype_str(kv.scalar_type()));
    MLA_CHECK(kv.size(3) == kDQK, "kv_cache last dim must be 576, got ", kv.size(3));
  } else if (kv_format == 1) {
    MLA_CHECK(kv.element_size() == 1, "fp8_e4m3 kv_cache must have 1-byte elements, got ", dtype_str(kv.scalar_type()));
    MLA_CHECK(kv.size(3) == kDQK, "kv_cache last dim must be 576, got ", kv.size(3));
    MLA_CHECK(kv_scale.has_value() && kv_scale->device() == dev && kv_scale->scalar_type() == at::kFloat &&
                  kv_scale->numel() == 1,
              "kv_scale must be a float32 tensor of one element on ", dev_str(dev), " for fp8_e4m3");
  } else {
    MLA_CHECK(kv.element_size() == 1, "fp8_ds_mla kv_cache must have 1-byte elements, got ", dtype_str(kv.scalar_type()));
    MLA_CHECK(kv.size(3) == kDsMlaBytes, "fp8_ds_mla kv_cache last dim must be 656 bytes, got ", kv.size(3));
    MLA_CHECK(kv.stride(2) % 16 == 0 && kv.stride(1) % 16 == 0 && kv.stride(0) % 16 == 0,
              "fp8_ds_mla kv_cache strides must be multiples of 16 bytes");
  }
  const int64_t h_kv = kv.size(2);
  MLA_CHECK(h_kv >= 1 && h_q % h_kv == 0, "h_q (", h_q, ") must be a multiple of h_kv (", h_kv, ")");
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
  MLA_CHECK(out.device() == dev && out.scalar_type() == q.scalar_type() && out.dim() == 4 && out.size(0) == B &&
                out.size(1) == s_q && out.size(2) == h_q && out.size(3) == kDV && out.stride(3) == 1,
            "out must be [", B, ", ", s_q, ", ", h_q, ", 512] ", dtype_str(q.scalar_type()), " on ", dev_str(dev),
            ", got ", shape_str(out), " ", dtype_str(out.scalar_type()));
  MLA_CHECK(lse.device() == dev && lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == B &&
                lse.size(1) == h_q && lse.size(2) == s_q && lse.stride(2) == 1,
            "lse must be float32 [", B, ", ", h_q, ", ", s_q, "] on ", dev_str(dev), ", got ", shape_str(lse), " ",
            dtype_str(lse.scalar_type()));
  const int64_t max_slots = partial_lse.size(0);
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
  MLA_CHECK(variant >= 1 && variant <= 6,
            "variant must be 1 (mma.sync), 2 (wgmma), 3 (wgmma, overlapped), 4 (wgmma, S split along D), 5 "
            "(wgmma, two tiles in flight) or 6 (wgmma, tokens on M), got ",
            variant);
  MLA_CHECK(softmax_scale > 0, "softmax_scale must be > 0, got ", softmax_scale);
  // 16-byte vector loads: every token/row start must be 16-byte aligned
  const auto aligned16 = [](const at::Tensor& t, int64_t dims) {
    if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
    for (int64_t d = 0; d < dims; ++d)
      if ((t.stride(d) * t.element_size()) % 16 != 0) return false;
    return true;
  };
  MLA_CHECK(aligned16(q, 3), "q rows must start at 16-byte boundaries");
  MLA_CHECK(aligned16(kv, 3), "kv_cache tokens must start at 16-byte boundaries");
  MLA_CHECK(aligned16(partial_out, 3), "partial_out must be 16-byte aligned");
  // variant 5 reads the cache with TMA (launch.cu): the same 16-byte rule, but for the tensor map
  if (variant == 5 && kv_format == 0 && kv.size(1) % 64 == 0)
    MLA_CHECK(kv.stride(0) * kv.element_size() < (int64_t(1) << 40),
              "variant 5 (TMA) needs kv_cache block strides below 2^40 bytes");
  if (B == 0) return;

  const c10::cuda::CUDAGuard guard(dev);
  mla_sm90::DecodeParams p{};
  p.q = q.data_ptr();
  p.q_stride_b = q.stride(0); p.q_stride_s = q.stride(1); p.q_stride_h = q.stride(2);
  p.kv = kv.data_ptr();
  p.kv_stride_block = kv.stride(0); p.kv_stride_tok = kv.stride(1); p.kv_stride_head = kv.stride(2);
  p.block_table = block_table.data_ptr<int32_t>();
  p.bt_stride = block_table.stride(0);
  p.cache_seqlens = cache_seqlens.data_ptr<int32_t>();
  p.kv_scale = kv_format == 1 ? kv_scale->data_ptr<float>() : nullptr;
  p.items = items.data_ptr<int32_t>();
  p.part_offsets = part_offsets.data_ptr<int32_t>();
  p.num_parts = static_cast<int>(part_offsets.size(0) - 1);
  p.out = out.data_ptr();
  p.out_stride_b = out.stride(0); p.out_stride_s = out.stride(1); p.out_stride_h = out.stride(2);
  p.lse = lse.data_ptr<float>();
  p.lse_stride_b = lse.stride(0); p.lse_stride_h = lse.stride(1);
  p.partial_out = partial_out.data_ptr<float>();
  p.partial_lse = partial_lse.data_ptr<float>();
  p.num_splits = num_splits.data_ptr<int32_t>();
  p.first_slot = first_slot.data_ptr<int32_t>();
  p.fuse_combine = fuse_combine ? 1 : 0;
  p.batch = static_cast<int>(B); p.q_len = static_cast<int>(s_q); p.heads_q = static_cast<int>(h_q);
  p.heads_kv = static_cast<int>(h_kv); p.page_size = static_cast<int>(kv.size(1));
  p.num_blocks = kv.size(0);
  p.rows_per_kv_head = static_cast<int>(s_q * (h_q / h_kv));
  p.num_row_tiles = (p.rows_per_kv_head + 63) / 64;
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.causal = causal ? 1 : 0;
  p.kv_format = static_cast<int>(kv_format);
  p.q_is_bf16 = q.scalar_type() == at::kBFloat16;
  p.variant = static_cast<int>(variant);
  void* stream = at::cuda::getCurrentCUDAStream(dev.index()).stream();
  bool combined = false;
  int err = mla_sm90::launch_decode(p, p.num_parts, stream, &combined);
  TORCH_CHECK(err == 0, "cuda_sm90_decode: kernel launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
  if (combined) return;  // the split rows were merged inside the decode launch

  err = mla_sm90::launch_combine(mla_sm90::combine_params(p), stream);
  TORCH_CHECK(err == 0, "cuda_sm90_decode: combine launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

}  // namespace

// FRAGMENT: other extensions of this project may define ops in the same namespace.
TORCH_LIBRARY_FRAGMENT(mla_dispatch, m) {
  m.def(
      "cuda_sm90_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_seqlens, Tensor items, "
      "Tensor part_offsets, Tensor? kv_scale, Tensor(a!) out, Tensor(b!) lse, Tensor(c!) partial_out, "
      "Tensor(d!) partial_lse, Tensor num_splits, Tensor first_slot, float softmax_scale, bool causal, "
      "int kv_format, int variant=2, bool fuse_combine=False) -> ()");
}

TORCH_LIBRARY_IMPL(mla_dispatch, CUDA, m) { m.impl("cuda_sm90_decode", &cuda_sm90_decode); }

// The same function without the dispatcher, for eager calls on plain tensors: a call of an op with
// these 18 arguments costs ~2.8 us of host time (schema parsing, dispatch), the pybind11 call ~0.6 us
// (measured on this project's CPU host with a stand-in of the same signature and an empty body). backends/cuda_sm90.py takes
// this path only outside torch.compile and with no TorchDispatchMode active, so tracing, fake
// tensors and functionalization still see the op.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cuda_sm90_decode", &cuda_sm90_decode, "the op cuda_sm90_decode, called without the dispatcher");
}
