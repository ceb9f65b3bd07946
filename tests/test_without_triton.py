"""Where ``import triton`` fails (the README's own set-up, ``pip install -e .``, installs no triton), ``info``,
``explain`` and ``mla_decode(backend="triton")`` give the import failure as a reason, never a traceback.

CI installs triton with the test extra, so the import is blocked here: a child process puts a finder at the front of
``sys.meta_path`` that refuses ``triton`` and its submodules, as an environment without it would.
"""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent("""
    import contextlib, importlib.abc, io, json, sys

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTriton())
    import torch
    import mla_dispatch
    from mla_dispatch.dispatch.registry import registered_names
    from mla_dispatch.tools.cli import main

    result = {}
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        result["info_rc"] = main(["info"])
    result["info"] = text.getvalue()

    q = torch.randn(2, 1, 16, 576, dtype=torch.float16)
    kv = torch.randn(4, 64, 1, 576, dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([100, 7], dtype=torch.int32)
    problem = mla_dispatch.plan_decode(q, kv, table, lens).problem
    report = mla_dispatch.explain(problem, candidates=registered_names())
    result["explain"] = {name: [str(r) for r in reasons] for name, _, reasons in report.candidates}
    try:
        mla_dispatch.mla_decode(q, kv, table, lens, backend="triton")
        result["named"] = "ran"
    except Exception as exc:
        result["named"] = f"{type(exc).__name__}: {exc}"
    out, _ = mla_dispatch.mla_decode(q, kv, table, lens)  # auto still runs (the reference)
    result["auto_finite"] = bool(out.isfinite().all())
    result["triton_imported"] = "triton" in sys.modules
    print("RESULT " + json.dumps(result))
""")


def test_info_explain_and_a_named_triton_give_reasons_without_triton():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    blocked = "import triton failed: ModuleNotFoundError: No module named 'triton'"
    assert result["info_rc"] == 0 and "Traceback" not in result["info"]
    assert "triton@" in result["info"] and blocked in result["info"]
    assert "auto would choose: reference" in result["info"]
    assert blocked in result["explain"]["triton"]
    assert result["explain"]["reference"] == []
    assert result["named"].startswith("NoBackendError: Backend 'triton' was requested but cannot run"), result["named"]
    assert blocked in result["named"]
    assert result["auto_finite"] and not result["triton_imported"]
