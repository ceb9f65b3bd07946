"""Where the transformers integration's decode step spends its host time (issue 55, item 4): host synchronisations
and a cProfile of the decode steps, stock attention beside mla_dispatch's.

For each backend (``stock:eager``, ``stock:sdpa`` or a mla_dispatch backend), on the DeepSeek-V3-attention model of
dev/e2e_transformers.py (random weights, ``--layers`` layers):

- **syncs**: one greedy ``generate`` of ``--new`` tokens under ``torch.cuda.set_sync_debug_mode("warn")``; every
  synchronising CUDA call is recorded with the innermost Python frames that made it (this project's, transformers'
  or torch's), and counted per call site. A host synchronisation inside a layer makes the host wait for the GPU's
  queue, so its cost shows as host time of that layer in ``e2e_transformers.py --host-time``.
- **profile**: one ``generate`` under cProfile; the functions with the most own time and the integration's own
  functions by cumulative time, per decode step.

    python dev/integration_profile.py --backends stock:eager,cuda_sm90 --prompt 1024 --new 16 --out DIR
    python dev/integration_profile.py --tiny            # CPU smoke test (no CUDA: the sync list is empty)

Writes ``DIR/syncs-<backend>.json`` and ``DIR/profile-<backend>.txt``; prints a summary. Not part of the product.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import io
import json
import pathlib
import pstats
import sys
import traceback
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import e2e_transformers as e2e  # noqa: E402

_ROOTS = ("mla_dispatch", "transformers", "torch")


def _call_site(stack: list[traceback.FrameSummary], depth: int = 4) -> str:
    """The innermost ``depth`` frames of the stack that are not this file's or the warnings machinery's."""
    frames = [f for f in stack if "integration_profile.py" not in f.filename and "warnings.py" not in f.filename]
    picked = []
    for frame in reversed(frames):
        if any(f"/{root}/" in frame.filename for root in _ROOTS):
            parts = frame.filename.split("/")
            short = "/".join(parts[-2:])
            picked.append(f"{short}:{frame.lineno} {frame.name}")
        if len(picked) == depth:
            break
    return " <- ".join(picked)


def record_syncs(model, ids, mask, new: int, device: torch.device) -> dict:
    """Synchronising CUDA calls of one generate, counted per call site."""
    sites: collections.Counter = collections.Counter()
    if device.type != "cuda":
        e2e.run_once(model, ids, mask, new, device)
        return {"total": 0, "sites": []}
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites[_call_site(traceback.extract_stack())] += 1
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                e2e.run_once(model, ids, mask, new, device)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = original
    return {"total": sum(sites.values()), "sites": [{"count": n, "site": s} for s, n in sites.most_common()]}


def profile(model, ids, mask, new: int, device: torch.device) -> str:
    prof = cProfile.Profile()
    prof.enable()
    e2e.run_once(model, ids, mask, new, device)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats("mla_dispatch", 40)
    # where DecodePlan.run's time goes (the H200 of 2026-11-29: 43 ms of cumulative time, 4 ms of its own)
    stats.print_callees(r"api.py:\d+\(run\)")
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=None, help="comma list (default stock:eager,cuda_sm90; --tiny: "
                   "stock:eager,reference)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=None)
    p.add_argument("--new", type=int, default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    args = p.parse_args(argv)
    e2e_args = e2e.parser().parse_args(["--tiny"] if args.tiny else [])
    defaults = (dict(layers=2, intermediate=512, vocab=512, prompt=64, new=4) if args.tiny
                else dict(layers=4, intermediate=2048, vocab=8192, prompt=1024, new=16))
    for key, value in defaults.items():
        setattr(e2e_args, key, value)
    prompt = args.prompt or e2e_args.prompt
    new = args.new or e2e_args.new
    backends = [b for b in (args.backends or ("stock:eager,reference" if args.tiny else "stock:eager,cuda_sm90"))
                .split(",") if b]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _ = e2e.build_model(e2e_args, device, torch.bfloat16)
    ids, mask = e2e.prompts(args.batch, prompt, e2e_args.vocab, left_pad=False, seed=0, device=device)
    args.out.mkdir(parents=True, exist_ok=True)
    from mla_dispatch.integrations import transformers as mla_tf

    default_impl = model.config._attn_implementation
    for backend in backends:
        handle = None
        if e2e.is_stock(backend):
            e2e._set_stock_attention(model, backend)
        else:
            handle = mla_tf.enable(model, backend=backend, page_size=64)
        try:
            e2e.run_once(model, ids, mask, 2, device)  # builds and compiles what the run needs
            syncs = record_syncs(model, ids, mask, new, device)
            text = profile(model, ids, mask, new, device)
        finally:
            if handle is not None:
                handle.disable()
            model.set_attn_implementation(default_impl)
        name = backend.replace(":", "-")
        (args.out / f"syncs-{name}.json").write_text(json.dumps(
            {"backend": backend, "batch": args.batch, "prompt": prompt, "new": new, **syncs}, indent=2) + "\n")
        (args.out / f"profile-{name}.txt").write_text(text)
        print(f"== {backend}: {syncs['total']} synchronising calls in one generate of {new} + 1 tokens")
        for site in syncs["sites"][:8]:
            print(f"  {site['count']:>5}  {site['site']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
