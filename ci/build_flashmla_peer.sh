#!/bin/bash
# Build DeepSeek FlashMLA's SM90 decode kernels, dense (bf16/fp16) and sparse (fp8_ds_mla, h_q 64/128), on the GPU
# machine, as the peer our cuda_sm90 backend is timed and tested against (docs/design.md §6). Not part of the
# library: FlashMLA stays an optional peer.
#
#   bash ci/build_flashmla_peer.sh FLASHMLA_SRC_DIR
#
# FLASHMLA_SRC_DIR: a plain source tree of deepseek-ai/FlashMLA (the device tool's `fetch`, carried in .peer/).
# Needs nvcc, torch with CUDA, ninja and the nvidia-cutlass wheel (its headers stand in for FlashMLA's csrc/cutlass
# submodule). FlashMLA's own api.cpp binds every architecture, and its sparse-decode entry point
# (csrc/api/sparse_decode.h) dispatches to SM100 kernels at run time; here only the SM90 objects are built: a
# binding file of our own binds dense_decode_fwd and sparse_decode_fwd, and the SM100 entry points that
# sparse_decode.h names are defined to raise (they are reached only on an SM100 GPU). About 5 minutes on 16 cores.
# Afterwards PYTHONPATH=FLASHMLA_SRC_DIR makes `import flash_mla` work.
set -e
FM=$(cd "${1:?usage: build_flashmla_peer.sh FLASHMLA_SRC_DIR}" && pwd)
CUT=$(python3 -c "import cutlass_library, pathlib; print(pathlib.Path(cutlass_library.__file__).parent / 'source')")
mkdir -p "$FM/csrc/mla_dispatch_peer"
cat > "$FM/csrc/mla_dispatch_peer/api_sm90.cpp" <<'CPP'
// mla_dispatch's binding of FlashMLA's SM90 decode entry points (ci/build_flashmla_peer.sh).
#include <pybind11/pybind11.h>
#include "dense_decode.h"
#include "sparse_decode.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
    m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
}
CPP
cat > "$FM/csrc/mla_dispatch_peer/no_sm100.cpp" <<'CPP'
// The SM100 kernels FlashMLA's sparse-decode entry point can dispatch to, not built for this SM90-only peer: each
// raises if reached (only on an SM100 GPU, where csrc/api/sparse_decode.h picks them).
#include <c10/util/Exception.h>
#include "params.h"
#include "sm100/decode/head64/kernel.h"
#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"
namespace sm100::decode::head64 {
template <ModelType M>
void run_flash_splitkv_mla_fp8_sparse_kernel(const SparseAttnDecodeParams&) {
    TORCH_CHECK(false, "this FlashMLA peer build has SM90 kernels only");
}
template void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32>(const SparseAttnDecodeParams&);
template void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1>(const SparseAttnDecodeParams&);
}
namespace sm100::fwd_for_small_topk::head128 {
template <SparseAttnFwdMode FWD_MODE, int D_QK>
void run_fwd_for_small_topk_phase1_kernel(const SparseFwdArgT<FWD_MODE>&) {
    TORCH_CHECK(false, "this FlashMLA peer build has SM90 kernels only");
}
template void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::DecodeWithSplitKV, 512>(
    const SparseFwdArgT<SparseAttnFwdMode::DecodeWithSplitKV>&);
}
CPP
cat > "$FM/setup_mla_dispatch_peer.py" <<PY
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension, CUDA_HOME
# absolute include paths (ninja compiles from the build folder); CUDA 13 keeps cuda/std under include/cccl
inc = ["$FM/csrc", "$FM/csrc/api", "$FM/csrc/kerutils/include", "$FM/csrc/sm90", "$CUT/include",
       "$CUT/tools/util/include", f"{CUDA_HOME}/include/cccl"]
nv = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
      "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
      "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
      "--use_fast_math", "-gencode", "arch=compute_90a,code=sm_90a", "--threads", "4"]
setup(name="flash_mla", ext_modules=[CUDAExtension("flash_mla.cuda", sources=[
    "csrc/mla_dispatch_peer/api_sm90.cpp",
    "csrc/mla_dispatch_peer/no_sm100.cpp",
    "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "csrc/smxx/decode/combine/combine.cu",
    "csrc/sm90/decode/dense/instantiations/bf16.cu",
    "csrc/sm90/decode/dense/instantiations/fp16.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/model1_persistent_h128.cu"],
    include_dirs=inc,
    extra_compile_args={"cxx": ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"], "nvcc": nv})],
    cmdclass={"build_ext": BuildExtension})
PY
cd "$FM" && MAX_JOBS=16 python3 setup_mla_dispatch_peer.py -q build_ext --inplace > /tmp/flashmla_build.log 2>&1 \
  || { grep -m20 -B2 -A6 -i 'error' /tmp/flashmla_build.log; exit 1; }
ls "$FM"/flash_mla/*.so
