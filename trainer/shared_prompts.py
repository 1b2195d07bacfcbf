"""The logits before each completion token, computing each distinct prompt once.

A GRPO group is several samples of one prompt (a task's episodes start alike), and a real
agent's prompt is long (BFCL's system prompt and function list: ~500 tokens) while its answer is
short (~30). Forwarding every row whole computes the same prompt G times, forward and backward:
here rows that share a prompt forward it once, keep its keys and values (with their autograd
graph, so the LoRA weights that made them still get their gradient), and forward only each
row's completion on top, repeated G times. The logits are the same as the whole rows' (to
float rounding: tests/test_shared_prompts.py), at P + G·C tokens instead of G·(P + C).

Off under gradient checkpointing (it recomputes layers in the backward pass and would append to
the cache twice) and when the base is sharded with FSDP2 (each rank's forward passes must come
in the same number: FSDP2 gathers weights in each).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch


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
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for row, prompt in enumerate(prompts):
        groups[tuple(prompt)].append(row)
    shared = {p: rows for p, rows in groups.items() if share and len(rows) > 1}
    alone = [row for p, rows in groups.items() if p not in shared for row in rows]
    parts: list[tuple[list[int], torch.Tensor]] = []
    if alone:
        index = torch.tensor(alone, device=input_ids.device)
        out = model(
            input_ids=input_ids[index],
            attention_mask=attention_mask[index],
            use_cache=False,
            logits_to_keep=completion_len + 1,
        )
        parts.append((alone, out.logits[:, :-1]))
    for shared_prompt, rows in shared.items():
        index = torch.tensor(rows, device=input_ids.device)
        completions = input_ids[index, -completion_len:]
        masks = attention_mask[index, -completion_len:]
        parts.append((rows, _on_one_prompt(model, list(shared_prompt), completions, masks)))
    if len(parts) == 1 and parts[0][0] == list(range(len(prompts))):
        return parts[0][1]
    out_logits = torch.cat([logits for _, logits in parts])
    order = torch.tensor([row for rows, _ in parts for row in rows], device=input_ids.device)
    return out_logits[torch.argsort(order)]


def _on_one_prompt(
    model: Any, prompt: list[int], completions: torch.Tensor, masks: torch.Tensor
) -> torch.Tensor:
    """The completions' logits, G rows on one prompt forwarded once."""
    g, c = completions.shape
    p = len(prompt)
    device = completions.device
    first = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
    cache = first.past_key_values
    cache.batch_repeat_interleave(g)  # one copy of the prompt's keys and values per row
    second = model(
        input_ids=completions,
        attention_mask=torch.cat([torch.ones(g, p, dtype=masks.dtype, device=device), masks], 1),
        position_ids=torch.arange(p, p + c, device=device).expand(g, c),
        past_key_values=cache,
        use_cache=True,
    )
    # The prompt's last logits predict the first completion token; each completion position's
    # predicts the next one (the last predicts nothing asked for).
    return torch.cat([first.logits[:, -1:].expand(g, 1, -1), second.logits[:, :-1]], 1)
