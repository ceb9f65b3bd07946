"""The one piece of math every fake vendor module shares: exact fp32 attention of one request.

The fakes compute from the *vendor's* inputs (its indptrs, page ids, layouts), not
from ours, so an adapter that builds them wrong gets a wrong answer.
"""

from __future__ import annotations

import torch


def attend(q: torch.Tensor, keys: torch.Tensor, dv: int, scale: float, causal: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` fp32 ``[s_q, H, D]``, ``keys`` fp32 ``[L, D]`` -> (out ``[s_q, H, dv]``, natural lse ``[s_q, H]``).

    Causal is bottom-right aligned: query token i sees keys ``0 .. L - s_q + i``.
    Rows that see nothing get out NaN and lse -inf (what a naive kernel leaves):
    adapters must turn them into the canonical 0 / +inf.
    """
    s_q, length = q.shape[0], keys.shape[0]
    scores = torch.einsum("shd,ld->shl", q, keys) * scale
    if causal:
        limit = length - s_q + 1 + torch.arange(s_q)
        mask = torch.arange(length)[None, :] < limit[:, None]
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if length else torch.full((s_q, q.shape[1]), float("-inf"))
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("shl,ld->shd", probs, keys[:, :dv]) if length else torch.full((s_q, q.shape[1], dv), float("nan"))
    return out, lse
