"""Why ``torch.compile`` fails on the Triton decode op (issue 59; tests/test_triton_gpu.py
``test_triton_gpu_op_under_torch_compile``, a strict xfail on the H200 with torch 2.11: "launcher() missing 13
required positional arguments: 'ExtraIndices', ..."), and whether a change of the traced launch's arguments fixes it.

Inductor compiles a user-defined Triton kernel launched through ``wrap_triton`` with a launcher of its own, built from
the arguments the call passed; our traced launch passes ``None`` for absent pointers (TMA descriptors, the sparse
extras) and leaves the kernel's defaulted parameters out. Each variant below runs the op's first opcheck case under
``torch.compile(fullgraph=True)`` in a fresh process (inductor caches per process) and checks it against the
reference:

- ``as_is``: today's arguments;
- ``explicit``: every defaulted parameter of ``mla_decode_kernel`` passed explicitly (pointers as a dummy tensor,
  integers 0), the ``HAS_*`` / ``TMA`` constexprs unchanged, so the kernel compiles the same code;
- ``no_none``: ``explicit`` plus the absent TMA descriptors as dummy tensors instead of ``None``.

    python dev/compile_probe.py            # on a GPU, after `python -m mla_dispatch build`

Prints one JSON line per variant: ``{"variant", "ok", "error", "report"}``. Not part of the product.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

VARIANTS = ("as_is", "explicit", "no_none")


def _child(variant: str) -> dict:
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import mla_dispatch.kernels.triton.decode as decode
    from mla_dispatch.backends.triton import TritonBackend
    from mla_dispatch.numerics.cases import poisoned_outputs
    from mla_dispatch.numerics.tolerance import compare_outputs
    from tests.test_triton_gpu import OPCHECK_CASES, _op_plan, case_reference
    from tests.test_triton_interpret import triton_op_args

    if variant != "as_is":
        fixed_of = decode.decode_kernel_fixed

        def fixed_explicit(**kw):
            grid, fixed, options = fixed_of(**kw)
            dummy = kw["seqlens"]
            for name in ("TopkLength", "AttnSink", "ExtraKV", "ExtraIndices", "ExtraTopkLength"):
                fixed.setdefault(name, dummy)
            for name in ("topk", "stride_ekb", "stride_ekt", "stride_ekh", "stride_eib", "stride_eis",
                         "extra_num_blocks"):
                fixed.setdefault(name, 0)
            if variant == "no_none":
                for name in ("KDesc", "RDesc", "QDesc", "QRDesc"):
                    if fixed.get(name, dummy) is None:
                        fixed[name] = dummy
            return grid, fixed, options

        decode.decode_kernel_fixed = fixed_explicit  # the probed case is dense: no call gives these names

    gen = torch.Generator().manual_seed(0)  # make_case draws on the CPU (as the tests)
    case, plan = _op_plan(*OPCHECK_CASES[0], gen)
    out, lse = poisoned_outputs(case)

    @torch.compile(fullgraph=True)
    def step(*args):
        torch.ops.mla_dispatch.triton_decode(*args)

    try:
        step(*triton_op_args(plan, case, out, lse))
        torch.cuda.synchronize()
    except Exception as exc:  # the probe reports what failed
        return {"variant": variant, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:600]}"}
    rep = compare_outputs(out, lse, *case_reference(case), TritonBackend.TOLERANCE)
    return {"variant": variant, "ok": bool(rep), "error": None, "report": rep.message}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2])))
        return 0
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--child", variant], capture_output=True, text=True,
                              timeout=600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        print(lines[-1] if lines else json.dumps({"variant": variant, "ok": False,
                                                  "error": f"exit {proc.returncode}: {proc.stderr[-600:]}"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
