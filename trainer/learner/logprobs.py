"""A completion's log-probabilities under the distribution vLLM really sampled it from.

vLLM 0.32's sampler (`v1/sample/sampler.py`, `ops/topk_topp_sampler.py`, `ops/penalties.py`,
`logits_processor/builtin.py`) turns the model's logits into the sampling distribution in this
order, and `--logprobs-mode processed_logprobs` reports the sampled token's log-probability under
the result: allowed-token whitelist, logit bias, repetition / frequency / presence penalties, then
temperature, min-p, top-k, top-p, softmax. The same steps here, per row, with each row's own
settings (`trainer/data/sampling.py`), so the learner's probability of a recorded token and the
recorded behaviour probability describe the same distribution (docs/off_policy.md). At the
weights that served a call, the two agree to float32 rounding (tests/e2e/test_e2e_sampling.py).

Differentiable: masked tokens are -inf logits (no gradient); a recorded token the learner's own
truncation now excludes gets `OUTSIDE`, a constant, and the importance weights reject it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from trainer.data.sampling import Sampling

# The log-probability given to a recorded token that the learner's distribution no longer
# contains (it fell out of the top-k/top-p/min-p set): finite, so ratios stay numbers (exp of it
# is 0 in float32), with no gradient.
OUTSIDE = -1.0e4
# Logits processed at once (positions x rows x vocabulary): ~64 M, 256 MB in float32, so a
# chunk's temporaries (its sort's int64 indices the largest) stay near 1 GB at any batch size.
CHUNK_ELEMENTS = 1 << 26


def processed_logprobs(
    logits_BTV: torch.Tensor,
    completion_ids_BT: torch.Tensor,
    completion_mask_BT: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    sampling: Sequence[Sampling],
    *,
    with_entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each completion token (B, T) under its row's sampling distribution,
    and that distribution's entropy (B, T) if asked. `logits_BTV[:, t]` is the model's output
    before token t (the logits that predicted it).

    A few positions at a time (about `chunk_elements` logits), each chunk's steps recomputed in
    the backward pass (activation checkpointing): the sort, the masks, the penalties' counts
    and the softmaxes exist for one chunk at a time, never for the whole (B, T, V), and
    the graph keeps only the chunks' inputs (views of the logits) and their (B, T) outputs."""
    B, T, V = logits_BTV.shape
    step = max(1, chunk_elements // max(1, B * V))
    penalised = any(s.penalised for s in sampling)
    seen = _Seen(completion_ids_BT, completion_mask_BT, prompt_ids, V) if penalised else None
    picked, entropies = [], []
    for t in range(0, T, step):
        chunk = slice(t, min(T, t + step))
        args = (logits_BTV[:, chunk], completion_ids_BT[:, chunk], completion_mask_BT[:, chunk])
        if logits_BTV.requires_grad:
            picked.append(checkpoint(_chunk, sampling, seen, *args, t, use_reentrant=False))
            if with_entropy:
                with torch.no_grad():
                    entropies.append(_entropy(_processed(sampling, seen, *args, t)))
        else:  # no graph: one pass serves both
            x = _processed(sampling, seen, *args, t)
            picked.append(_picked(x, args[1]))
            if with_entropy:
                entropies.append(_entropy(x))
            del x
    logps = torch.cat(picked, dim=1)
    return logps, torch.cat(entropies, dim=1) if with_entropy else None


def _chunk(
    sampling: Sequence[Sampling],
    seen: _Seen | None,
    logits_BCV: torch.Tensor,
    ids_BC: torch.Tensor,
    mask_BC: torch.Tensor,
    start: int,
) -> torch.Tensor:
    x = _processed(sampling, seen, logits_BCV, ids_BC, mask_BC, start)
    return _picked(x, ids_BC)


def _picked(x_BCV: torch.Tensor, ids_BC: torch.Tensor) -> torch.Tensor:
    """The log-probabilities of the recorded tokens (B, C); OUTSIDE where excluded."""
    picked = x_BCV.log_softmax(-1).gather(-1, ids_BC.long().unsqueeze(-1)).squeeze(-1)
    return torch.where(torch.isfinite(picked), picked, torch.full_like(picked, OUTSIDE))


def _entropy(x_BCV: torch.Tensor) -> torch.Tensor:
    entropy: torch.Tensor = torch.special.entr(x_BCV.softmax(dim=-1)).sum(-1)
    return entropy


def _processed(
    sampling: Sequence[Sampling],
    seen: _Seen | None,
    logits_BCV: torch.Tensor,
    ids_BC: torch.Tensor,
    mask_BC: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """vLLM's steps, in its order, on the chunk of positions from `start`: the logits it
    sampled from."""
    x = logits_BCV.float()
    B, V = x.shape[0], x.shape[-1]
    device = x.device

    if any(s.allowed_token_ids is not None for s in sampling):
        allowed_BV = torch.ones(B, V, dtype=torch.bool, device=device)
        for b, s in enumerate(sampling):
            if s.allowed_token_ids is not None:
                allowed_BV[b] = False
                allowed_BV[b, list(s.allowed_token_ids)] = True
        x = x.masked_fill(~allowed_BV[:, None, :], float("-inf"))

    if any(s.logit_bias for s in sampling):
        bias_BV = torch.zeros(B, V, device=device)
        for b, s in enumerate(sampling):
            for token, value in s.logit_bias:
                bias_BV[b, token] += value
        x = x + bias_BV[:, None, :]

    if seen is not None:
        x = seen.penalise(x, ids_BC, mask_BC, seen.counts_before(start), sampling)

    temperature_B = torch.tensor([s.temperature for s in sampling], device=device)
    if bool((temperature_B != 1.0).any()):
        x = x / temperature_B[:, None, None]

    if any(s.min_p > 0 for s in sampling):
        with torch.no_grad():  # a mask: no gradient flows through which tokens it keeps
            min_p_B = torch.tensor([s.min_p for s in sampling], device=device)
            probs = x.softmax(dim=-1)
            below = probs < probs.amax(dim=-1, keepdim=True) * min_p_B[:, None, None]
            del probs
        x = x.masked_fill(below, float("-inf"))

    if any(s.top_k > 0 or s.top_p < 1.0 for s in sampling):
        with torch.no_grad():
            dropped = _top_k_top_p_mask(x, sampling)
        x = x.masked_fill(dropped, float("-inf"))
    return x


class _Seen:
    """What vLLM's `apply_penalties` looks at: the prompt's tokens, and the output's tokens so
    far (their counts), for any chunk of positions without a (B, T, V) tensor."""

    def __init__(
        self,
        ids_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        prompt_ids: Sequence[Sequence[int]],
        V: int,
    ) -> None:
        self.ids_BT, self.mask_BT, self.V = ids_BT.long(), mask_BT, V
        device = ids_BT.device
        self.prompt_BV = torch.zeros(ids_BT.shape[0], V, dtype=torch.bool, device=device)
        for b, ids in enumerate(prompt_ids):
            self.prompt_BV[b, list(ids)] = True

    def counts_before(self, t: int) -> torch.Tensor:
        """Each output token's count in positions before t (B, V)."""
        counts = torch.zeros(self.ids_BT.shape[0], self.V, device=self.ids_BT.device)
        return counts.scatter_add_(1, self.ids_BT[:, :t], self.mask_BT[:, :t].float())

    def penalise(
        self,
        x: torch.Tensor,
        ids_BC: torch.Tensor,
        mask_BC: torch.Tensor,
        counts_before_BV: torch.Tensor,
        sampling: Sequence[Sampling],
    ) -> torch.Tensor:
        """Repetition on tokens seen in the prompt or the output so far (logit / r if positive,
        * r if not), then frequency (times each output token's count so far) and presence
        (once per output token seen), at each position of the chunk."""
        B, C, V = x.shape
        device = x.device
        with torch.no_grad():
            one_hot = torch.zeros(B, C, V, device=device)
            one_hot.scatter_(-1, ids_BC.long().unsqueeze(-1), mask_BC.float().unsqueeze(-1))
            counts_BCV = counts_before_BV[:, None, :] + one_hot.cumsum(dim=1) - one_hot
            del one_hot
            seen_BCV = counts_BCV > 0
            repeated = seen_BCV | self.prompt_BV[:, None, :]
        repetition_B = torch.tensor([s.repetition_penalty for s in sampling], device=device)
        frequency_B = torch.tensor([s.frequency_penalty for s in sampling], device=device)
        presence_B = torch.tensor([s.presence_penalty for s in sampling], device=device)
        r = repetition_B[:, None, None]
        x = torch.where(repeated, torch.where(x > 0, x / r, x * r), x)
        x = x - frequency_B[:, None, None] * counts_BCV
        return x - presence_B[:, None, None] * seen_BCV.float()


def _top_k_top_p_mask(x: torch.Tensor, sampling: Sequence[Sampling]) -> torch.Tensor:
    """vLLM's `apply_top_k_top_p_pytorch`, as the mask of what it drops: sort ascending; keep
    the logits at or above the k-th largest; then drop the smallest whose cumulative probability
    is at most 1 - p (the largest always stays)."""
    B, C, V = x.shape
    device = x.device
    # stable: the backward pass recomputes this mask, and ties must fall the same way
    sorted_x, index = x.sort(dim=-1, descending=False, stable=True)
    k_B = torch.tensor([s.top_k if 0 < s.top_k < V else V for s in sampling], device=device)
    kth = sorted_x.gather(-1, (V - k_B).view(B, 1, 1).expand(B, C, 1))
    drop = sorted_x < kth
    p_B = torch.tensor([s.top_p for s in sampling], device=device)
    if bool((p_B < 1.0).any()):
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        cumulative = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        by_p = cumulative <= (1 - p_B)[:, None, None]
        by_p[..., -1] = False
        # rows without top-p keep everything (vLLM skips them when no row of its batch uses it)
        drop |= by_p & (p_B < 1.0)[:, None, None]
    return torch.empty_like(drop).scatter(-1, index, drop)
