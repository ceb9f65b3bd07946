"""The transformers integration on real transformers DeepSeek-V2/V3 models (randomly initialised, tiny).

Skipped, with the reason, where transformers (>= 5.17) is not importable. Nothing of transformers is
imitated: each test builds a ``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM`` from a config with a fresh
seed, runs it with stock transformers and through :func:`mla_dispatch.integrations.transformers.enable`, and
compares.

**What "agree" means.** The tiny models run in bf16, so stock transformers is itself some way off the exact
function of its weights. The exact function is approximated by the same weights in fp32 (stock attention,
teacher-forced on the same tokens). Our logits must be no further from it than stock bf16's are: the RMS of our
error at most ``RMS_RATIO`` (1.3) times stock's, and, as a guard against a few far-off logits, the largest at
most ``MAX_RATIO`` (2.5) times stock's largest. Measured over 50 seeds of the generate cases and 40 of each
stepwise test, the RMS ratio stayed within 0.87-1.17 (median 1.00) and the max ratio within 0.62-1.58 (a
maximum over a few thousand logits is a noisy statistic, hence its wider bound); a softmax scale 2% off pushes
the RMS ratio to 1.57-1.88, 5% off to 3.2-4.0 (the models are initialised with std 0.1 so that attention scores
are O(1) and attention decides the logits; with transformers' 0.02 the softmax is nearly uniform and no
attention bug would show). docs/design.md §5 bounds one attention call; end to end, through norms, MLPs and
lm_head, a bound relative to stock's own bf16 error is the one that carries over.

**Greedy tokens.** Free-running generations must give the same tokens, except that a sequence may part from
stock's at a near-tie: where the token ours picks has a stock logit within twice the largest difference between
the two runs' logits of stock's best (bf16 rounding may decide such a tie either way). Logits themselves are
compared teacher-forced (a logits processor feeds stock's tokens), so every step is compared.

Models are all-dense (``first_k_dense_replace`` = number of layers): a routed MoE's top-k is discontinuous, and
a bf16-sized difference can flip an expert and move the logits far more than any attention difference.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", minversion="5.17", reason="transformers>=5.17 is not installed (pip install -e '.[transformers]')")

from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,  # noqa: E402
                          DeepseekV3ForCausalLM, DynamicCache, LogitsProcessor, LogitsProcessorList)

from mla_dispatch.integrations import transformers as mla_tf  # noqa: E402

#: our error against the fp32 run may be this many times stock bf16's: RMS, and largest (see the module docstring)
RMS_RATIO = 1.3
MAX_RATIO = 2.5

#: the models' cache argument: ``cache`` in the newest 5.2x releases, ``past_key_values`` before (still accepted,
#: with a deprecation warning)
CACHE = "cache" if "cache" in inspect.signature(DeepseekV3ForCausalLM.forward).parameters else "past_key_values"

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def v3_config(*, heads=4, hidden=128, nope=32, v_dim=32, layers=2, vocab=256, rope_interleave=True, rope=YARN):
    """A tiny DeepSeek-V3: q_lora, kv_lora 512, RoPE 64, YaRN (mscale != 1), all layers dense."""
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=heads, num_key_value_heads=heads,
        n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, kv_lora_rank=512, q_lora_rank=64,
        qk_rope_head_dim=64, qk_nope_head_dim=nope, v_head_dim=v_dim, max_position_embeddings=512,  # 4 x 128 (YaRN)
        rope_interleave=rope_interleave, rope_parameters=dict(rope), initializer_range=0.1,
        pad_token_id=0, bos_token_id=1, eos_token_id=None)


def v2_config(*, heads=4, hidden=128, layers=2, vocab=256):
    """A tiny DeepSeek-V2-Lite: no q_lora (q_proj), complex-number RoPE, default rope scaling."""
    return DeepseekV2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=heads, num_key_value_heads=heads,
        n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.1,
        pad_token_id=0, bos_token_id=1, eos_token_id=None)


def build(config, seed: int, *, device="cpu", dtype=torch.bfloat16):
    torch.manual_seed(seed)
    cls = DeepseekV2ForCausalLM if isinstance(config, DeepseekV2Config) else DeepseekV3ForCausalLM
    return cls(config).to(device=device, dtype=dtype).eval()


def prompts(gen: torch.Generator, batch: int, length: int, vocab: int, *, left_pad: bool, right_pad: bool = False,
            device="cpu"):
    """Random token ids ``[batch, length]`` and their mask; with ``left_pad`` (``right_pad``) rows after the first
    lose a random number of leading (trailing) tokens to padding (id 0, mask 0)."""
    ids = torch.randint(3, vocab, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        pad = int(torch.randint(1, length // 2, (1,), generator=gen))
        if left_pad:
            ids[row, :pad], mask[row, :pad] = 0, 0
        elif right_pad:
            ids[row, -pad:], mask[row, -pad:] = 0, 0
    return ids.to(device), mask.to(device)


class ForceTokens(LogitsProcessor):
    """Makes generate() pick ``tokens[:, t]`` at step t (its raw logits are still returned)."""

    def __init__(self, tokens: torch.Tensor, prompt_len: int):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids, scores):
        t = input_ids.shape[1] - self.prompt_len
        forced = torch.full_like(scores, -math.inf)
        return forced.scatter_(1, self.tokens[:, t: t + 1], 0.0)


def generate(model, ids, mask, new_tokens: int, **kwargs):
    """Greedy generate; returns (new tokens [B, N], raw logits fp32 [B, N, vocab])."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1).float()


def fp32_logits(model, ids, mask, tokens):
    """The fp32 copy of ``model`` teacher-forced on ``tokens``: logits ``[B, N, vocab]`` of each generated step."""
    model32 = copy.deepcopy(model).float()
    seq = torch.cat([ids, tokens[:, :-1]], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(tokens[:, :-1])], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)  # generate's position ids for left-padded rows
    with torch.no_grad():
        logits = model32(seq, attention_mask=full_mask, position_ids=positions).logits
    return logits[:, ids.shape[1] - 1:].float()


def assert_as_close_as_stock(ours, stock, exact, what=""):
    """Our error against ``exact`` within RMS_RATIO of stock's in RMS, within MAX_RATIO in the largest."""
    assert torch.isfinite(ours).all(), f"{what}: non-finite logits"
    err_ours, err_stock = (ours - exact).abs(), (stock - exact).abs()
    rms_ours, rms_stock = err_ours.pow(2).mean().sqrt(), err_stock.pow(2).mean().sqrt()
    for name, o, s, bound in (("RMS", rms_ours, rms_stock, RMS_RATIO),
                              ("largest", err_ours.max(), err_stock.max(), MAX_RATIO)):
        assert o <= bound * s, (f"{what}: {name} logit error vs fp32 {o:.4g} > {bound} x stock bf16's {s:.4g} "
                                f"(max |logit| {exact.abs().max():.3g})")


def assert_same_greedy_tokens(ours, stock, stock_logits, noise):
    """Equal tokens, except from a step where ours picked a token whose stock logit is within ``noise`` of stock's
    best (a near-tie: no later step of that sequence is compared, their inputs differ)."""
    for row in range(stock.shape[0]):
        differ = (ours[row] != stock[row]).nonzero()
        if differ.numel() == 0:
            continue
        t = int(differ[0])
        short = float(stock_logits[row, t].max() - stock_logits[row, t, ours[row, t]])
        assert short <= noise, (f"row {row} parts from stock at step {t}: ours {int(ours[row, t])}, stock "
                                f"{int(stock[row, t])}, whose logit is {short:.4g} above ours' choice (noise {noise:.4g})")


def check_against_stock(model, ids, mask, new_tokens, *, backend, page_size, **enable_kwargs):
    """Stock generate, ours free-running and teacher-forced, the fp32 run; every assertion of the docstring."""
    stock_tokens, stock_logits = generate(model, ids, mask, new_tokens)
    with mla_tf.enable(model, backend=backend, page_size=page_size, **enable_kwargs) as handle:
        forced = LogitsProcessorList([ForceTokens(stock_tokens, ids.shape[1])])
        _, ours_logits = generate(model, ids, mask, new_tokens, logits_processor=forced)
        # one prefill, then every other step through mla_dispatch, never a copy of the whole cache; the steps of one
        # table width share a plan, updated step after step (issue 55)
        stats = dict(handle.stats)
        plans_made = stats.pop("plans_made")
        captures, replays = stats.pop("graph_captures", None), stats.pop("graph_replays", None)
        assert stats == {"decode_steps": new_tokens - 1, "other_steps": 1, "cache_copies": 0}, handle.stats
        assert 1 <= plans_made < new_tokens - 1, handle.stats
        if enable_kwargs.get("cuda_graphs"):
            # each layer: its first decode with a plan eager, the second captured, the rest replayed
            layers = model.config.num_hidden_layers
            assert handle.cuda_graphs, "a capture failed (see the RuntimeWarning)"
            assert captures >= layers and replays >= layers * (new_tokens - 1 - 2 * plans_made), handle.stats
        assert backend == "auto" or handle.last_backend == backend
        assert handle.last_plan.softmax_scale == model.model.layers[0].self_attn.scaling
        ours_tokens, _ = generate(model, ids, mask, new_tokens)
    exact = fp32_logits(model, ids, mask, stock_tokens)
    assert_as_close_as_stock(ours_logits, stock_logits, exact, "teacher-forced")
    # ours may prefer another token where the two runs' logits differ by more than stock's margin for its own
    noise = 2 * float((ours_logits - stock_logits).abs().max())
    assert_same_greedy_tokens(ours_tokens, stock_tokens, stock_logits, noise)
    return handle


# --------------------------------------------------------------------------------------
# CPU: the reference backend, bf16
# --------------------------------------------------------------------------------------

CASES = {
    # id: (config factory, batch, prompt length, padding, page size)
    "v3-b1-ps16": (lambda: v3_config(), 1, 24, None, 16),
    "v3-b2-ps64": (lambda: v3_config(), 2, 24, None, 64),
    "v3-b3-leftpad-ps8": (lambda: v3_config(), 3, 24, "left", 8),
    "v3-rotate_half-b2-leftpad-ps4": (lambda: v3_config(rope_interleave=False), 2, 20, "left", 4),
    "v2-b2-leftpad-ps16": (lambda: v2_config(), 2, 20, "left", 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_decode_matches_stock(case, seed, gen):
    make_config, batch, length, pad, page_size = CASES[case]
    model = build(make_config(), seed)
    ids, mask = prompts(gen, batch, length, model.config.vocab_size, left_pad=pad == "left")
    check_against_stock(model, ids, mask, 12, backend="reference", page_size=page_size)


def test_softmax_scale_is_the_modules_and_a_wrong_one_is_seen(seed, gen, monkeypatch):
    """The plan's scale is the module's (YaRN mscale included); the comparison catches a decode 10% off."""
    model = build(v3_config(), seed)
    attention = model.model.layers[0].self_attn
    mscale = 0.1 * math.log(4.0) + 1.0  # YaRN's mscale for factor 4, mscale_all_dim 1
    assert attention.scaling == pytest.approx((32 + 64) ** -0.5 * mscale ** 2, rel=1e-12)
    ids, mask = prompts(gen, 2, 20, model.config.vocab_size, left_pad=True)
    stock_tokens, stock_logits = generate(model, ids, mask, 8)

    class ScaledOff:  # the attention module as the decode sees it, its scale 10% off
        def __init__(self, module):
            self._module = module

        def __getattr__(self, name):
            value = getattr(self._module, name)
            return value * 1.1 if name == "scaling" else value

    right = mla_tf._absorbed_decode
    monkeypatch.setattr(mla_tf, "_absorbed_decode", lambda h, step, module, *a: right(h, step, ScaledOff(module), *a))
    with mla_tf.enable(model, backend="reference", page_size=16) as handle:
        forced = LogitsProcessorList([ForceTokens(stock_tokens, ids.shape[1])])
        _, wrong = generate(model, ids, mask, 8, logits_processor=forced)
        assert handle.last_plan.softmax_scale == pytest.approx(attention.scaling * 1.1)
    with pytest.raises(AssertionError, match="RMS logit error vs fp32 .* x stock bf16's"):
        assert_as_close_as_stock(wrong, stock_logits, fp32_logits(model, ids, mask, stock_tokens))


def test_disable_restores_stock(seed, gen):
    """After disable() (or the with block) the model is stock again: the same tokens and logits, bit for bit."""
    model = build(v3_config(), seed)
    ids, mask = prompts(gen, 2, 16, model.config.vocab_size, left_pad=True)
    stock = generate(model, ids, mask, 6)
    hooks = (len(model.model._forward_pre_hooks), len(model.model._forward_hooks))
    handle = mla_tf.enable(model, backend="reference")
    assert handle.enabled and all("forward" in layer.self_attn.__dict__ for layer in model.model.layers)
    generate(model, ids, mask, 6)
    handle.disable()
    handle.disable()  # twice is harmless
    assert not handle.enabled
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)
    assert (len(model.model._forward_pre_hooks), len(model.model._forward_hooks)) == hooks
    again = generate(model, ids, mask, 6)
    assert torch.equal(again[0], stock[0]) and torch.equal(again[1], stock[1])
    # and it can be enabled again
    with mla_tf.enable(model, backend="reference") as handle:
        generate(model, ids, mask, 3)
        assert handle.stats["decode_steps"] == 2


@pytest.mark.parametrize("python_slots", [256, 0], ids=["slots-python", "slots-torch"])
def test_paged_cache_mirrors_transformers_cache(python_slots, seed, gen, monkeypatch):
    """Our pages hold, per sequence, exactly transformers' cached latents of its real (unpadded) tokens, whichever
    way the new tokens' slots are computed (plain Python for a step's few tokens, torch ops for many)."""
    monkeypatch.setattr(mla_tf, "_PYTHON_SLOTS", python_slots)
    model = build(v3_config(), seed)
    ids, mask = prompts(gen, 3, 21, model.config.vocab_size, left_pad=True)
    with mla_tf.enable(model, backend="reference", page_size=8) as handle:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=9, min_new_tokens=9, do_sample=False,
                             return_dict_in_generate=True)
        cache = out.past_key_values
        real = torch.cat([mask, torch.ones(3, 8, dtype=mask.dtype)], dim=1).bool()  # the last token is not cached
        for layer_idx in range(model.config.num_hidden_layers):
            kv, table, lens = handle.latent_cache(layer_idx)
            assert kv.shape[1:] == (8, 1, 576)
            theirs = torch.cat([cache.layers[layer_idx].keys[:, 0], cache.layers[layer_idx].values[:, 0]], dim=-1)
            assert lens.tolist() == real.sum(1).tolist()
            for row in range(3):
                n = int(lens[row])
                slots = table[row].long()[torch.arange(n) // 8] * 8 + torch.arange(n) % 8
                ours = kv.view(-1, 576)[slots]
                assert torch.equal(ours, theirs[row][real[row]]), f"layer {layer_idx} row {row}"
        with pytest.raises(ValueError, match="layer_idx=7"):
            handle.latent_cache(7)


def stepwise_logits(model, ids, mask, tokens, *, between=None):
    """Prefill then one token per step (``tokens`` [B, N]) on a fresh DynamicCache; ``between(t, cache)`` runs
    before step t. Returns fp32 logits [B, N + 1, vocab] (the prefill's last, then each step's)."""
    cache = DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        for t in range(tokens.shape[1] + 1):
            if between is not None:
                mask, ids_or_none = between(t, cache, mask)
                if ids_or_none is not None:
                    ids = ids_or_none
            chunk = ids if t == 0 else tokens[:, t - 1: t]
            if t > 0:
                mask = torch.cat([mask, torch.ones_like(chunk)], dim=1)
            positions = (mask.cumsum(-1) - 1).clamp_min(0)[:, -chunk.shape[1]:]
            out = model(chunk, attention_mask=mask, position_ids=positions, use_cache=True, **{CACHE: cache})
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, dim=1)


def test_cache_changed_outside_is_copied_again(seed, gen):
    """transformers' cache is the truth: a prefill run while disabled, a beam-search reorder and a crop are seen."""
    model = build(v3_config(), seed)
    batch = 3
    ids, mask = prompts(gen, batch, 18, model.config.vocab_size, left_pad=True)
    tokens = torch.randint(3, model.config.vocab_size, (batch, 7), generator=gen)
    order = torch.tensor([2, 0, 1])

    def edit(t, cache, mask):
        if t == 3:  # beam search's reorder: rows change places (their masks with them)
            cache.reorder_cache(order)
            return mask[order], None
        if t == 5:  # drop the last two cached tokens and go on from the shorter cache
            cache.crop(-2)
            return mask[:, :-2], None
        return mask, None

    stock = stepwise_logits(model, ids, mask, tokens, between=edit)
    exact = stepwise_logits(copy.deepcopy(model).float(), ids, mask, tokens, between=edit)
    handles = []

    def enable_after_prefill(t, cache, mask):
        if t == 1:
            handles.append(mla_tf.enable(model, backend="reference", page_size=4))
        return edit(t, cache, mask)

    try:
        ours = stepwise_logits(model, ids, mask, tokens, between=enable_after_prefill)
    finally:
        for handle in handles:
            handle.disable()
    # step 1 copies the prefill, step 3 the reordered cache, step 5 the cropped one; steps 1-7 all decode
    stats = {k: v for k, v in handles[0].stats.items() if k != "plans_made"}
    assert stats == {"decode_steps": 7, "other_steps": 0, "cache_copies": 3}, handles[0].stats
    assert_as_close_as_stock(ours, stock, exact, "stepwise")


def test_right_padding(seed, gen):
    """Right-padded rows (pads between the prompt and the new tokens) keep only their real tokens. Stepwise with
    position ids from the mask: generate() itself numbers the new tokens of right-padded rows from 1."""
    model = build(v3_config(), seed)
    ids, mask = prompts(gen, 3, 20, model.config.vocab_size, left_pad=False, right_pad=True)
    tokens = torch.randint(3, model.config.vocab_size, (3, 6), generator=gen)
    stock = stepwise_logits(model, ids, mask, tokens)
    exact = stepwise_logits(copy.deepcopy(model).float(), ids, mask, tokens)
    with mla_tf.enable(model, backend="reference", page_size=8) as handle:
        ours = stepwise_logits(model, ids, mask, tokens)
        assert {k: v for k, v in handle.stats.items() if k != "plans_made"} == {
            "decode_steps": 6, "other_steps": 1, "cache_copies": 0}, handle.stats
        assert handle.latent_cache(0)[2].tolist() == (mask.sum(1) + 6).tolist()
    assert_as_close_as_stock(ours, stock, exact, "right padding")


def test_multi_token_decode_is_causal(seed, gen):
    """decode_max_query_len > 1: a 4-token step goes through mla_dispatch, causally, like stock's chunk."""
    model = build(v3_config(), seed)
    ids, mask = prompts(gen, 3, 16, model.config.vocab_size, left_pad=True)
    chunk = torch.randint(3, model.config.vocab_size, (3, 4), generator=gen)

    def run(model):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            positions = (mask.cumsum(-1) - 1).clamp_min(0)
            model(ids, attention_mask=mask, position_ids=positions, use_cache=True, **{CACHE: cache})
            full = torch.cat([mask, torch.ones_like(chunk)], dim=1)
            positions = (full.cumsum(-1) - 1)[:, -4:]
            out = model(chunk, attention_mask=full, position_ids=positions, use_cache=True, **{CACHE: cache})
        return out.logits.float()  # [B, 4, vocab]: each chunk token's next-token logits

    stock, exact = run(model), run(copy.deepcopy(model).float())
    with mla_tf.enable(model, backend="reference", page_size=8, decode_max_query_len=4) as handle:
        ours = run(model)
        assert handle.stats["decode_steps"] == 1 and handle.last_plan.problem.q_len == 4
        assert handle.last_plan.problem.causal
    assert_as_close_as_stock(ours, stock, exact, "4-token step")
    with mla_tf.enable(model, backend="reference", decode_max_query_len=3) as handle:
        run(model)  # 4 new tokens > 3: transformers' attention, and ours is still filled
        assert handle.stats == {"decode_steps": 0, "other_steps": 2, "cache_copies": 0, "plans_made": 0}


# --------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------


def test_enable_rejects_what_it_cannot_run(seed):
    model = build(v3_config(layers=1), seed)
    with pytest.raises(ValueError, match="model must be one of DeepseekV2ForCausalLM"):
        mla_tf.enable(torch.nn.Linear(4, 4))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="got LlamaForCausalLM"):
        mla_tf.enable(llama)
    with pytest.raises(ValueError, match="page_size must be an int >= 1, got 0"):
        mla_tf.enable(model, page_size=0)
    with pytest.raises(ValueError, match=r"decode_max_query_len must be an int in \[1, 16\], got 17"):
        mla_tf.enable(model, decode_max_query_len=17)
    with pytest.raises(ValueError, match="backend_options=.* need a named backend"):
        mla_tf.enable(model, backend_options={"variant": "x"})
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device, it is on cpu"):
        mla_tf.enable(model, backend="reference", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be True or False, got 1"):
        mla_tf.enable(model, backend="reference", cuda_graphs=1)
    with pytest.raises(ValueError, match="unknown backend 'no_such'"):
        mla_tf.enable(model, backend="no_such")
    # a named backend that cannot run here raises in enable(), not during generation
    with pytest.raises(NotImplementedError, match="Backend 'cuda_sm90' was requested but cannot run"):
        mla_tf.enable(model, backend="cuda_sm90")
    with pytest.raises(ValueError, match="model must be in bfloat16 or float16 .*got torch.float32"):
        mla_tf.enable(copy.deepcopy(model).float())
    quantised = copy.deepcopy(model)

    class OtherLinear(torch.nn.Linear):
        pass

    attention = quantised.model.layers[0].self_attn
    replacement = OtherLinear(attention.kv_b_proj.in_features, attention.kv_b_proj.out_features, bias=False)
    attention.kv_b_proj = replacement.to(torch.bfloat16)
    with pytest.raises(ValueError, match="kv_b_proj must be a torch.nn.Linear .*OtherLinear"):
        mla_tf.enable(quantised)
    with mla_tf.enable(model, backend="reference"):
        with pytest.raises(ValueError, match="model is already enabled"):
            mla_tf.enable(model)
    # nothing above left a trace on the model
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)
    assert not model.model._forward_pre_hooks and not model.model._forward_hooks


def test_unsupported_cache_or_mask_raises_naming_it(seed, gen):
    model = build(v3_config(layers=1), seed)
    ids, mask = prompts(gen, 2, 8, model.config.vocab_size, left_pad=False)
    with mla_tf.enable(model, backend="reference"):
        with pytest.raises(ValueError, match=r"past_key_values \(`cache` in newer transformers\) must be a "
                                             r"transformers DynamicCache .*got StaticCache"):
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static")
        mask4d = torch.zeros(2, 1, 8, 8, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"attention_mask must be the 2-D padding mask .*\[2, 1, 8, 8\]"):
            model(ids, attention_mask=mask4d, use_cache=True, **{CACHE: DynamicCache(config=model.config)})
        with pytest.raises(ValueError, match=r"attention_mask must be \[2, 8\]"):
            model(ids, attention_mask=mask[:, :5], use_cache=True, **{CACHE: DynamicCache(config=model.config)})
        # without a cache there is nothing to mirror: stock attention, no error
        model(ids, attention_mask=mask, use_cache=False)


def test_cache_grows_past_its_first_pages(seed, gen):
    """A long prompt then many decode steps on page size 1: the page pool doubles several times on the way."""
    model = build(v3_config(layers=1), seed)
    ids, mask = prompts(gen, 2, 12, model.config.vocab_size, left_pad=True)
    tokens = torch.randint(3, model.config.vocab_size, (2, 20), generator=gen)
    stock = stepwise_logits(model, ids, mask, tokens)
    exact = stepwise_logits(copy.deepcopy(model).float(), ids, mask, tokens)
    with mla_tf.enable(model, backend="reference", page_size=1) as handle:
        ours = stepwise_logits(model, ids, mask, tokens)
        kv, table, lens = handle.latent_cache(0)
        assert kv.shape[0] >= int(lens.sum()) and table.shape[1] == int(lens.max())
    assert_as_close_as_stock(ours, stock, exact, "page size 1")


# --------------------------------------------------------------------------------------
# GPU: our kernels
# --------------------------------------------------------------------------------------

GPU_CASES = {
    # id: (config factory, batch, prompt length, left padding)
    "v3-h16-b1": (lambda: v3_config(heads=16), 1, 200, False),
    "v3-h16-b4-leftpad": (lambda: v3_config(heads=16), 4, 200, True),
    "v3-h128-dsdims-b2-leftpad": (lambda: v3_config(heads=128, hidden=512, nope=128, v_dim=128), 2, 300, True),
    "v2-h16-b4-leftpad": (lambda: v2_config(heads=16), 4, 150, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_sm90", "triton"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_greedy_decode_matches_stock(case, backend, seed, gen):
    _gpu_check_against_stock(case, backend, seed, gen)


def _gpu_check_against_stock(case: str, backend: str, seed, gen, **enable_kwargs) -> None:
    """GPU_CASES[case] on the GPU through ``backend`` (skipped where it cannot run): check_against_stock."""
    from mla_dispatch import NoBackendError

    make_config, batch, length, left_pad = GPU_CASES[case]
    model = build(make_config(), seed, device="cuda")
    ids, mask = prompts(gen, batch, length, model.config.vocab_size, left_pad=left_pad, device="cuda")
    try:
        mla_tf.enable(model, backend=backend).disable()
    except NoBackendError as exc:
        pytest.skip(f"{backend} cannot run here: {exc}")
    check_against_stock(model, ids, mask, 16, backend=backend, page_size=64, **enable_kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_sm90", "triton"])
@pytest.mark.parametrize("case", ["v3-h16-b4-leftpad", "v3-h128-dsdims-b2-leftpad", "v2-h16-b4-leftpad"])
def test_gpu_decode_in_cuda_graphs_matches_stock(case, backend, seed, gen):
    """enable(cuda_graphs=True): every attention layer's decode replayed from its graph, logits and tokens as stock's
    (check_against_stock also counts the captures and replays)."""
    _gpu_check_against_stock(case, backend, seed, gen, cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("backend", ["cuda_sm90", "triton"])
def test_gpu_decode_step_makes_one_host_synchronisation(backend, cuda_graphs, seed, gen):
    """A forward through the integration makes the host wait for the GPU at most once (reading the attention mask's
    counts, prefill included), so the host can queue a decode step's layers while the GPU runs: the slots and the
    block table go from pinned memory (dev/integration_profile.py on the H200, 2026-11-29: 4 such calls per step
    before, 3 of them pageable copies). Synchronising calls are caught by torch's sync debug mode; those made under
    mla_dispatch's frames are counted (transformers' own mask and generate's stopping criteria make theirs outside
    them)."""
    import traceback
    import warnings

    from mla_dispatch import NoBackendError

    model = build(v3_config(), seed, device="cuda")
    ids, mask = prompts(gen, 2, 40, model.config.vocab_size, left_pad=False, device="cuda")
    try:
        handle = mla_tf.enable(model, backend=backend, cuda_graphs=cuda_graphs)
    except NoBackendError as exc:
        pytest.skip(f"{backend} cannot run here: {exc}")
    with handle:
        generate(model, ids, mask, 3)  # builds, compiles, plans (and captures) what the run needs
        before = handle.stats["decode_steps"], handle.stats["other_steps"]
        ours: list[str] = []

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return
            frames = [f for f in traceback.extract_stack() if "/mla_dispatch/" in f.filename]
            if frames:
                ours.append(f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno} {frames[-1].name}")

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                generate(model, ids, mask, 7)  # a prefill and 6 decode steps
            finally:
                torch.cuda.set_sync_debug_mode(0)
        steps = handle.stats["decode_steps"] - before[0]
        forwards = steps + handle.stats["other_steps"] - before[1]
    assert steps == 6 and forwards == 7
    assert len(ours) <= forwards, ours
    if cuda_graphs:  # the second generate's decode steps replay the first one's graphs (same batch, same plan)
        assert handle.stats["graph_replays"] >= 6 * model.config.num_hidden_layers, handle.stats
