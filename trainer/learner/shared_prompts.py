"""The logits before each completion token, computing what prompts share once.

A GRPO group is several samples of one prompt (a task's episodes start alike), and a real agent's
prompts are long and alike: BFCL's are ~460 tokens, 254 of them the same system preamble in every
call, answered in ~30. Forwarding every row whole computes each prompt G times, and the preamble
for every row, forward and backward. Here a batch goes through the model in three passes instead:

1. the prefix every row's prompt shares, once;
2. each distinct prompt's rest, once, on (a copy of) that prefix's keys and values;
3. every row's completion on its prompt's keys and values.

The keys and values carry their autograd graph, so the LoRA weights that made them get the
gradient every row sends back through them. The logits are the whole rows' (to float rounding:
tests/trainer/learner/test_shared_prompts.py), for about P_shared + K·P_rest + B·C tokens instead
of B·(P + C)
(K distinct prompts, B rows). A batch where that saves nothing goes through in one plain pass.

Off under gradient checkpointing (it recomputes layers in the backward pass and would append to
the cache twice) and when the base is sharded with FSDP2 (each rank's forward passes must come
in the same number: FSDP2 gathers weights in each).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def padded(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as TRL batches them and `completion_logits` reads them: prompts left-padded,
    completions right-padded; the ids and the attention mask, (rows, P + C)."""
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    ids, attention = [], []
    for p, c in zip(prompts, completions, strict=True):
        left, right = width_p - len(p), width_c - len(c)
        ids.append([pad_id] * left + [*p, *c] + [pad_id] * right)
        attention.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(attention, dtype=torch.long, device=device),
    )


def completion_logits(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompts: list[list[int]],
    completion_len: int,
    *,
    share: bool,
) -> torch.Tensor:
    """(rows, completion_len, vocabulary): the logits before each of the last `completion_len`
    positions of `input_ids` (left-padded prompts, right-padded completions, as TRL batches
    them); `prompts` are the rows' unpadded prompt ids."""
    plan = Plan.of(prompts, completion_len) if share else None
    if plan is None or plan.shared_tokens >= input_ids.size(0) * input_ids.size(1):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=False,
            logits_to_keep=completion_len + 1,
        )
        logits: torch.Tensor = out.logits[:, :-1]
        return logits
    return plan.logits(model, input_ids[:, -completion_len:], attention_mask[:, -completion_len:])


class Plan:
    """How a batch's prompts share: the common prefix, the distinct prompts, each row's."""

    def __init__(
        self, prefix: list[int], rests: list[list[int]], group: list[int], completion_len: int
    ) -> None:
        self.prefix = prefix  # what every prompt starts with
        self.rests = rests  # each distinct prompt past the prefix (never empty)
        self.group = group  # each row's distinct prompt
        self.completion_len = completion_len

    @classmethod
    def of(cls, prompts: list[list[int]], completion_len: int) -> Plan | None:
        if len(prompts) < 2 or not all(prompts):
            return None
        distinct: dict[tuple[int, ...], int] = {}
        group = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        firsts = [list(p) for p in distinct]
        # every prompt keeps at least its last token for pass 2: its logits predict the answer
        shared = min(_common(firsts), min(len(p) for p in firsts) - 1)
        return cls(firsts[0][:shared], [p[shared:] for p in firsts], group, completion_len)

    @property
    def shared_tokens(self) -> int:
        """The tokens the three passes forward (pass 2 padded to its longest rest)."""
        rest = max(len(r) for r in self.rests)
        return len(self.prefix) + len(self.rests) * rest + len(self.group) * self.completion_len

    def logits(
        self, model: Any, completions: torch.Tensor, completion_mask: torch.Tensor
    ) -> torch.Tensor:
        device = completions.device
        cache = None
        if self.prefix:  # pass 1: the prefix every prompt shares
            first = model(input_ids=torch.tensor([self.prefix], device=device), use_cache=True)
            cache = first.past_key_values
            cache.batch_repeat_interleave(len(self.rests))
        # pass 2: each distinct prompt's rest, right-padded, after the shared prefix
        width = max(len(r) for r in self.rests)
        lengths = torch.tensor([len(r) for r in self.rests], device=device)
        rests = torch.tensor([r + [0] * (width - len(r)) for r in self.rests], device=device)
        rest_mask = (torch.arange(width, device=device) < lengths[:, None]).long()
        shared = len(self.prefix)
        ones = torch.ones(len(self.rests), shared, dtype=torch.long, device=device)
        second = model(
            input_ids=rests,
            attention_mask=torch.cat([ones, rest_mask], 1),
            position_ids=shared + torch.arange(width, device=device).expand(len(self.rests), -1),
            past_key_values=cache,
            use_cache=True,
        )
        last = second.logits[torch.arange(len(self.rests), device=device), lengths - 1]
        # pass 3: every row's completion on its own prompt's keys and values
        group = torch.tensor(self.group, device=device)
        cache = second.past_key_values
        cache.batch_select_indices(group)
        rows, c = completions.shape
        mask = torch.cat(
            [torch.ones(rows, shared, dtype=torch.long, device=device), rest_mask[group]], 1
        )
        positions = (shared + lengths[group])[:, None] + torch.arange(c, device=device)
        third = model(
            input_ids=completions,
            attention_mask=torch.cat([mask, completion_mask.long()], 1),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        # A prompt's last logits predict its first completion token; each completion position's
        # predicts the next one (the last predicts nothing asked for).
        return torch.cat([last[group][:, None], third.logits[:, :-1]], 1)


def _common(prompts: list[list[int]]) -> int:
    """How many tokens every prompt starts with."""
    for i, column in enumerate(zip(*prompts, strict=False)):
        if len(set(column)) > 1:
            return i
    return min(len(p) for p in prompts)
