"""A completion's log-probabilities under the distribution vLLM really sampled it from.

vLLM 0.32's sampler (`v1/sample/sampler.py`, `ops/topk_topp_sampler.py`, `ops/penalties.py`,
`logits_processor/builtin.py`) turns the model's logits into the sampling distribution in this
order, and `--logprobs-mode processed_logprobs` reports the sampled token's log-probability under
the result: allowed-token whitelist, logit bias, repetition / frequency / presence penalties, then
temperature, min-p, top-k, top-p, softmax. The same steps here, per row, with each row's own
settings (`trainer/sampling.py`), so the learner's probability of a recorded token and the
recorded behaviour probability describe the same distribution (docs/off_policy.md). At the
weights that served a call, the two agree to float32 rounding (tests/test_e2e_sampling.py).

Differentiable: masked tokens are -inf logits (no gradient); a recorded token the learner's own
truncation now excludes gets `OUTSIDE`, a constant, and the importance weights reject it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.sampling import Sampling

# The log-probability given to a recorded token that the learner's distribution no longer
# contains (it fell out of the top-k/top-p/min-p set): finite, so ratios stay numbers (exp of it
# is 0 in float32), with no gradient.
OUTSIDE = -1.0e4


def processed_logprobs(
    logits_BTV: torch.Tensor,
    completion_ids_BT: torch.Tensor,
    completion_mask_BT: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    sampling: Sequence[Sampling],
    *,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each completion token (B, T) under its row's sampling distribution,
    and that distribution's entropy (B, T) if asked. `logits_BTV[:, t]` is the model's output
    before token t (the logits that predicted it)."""
    x = logits_BTV.float()
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

    if any(s.penalised for s in sampling):
        x = _penalties(x, completion_ids_BT, completion_mask_BT, prompt_ids, sampling)

    temperature_B = torch.tensor([s.temperature for s in sampling], device=device)
    if bool((temperature_B != 1.0).any()):
        x = x / temperature_B[:, None, None]

    if any(s.min_p > 0 for s in sampling):
        min_p_B = torch.tensor([s.min_p for s in sampling], device=device)
        probs = x.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p_B[:, None, None]
        x = x.masked_fill(probs < threshold, float("-inf"))

    if any(s.top_k > 0 or s.top_p < 1.0 for s in sampling):
        x = _top_k_top_p(x, sampling)

    logp_BTV = x.log_softmax(dim=-1)
    del x  # the graph keeps log-softmax's output, not its input: one (B, T, V) copy fewer
    picked = logp_BTV.gather(-1, completion_ids_BT.long().unsqueeze(-1)).squeeze(-1)
    logps = torch.where(torch.isfinite(picked), picked, torch.full_like(picked, OUTSIDE))
    entropy = None
    if with_entropy:
        with torch.no_grad():  # a row at a time: its temporaries are (T, V), not (B, T, V)
            entropy = torch.stack([torch.special.entr(row.exp()).sum(-1) for row in logp_BTV])
    return logps, entropy


def _penalties(
    x: torch.Tensor,
    ids_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    sampling: Sequence[Sampling],
) -> torch.Tensor:
    """vLLM's `apply_penalties`: repetition on tokens seen in the prompt or the output so far
    (logit / r if positive, * r if not), then frequency (times each output token's count so far)
    and presence (once per output token seen)."""
    B, T, V = x.shape
    device = x.device
    one_hot = torch.zeros(B, T, V, device=device)
    one_hot.scatter_(-1, ids_BT.long().unsqueeze(-1), mask_BT.float().unsqueeze(-1))
    counts_BTV = one_hot.cumsum(dim=1) - one_hot  # tokens before position t
    seen_BTV = counts_BTV > 0
    prompt_BV = torch.zeros(B, V, dtype=torch.bool, device=device)
    for b, ids in enumerate(prompt_ids):
        prompt_BV[b, list(ids)] = True
    repetition_B = torch.tensor([s.repetition_penalty for s in sampling], device=device)
    frequency_B = torch.tensor([s.frequency_penalty for s in sampling], device=device)
    presence_B = torch.tensor([s.presence_penalty for s in sampling], device=device)
    r = repetition_B[:, None, None]
    repeated = seen_BTV | prompt_BV[:, None, :]
    x = torch.where(repeated, torch.where(x > 0, x / r, x * r), x)
    x = x - frequency_B[:, None, None] * counts_BTV
    return x - presence_B[:, None, None] * seen_BTV.float()


def _top_k_top_p(x: torch.Tensor, sampling: Sequence[Sampling]) -> torch.Tensor:
    """vLLM's `apply_top_k_top_p_pytorch`: sort ascending; keep the logits at or above the k-th
    largest; then drop the smallest whose cumulative probability is at most 1 - p (the largest
    always stays); unsort."""
    B, T, V = x.shape
    device = x.device
    sorted_x, index = x.sort(dim=-1, descending=False)
    k_B = torch.tensor([s.top_k if 0 < s.top_k < V else V for s in sampling], device=device)
    kth = sorted_x.gather(-1, (V - k_B).view(B, 1, 1).expand(B, T, 1))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    p_B = torch.tensor([s.top_p for s in sampling], device=device)
    if bool((p_B < 1.0).any()):
        cumulative = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - p_B)[:, None, None]
        drop[..., -1] = False
        # rows without top-p keep everything (vLLM skips them when no row of its batch uses it)
        drop &= (p_B < 1.0)[:, None, None]
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(sorted_x).scatter(-1, index, sorted_x)
