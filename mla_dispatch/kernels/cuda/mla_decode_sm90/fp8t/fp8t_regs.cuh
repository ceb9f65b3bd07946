// SM90 MLA decode, mainloop fp8t_regs (Mainloop::kFp8tRegs; v8 in the history): fp8t_convert's three warpgroups
// (fp8t.cuh) with no converted tile in shared memory: warpgroup 0 issues each tile's raw fp8 bytes by TMA
// (128-column boxes of the cache's tensor map, kv_map) into three stages, and the scorer and the accumulator convert
// their wgmma A operands (K, V^T) in registers. Whole-tile pages only (page_size % 64 == 0).
#pragma once
#include <cuda.h>

#include "fp8t/fp8t.cuh"

namespace mla_sm90 {

template <typename T, int kN>
__global__ void __launch_bounds__(Fp8t::kThreads, 1)
    mla_decode_fp8t_regs(const __grid_constant__ DecodeParams p, const __grid_constant__ CUtensorMap kv_map) {
  fp8t_decode<T, kN, true>(p, &kv_map);
}

}  // namespace mla_sm90
