// AMLA MLA-decode kernel entry points (Ascend C, MIX 1 AIC : 2 AIV) and the host launcher.
//
// STATUS: written, not compiled or run on hardware (no CANN toolkit or NPU was available).
//
// Arguments (GM):
//   q            [B, s_q, h_q, 576]   bf16/fp16
//   kv           [num_blocks, page_size, 1, 576]  (interleaved NoPE|RoPE, V = first 512 channels)
//   block_table  int32 [B, max_blocks]
//   seqlens      int32 [B]
//   out          [B, s_q, h_q, 512]   bf16/fp16
//   lse          fp32 [B, h_q, s_q]   natural log, +inf for rows with no key
//   workspace    host/tiling.cpp ComputeTiling().header.wsTotalBytes bytes
//   tiling       the serialized AmlaTiling blob (header | items | partOffsets)
#include "amla_combine.h"
#include "amla_cube_block.h"
#include "amla_vec_block.h"

using namespace AscendC;

template <typename T>
__aicore__ inline void AmlaDecode(GM_ADDR q, GM_ADDR kv, GM_ADDR blockTable, GM_ADDR seqlens, GM_ADDR out,
                                  GM_ADDR lse, GM_ADDR workspace, GM_ADDR tiling) {
    amla::TilingView tv;
    tv.Load(tiling);
    TPipe pipe;
    if ASCEND_IS_AIC {
        amla::AmlaCubeBlock<T> cube;
        cube.Init(q, kv, blockTable, workspace, tv, &pipe);
        SetFlag<HardEvent::MTE1_MTE2>(EVENT_ID0);  // both L1 K buffers start free
        SetFlag<HardEvent::MTE1_MTE2>(EVENT_ID1);
        cube.Process();
        WaitFlag<HardEvent::MTE1_MTE2>(EVENT_ID0);
        WaitFlag<HardEvent::MTE1_MTE2>(EVENT_ID1);
    }
    if ASCEND_IS_AIV {
        {
            amla::AmlaVecBlock<T> vec;
            vec.Init(out, lse, seqlens, workspace, tv, &pipe);
            vec.Process();
        }
        if (tv.h.numSlots > 0) {
            SyncAll();  // every AIV's partial results are in GM
            pipe.Reset();
            amla::AmlaCombine<T> combine;
            combine.Init(out, lse, workspace, tv, &pipe);
            combine.Process();
        }
    }
}

extern "C" __global__ __aicore__ void amla_decode_bf16(GM_ADDR q, GM_ADDR kv, GM_ADDR blockTable, GM_ADDR seqlens,
                                                       GM_ADDR out, GM_ADDR lse, GM_ADDR workspace, GM_ADDR tiling) {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    AmlaDecode<bfloat16_t>(q, kv, blockTable, seqlens, out, lse, workspace, tiling);
}

extern "C" __global__ __aicore__ void amla_decode_fp16(GM_ADDR q, GM_ADDR kv, GM_ADDR blockTable, GM_ADDR seqlens,
                                                       GM_ADDR out, GM_ADDR lse, GM_ADDR workspace, GM_ADDR tiling) {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    AmlaDecode<half>(q, kv, blockTable, seqlens, out, lse, workspace, tiling);
}

#ifndef ASCENDC_CPU_DEBUG
// Host launcher, called from host/torch_binding.cpp inside an OpCommand custom handler.
// blockDim = number of AIC (each with its 2 AIV); must be <= the device's cube core count.
extern "C" void amla_decode_launch(bool bf16, uint32_t blockDim, void *stream, void *q, void *kv, void *blockTable,
                                   void *seqlens, void *out, void *lse, void *workspace, void *tiling) {
    if (bf16) {
        amla_decode_bf16<<<blockDim, nullptr, stream>>>((GM_ADDR)q, (GM_ADDR)kv, (GM_ADDR)blockTable,
                                                         (GM_ADDR)seqlens, (GM_ADDR)out, (GM_ADDR)lse,
                                                         (GM_ADDR)workspace, (GM_ADDR)tiling);
    } else {
        amla_decode_fp16<<<blockDim, nullptr, stream>>>((GM_ADDR)q, (GM_ADDR)kv, (GM_ADDR)blockTable,
                                                         (GM_ADDR)seqlens, (GM_ADDR)out, (GM_ADDR)lse,
                                                         (GM_ADDR)workspace, (GM_ADDR)tiling);
    }
}
#endif
