// SM90 MLA decode, mainloop fp8t_convert (Mainloop::kFp8tConvert; v7 in the history): an fp8_e4m3 cache with at most
// 32 query rows per KV head, in three warpgroups (fp8t.cuh): warpgroup 0 loads each tile's fp8 rows into registers
// and stores them converted to fp16 into two shared-memory stages; the scorer (S^T = K Q^T, softmax) and the
// accumulator (O^T += V^T P^T) read the stages by wgmma from shared memory. Any page size. Sparse launches (kSparse:
// fp8_e4m3, fp8_ds_mla and fp8_ds_v4 caches) gather their tiles row by row from the token ids (fp8t.cuh).
#pragma once
#include "fp8t/fp8t.cuh"

namespace mla_sm90 {

template <typename T, int kN, int KvFmt = kKvFp8E4M3, bool kSparse = false>
__global__ void __launch_bounds__(Fp8t::kThreads, 1) mla_decode_fp8t_convert(const __grid_constant__ DecodeParams p) {
  fp8t_decode<T, kN, false, KvFmt, kSparse>(p, nullptr);
}

}  // namespace mla_sm90
