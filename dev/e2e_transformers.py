"""End-to-end decode speed of a DeepSeek-V3-shaped transformers model: stock attention vs mla_dispatch.

Builds a randomly initialised ``DeepseekV3ForCausalLM`` from a config object (no hub download): DeepSeek-V3's
attention exactly (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, RoPE 64, nope 128, v 128, YaRN factor 40
as in its config.json) but only ``--layers`` layers, each with a small dense MLP, and a small vocabulary, so it
fits one GPU. For each batch size the same random prompts go through ``model.generate`` (greedy,
``--new`` + 1 tokens, no early stop) once per backend: ``stock`` is transformers' own attention, any other name is
:func:`mla_dispatch.integrations.transformers.enable` with that ``backend`` (``auto``, ``cuda_sm90``, ``triton``,
``flashmla``, ``reference``...; ``<name>+graphs``: with ``cuda_graphs=True``). A stopping criterion stamps the clock (after a device synchronisation) when the
prefill's token is out; generate's end is stamped the same way. Decode tokens/s = batch * new / (end - first
token), the median over ``--repeats`` runs after one warm-up run per backend (Triton and CUDA kernels build on
first use: run ``python -m mla_dispatch build`` beforehand). Tokens that differ from stock's are counted (random
weights in bf16 can tip a near-tie either way; many differences would mean a fault).

    python dev/e2e_transformers.py --backends stock,cuda_sm90,triton --batch 1,8 --prompt 1024 --new 64 --json OUT.json
    python dev/e2e_transformers.py --tiny          # CPU-sized model and run (reference backend), a smoke test

Not part of the product: the model is random and the figures include transformers' own per-step overhead,
which is what a transformers user sees. Needs transformers >= 5.17 (``pip install -e ".[transformers]"``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

#: DeepSeek-V3's attention (its config.json), with a small dense MLP and vocabulary.
V3_DIMS = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
               kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "beta_fast": 32, "beta_slow": 1},
               max_position_embeddings=163840)
#: ``--tiny``: the same structure at a size a CPU runs in seconds (kv_lora 512 and RoPE 64 kept: 576-wide tokens).
TINY_DIMS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512,
                 qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=4096)


def build_model(args, device: torch.device, dtype: torch.dtype):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    dims = TINY_DIMS if args.tiny else V3_DIMS
    config = DeepseekV3Config(vocab_size=args.vocab, intermediate_size=args.intermediate,
                              moe_intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                              first_k_dense_replace=args.layers, n_routed_experts=8, n_group=1, topk_group=1,
                              num_experts_per_tok=2, rope_interleave=True, pad_token_id=0, bos_token_id=1,
                              eos_token_id=None, **dims)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config)
    return model.to(dtype).eval(), config


class _Clock:
    """A generate() stopping criterion that never stops: it stamps the time the first new token is out."""

    def __init__(self, device: torch.device, progress=None):
        self.device, self.progress, self.first = device, progress, None

    def __call__(self, input_ids, scores, **kwargs):
        if self.first is None:
            _sync(self.device)
            self.first = time.perf_counter()
        if self.progress is not None:
            self.progress.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(model, ids, mask, new: int, device: torch.device, progress=None) -> dict:
    """One greedy generation of ``new + 1`` tokens; prefill and decode seconds and the tokens."""
    from transformers import StoppingCriteriaList

    clock = _Clock(device, progress)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new + 1, min_new_tokens=new + 1, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([clock]))
    _sync(device)
    end = time.perf_counter()
    return {"prefill_s": clock.first - start, "decode_s": end - clock.first, "tokens": out[:, ids.shape[1]:],
            "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}


def _kernel_us(model, ids, mask, new: int, device: torch.device) -> float:
    """The GPU's kernel time (µs, summed over kernels: torch.profiler's CUDA activity, graph replays' kernels
    included) of one greedy generation of ``new`` tokens."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        _sync(device)
    return sum(e.self_device_time_total for e in prof.key_averages())


def gpu_ms_per_step(model, ids, mask, new: int, device: torch.device) -> float:
    """The GPU's busy time per decode step (ms): kernel time of ``new + 1`` tokens less that of 1 (the prefill and
    its token), over ``new``. Beside ms/step it says whether a step waits for the host (ms/step above it) or for the
    GPU (ms/step at it)."""
    return (_kernel_us(model, ids, mask, new + 1, device) - _kernel_us(model, ids, mask, 1, device)) / new / 1e3


def prompts(batch: int, length: int, vocab: int, *, left_pad: bool, seed: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if left_pad:
        for row in range(1, batch):
            pad = int(torch.randint(1, max(2, length // 4), (1,), generator=gen))
            ids[row, :pad], mask[row, :pad] = 0, 0
    return ids.to(device), mask.to(device)


class _HostTimer:
    """Host time of each attention module's forward in decode steps (one new token per sequence), through forward
    hooks (they wrap whatever forward the module has: stock, or the integration's). No device synchronisation is
    taken, so the figure is what the layer costs the host while the GPU works through its queue: transformers' own
    per-layer work (projections, RoPE, its cache update) plus, with mla_dispatch enabled, the integration's."""

    def __init__(self, model):
        self.samples: list[float] = []
        self._start: dict[int, float] = {}
        self._hooks = []
        for module in model.modules():
            if type(module).__name__.endswith("Attention") and hasattr(module, "kv_a_proj_with_mqa"):
                self._hooks.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
                self._hooks.append(module.register_forward_hook(self._post, with_kwargs=True))

    def _pre(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden is not None and hidden.shape[1] == 1:
            self._start[id(module)] = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        start = self._start.pop(id(module), None)
        if start is not None:
            self.samples.append(time.perf_counter() - start)

    def take(self) -> list[float]:
        samples, self.samples = self.samples, []
        return samples

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def is_stock(backend: str) -> bool:
    """``stock`` (the model's default attention) or ``stock:<implementation>``: transformers' own, not mla_dispatch."""
    return backend == "stock" or backend.startswith("stock:")


def _set_stock_attention(model, backend: str) -> str | None:
    """``stock:eager`` / ``stock:sdpa``: transformers' own attention with that implementation (``stock``: the model's
    default); returns the implementation set, or None for ``stock`` and a mla_dispatch backend."""
    if not backend.startswith("stock:"):
        return None
    impl = backend.split(":", 1)[1]
    model.set_attn_implementation(impl)
    return impl


def bench(args, model, device: torch.device) -> list[dict]:
    from mla_dispatch.integrations import transformers as mla_tf

    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    rows = []
    for batch in args.batch:
        ids, mask = prompts(batch, args.prompt, args.vocab, left_pad=args.left_pad, seed=args.seed + batch,
                            device=device)
        warm_ids, warm_mask = ids[:, -min(32, args.prompt):], mask[:, -min(32, args.prompt):]
        stock_tokens, stock_name = None, None
        for backend in args.backends:
            row = {"backend": backend, "batch": batch, "prompt": args.prompt, "decode_steps": args.new}
            handle = timer = None
            default_impl = model.config._attn_implementation
            try:
                if is_stock(backend):
                    row["attn_implementation"] = _set_stock_attention(model, backend) or default_impl
                else:  # "<backend>+graphs": enable(cuda_graphs=True)
                    name, graphs = backend.removesuffix("+graphs"), backend.endswith("+graphs")
                    handle = mla_tf.enable(model, backend=name, page_size=args.page_size, cuda_graphs=graphs)
                run_once(model, warm_ids, warm_mask, 2, device)  # builds / JIT-compiles what the run needs
                if args.host_time:
                    timer = _HostTimer(model)
                bar = (tqdm(total=args.repeats * (args.new + 1), desc=f"b={batch} {backend}", leave=False)
                       if tqdm is not None else None)
                runs = [run_once(model, ids, mask, args.new, device, bar) for _ in range(args.repeats)]
                if bar is not None:
                    bar.close()
                if handle is not None:
                    row["backend_used"] = handle.last_backend
                    row["decode_steps_through_mla_dispatch"] = handle.stats["decode_steps"]
                    row["plans_made"] = handle.stats["plans_made"]
                    if handle.cuda_graphs:
                        row["graph_captures"] = handle.stats["graph_captures"]
                        row["graph_replays"] = handle.stats["graph_replays"]
                if timer is not None:
                    samples = timer.take()
                    row["host_samples"] = len(samples)
                    row["host_us_per_layer_step"] = 1e6 * statistics.median(samples) if samples else None
                    row["host_us_per_layer_step_p90"] = (1e6 * sorted(samples)[int(0.9 * (len(samples) - 1))]
                                                         if samples else None)
                if args.gpu_time and device.type == "cuda":  # after the host samples were taken (profiled runs)
                    row["gpu_ms_per_step"] = gpu_ms_per_step(model, ids, mask, args.new, device)
            except Exception as exc:  # a backend that cannot run is reported, the others still run
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                rows.append(row)
                print(f"  b={batch} {backend}: {row['error']}", file=sys.stderr)
                continue
            finally:
                if timer is not None:
                    timer.remove()
                if handle is not None:
                    handle.disable()
                model.set_attn_implementation(default_impl)
            decode_s = statistics.median(r["decode_s"] for r in runs)
            tokens = runs[0]["tokens"]
            row.update(prefill_ms=1e3 * statistics.median(r["prefill_s"] for r in runs),
                       decode_ms=1e3 * decode_s, ms_per_step=1e3 * decode_s / args.new,
                       decode_tokens_per_s=batch * args.new / decode_s,
                       decode_s_runs=[r["decode_s"] for r in runs], peak_mib=runs[0]["peak_mib"])
            if is_stock(backend):
                if stock_tokens is None:
                    stock_tokens, stock_name = tokens, backend
            elif stock_tokens is not None:
                row["tokens_differing_from_stock"] = int((tokens != stock_tokens).sum())
                row["tokens_compared"] = tokens.numel()
                row["tokens_compared_with"] = stock_name
            rows.append(row)
        stock = next((r for r in rows if r["batch"] == batch and is_stock(r["backend"]) and "error" not in r), None)
        for r in rows:
            if r["batch"] == batch and stock is not None and "error" not in r:
                r["speedup_vs_stock"] = r["decode_tokens_per_s"] / stock["decode_tokens_per_s"]
                r["speedup_baseline"] = stock["backend"]  # the first stock row that ran (another if it failed)
    return rows


def environment(args, device: torch.device, config) -> dict:
    import importlib.metadata as md

    from mla_dispatch import get_backend, registered_names
    from mla_dispatch.tools.bench import environment as bench_environment

    available = [b for b in args.backends if b in registered_names() and not get_backend(b).availability_reasons()]
    env = bench_environment(device, available)
    env["transformers"] = md.version("transformers")
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["git_commit"] = None
    env["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    env["model"] = {k: getattr(config, k) for k in (
        "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
        "v_head_dim", "num_hidden_layers", "intermediate_size", "vocab_size", "rope_interleave")}
    env["model"]["rope_parameters"] = dict(config.rope_parameters)
    env["dtype"] = args.dtype
    env["page_size"] = args.page_size
    env["left_pad"] = args.left_pad
    return env


def format_table(rows: list[dict]) -> str:
    head = (f"{'backend':>12} {'used':>10} {'batch':>5} {'prefill ms':>10} {'ms/step':>8} {'tok/s':>9} "
            f"{'x stock':>7} {'differ':>7} {'host us/layer':>13} {'GPU ms/step':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['backend']:>12} {'':>10} {r['batch']:>5} error: {r['error'][:80]}")
            continue
        differ = f"{r['tokens_differing_from_stock']}/{r['tokens_compared']}" if "tokens_compared" in r else ""
        speed = f"{r['speedup_vs_stock']:.2f}" if "speedup_vs_stock" in r else ""
        host = r.get("host_us_per_layer_step")
        used = r.get("backend_used") or r.get("attn_implementation") or ""
        lines.append(f"{r['backend']:>12} {used:>10} {r['batch']:>5} {r['prefill_ms']:>10.1f} "
                     f"{r['ms_per_step']:>8.2f} {r['decode_tokens_per_s']:>9.1f} {speed:>7} {differ:>7} "
                     f"{'' if host is None else f'{host:.0f}':>13} {r.get('gpu_ms_per_step', float('nan')):>11.2f}")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=None, help="comma list: stock (the model's default attention), "
                   "stock:eager, stock:sdpa and mla_dispatch backends (<name>+graphs: with cuda_graphs=True) "
                   "(default: stock,auto; --tiny: stock,reference)")
    p.add_argument("--batch", type=_ints, default=None, help="comma list of batch sizes (default 1,8; --tiny 1,2)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 1024; --tiny 64)")
    p.add_argument("--new", type=int, default=None, help="decode steps timed after the prefill's token "
                   "(default 64; --tiny 8)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --tiny 2)")
    p.add_argument("--intermediate", type=int, default=None, help="dense MLP width (default 2048; --tiny 512)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 8192; --tiny 512)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--left-pad", action="store_true", help="left-pad rows after the first (random lengths)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a CPU-sized model and run (smoke test)")
    p.add_argument("--host-time", action="store_true", help="also the host time of each attention layer's "
                   "forward in decode steps (forward hooks, no synchronisation): median and p90 per layer and step")
    p.add_argument("--gpu-time", action="store_true", help="also the GPU's kernel time per decode step (two more "
                   "generations under torch.profiler): a step whose ms/step is at it waits for the GPU, not the host")
    p.add_argument("--json", type=Path, default=None, help="write the environment and every row here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    big = dict(backends="stock,auto", batch=[1, 8], prompt=1024, new=64, layers=4, intermediate=2048, vocab=8192)
    tiny = dict(backends="stock,reference", batch=[1, 2], prompt=64, new=8, layers=2, intermediate=512, vocab=512)
    for key, value in (tiny if args.tiny else big).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.backends = [b for b in args.backends.split(",") if b]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    model, config = build_model(args, device, dtype)
    env = environment(args, device, config)
    print(f"{env['device']} | torch {env['torch']} | transformers {env['transformers']} | mla_dispatch "
          f"{env['mla_dispatch']} ({env['git_commit']}) | {env['date']}")
    print(f"{args.layers} layers of DeepSeek-V3 attention (hidden {config.hidden_size}, {config.num_attention_heads} "
          f"heads), {args.dtype}, prompt {args.prompt}, {args.new} decode steps, page size {args.page_size}")
    rows = bench(args, model, device)
    print(format_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"environment": env, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
