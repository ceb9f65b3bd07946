// PrivateUse1 (NPU) kernel of the op mla_dispatch::amla_decode.
//
// STATUS: written, not compiled or run on hardware (needs torch_npu headers and the CANN toolkit).
//
// The op's schema and its fake (meta) kernel are defined in Python
// (mla_dispatch/kernels/ascend/ops.py, torch.library); this file only adds the NPU implementation,
// so the schema has one owner. Load order: import mla_dispatch.kernels.ascend.ops, then
// torch.ops.load_library(this .so) (ops.load_npu_extension() does both).
//
// Pattern (vllm-ascend csrc/torch_binding.cpp, catlass examples/python_extension): host tiling on
// the CPU from the host sequence lengths, tiling blob and workspace as NPU tensors, and the launch
// enqueued on torch_npu's task queue through OpCommand's custom handler on the current stream.
#include <torch/library.h>
#include <torch/extension.h>

#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#include "tiling.h"

extern "C" void amla_decode_launch(bool bf16, uint32_t blockDim, void *stream, void *q, void *kv, void *blockTable,
                                   void *seqlens, void *out, void *lse, void *workspace, void *tiling);

namespace {

void CheckArg(bool ok, const std::string &msg) { TORCH_CHECK(ok, "mla_dispatch::amla_decode: ", msg); }

void AmlaDecodeNpu(const at::Tensor &q, const at::Tensor &kv_cache, const at::Tensor &block_table,
                   const at::Tensor &cache_seqlens, c10::IntArrayRef seqlens_host, at::Tensor &out, at::Tensor &lse,
                   double softmax_scale, bool causal, int64_t num_cores) {
    CheckArg(q.dim() == 4 && q.size(3) == amla::kHeadDimQk, "q must be [B, s_q, h_q, 576], got " + c10::str(q.sizes()));
    CheckArg(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "q must be bfloat16 or float16");
    CheckArg(q.is_contiguous(), "q must be contiguous");
    CheckArg(kv_cache.dim() == 4 && kv_cache.size(2) == 1 && kv_cache.size(3) == amla::kHeadDimQk &&
                 kv_cache.is_contiguous() && kv_cache.scalar_type() == q.scalar_type(),
             "kv_cache must be contiguous [num_blocks, page_size, 1, 576] in q's dtype, got " +
                 c10::str(kv_cache.sizes()));
    CheckArg(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.is_contiguous(),
             "block_table must be contiguous int32 [B, max_blocks]");
    CheckArg(cache_seqlens.scalar_type() == at::kInt && cache_seqlens.numel() == q.size(0),
             "cache_seqlens must be int32 [B]");
    CheckArg(int64_t(seqlens_host.size()) == q.size(0), "seqlens_host must have B entries");
    CheckArg(out.is_contiguous() && out.size(3) == amla::kHeadDimV && out.scalar_type() == q.scalar_type(),
             "out must be contiguous [B, s_q, h_q, 512] in q's dtype");
    CheckArg(lse.is_contiguous() && lse.scalar_type() == at::kFloat, "lse must be contiguous float32 [B, h_q, s_q]");

    std::vector<int32_t> lens(seqlens_host.begin(), seqlens_host.end());
    const amla::AmlaTiling tiling = amla::ComputeTiling(
        lens, uint32_t(q.size(1)), uint32_t(q.size(2)), uint32_t(kv_cache.size(1)), uint32_t(block_table.size(1)),
        uint32_t(num_cores), float(softmax_scale), causal, q.scalar_type() == at::kBFloat16);
    const std::vector<uint8_t> blob = tiling.Serialize();

    auto bytes = at::TensorOptions().dtype(at::kByte);
    at::Tensor tiling_host = at::empty({int64_t(blob.size())}, bytes.pinned_memory(true));
    std::memcpy(tiling_host.data_ptr(), blob.data(), blob.size());
    at::Tensor tiling_dev = tiling_host.to(q.device(), /*non_blocking=*/true);
    at::Tensor workspace = at::empty({int64_t(tiling.header.wsTotalBytes)}, bytes.device(q.device()));

    const bool bf16 = q.scalar_type() == at::kBFloat16;
    const uint32_t block_dim = uint32_t(num_cores);
    void *ptrs[9] = {q.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr(), cache_seqlens.data_ptr(),
                     out.data_ptr(), lse.data_ptr(), workspace.data_ptr(), tiling_dev.data_ptr(), nullptr};
    aclrtStream stream = c10_npu::getCurrentNPUStream().stream(false);
    at_npu::native::OpCommand cmd;
    cmd.Name("amla_decode");
    cmd.SetCustomHandler([=]() -> int {
        amla_decode_launch(bf16, block_dim, stream, ptrs[0], ptrs[1], ptrs[2], ptrs[3], ptrs[4], ptrs[5], ptrs[6],
                           ptrs[7]);
        return 0;
    });
    cmd.Run();
    // workspace / tiling_dev stay alive until the queued launch ran: torch_npu's caching allocator
    // records their use on `stream` when they are freed at the end of this scope.
}

}  // namespace

TORCH_LIBRARY_IMPL(mla_dispatch, PrivateUse1, m) { m.impl("amla_decode", &AmlaDecodeNpu); }
