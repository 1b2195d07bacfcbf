"""A step's batch in pieces that fit the device, whose gradients add up to the whole batch's.

The loss pass materialises the logits of every completion token over the whole vocabulary
(float32, several copies: the sampling transforms, log-softmax, entropy), so its memory grows
with rows x tokens x vocabulary: 32 rows of 768 tokens on a 152k vocabulary are 15 GB a copy, and
the whole batch at once ran an 80 GB GPU out of memory (bench/gpu_smoke.md). `pieces` cuts the
prepared batch (TRL's dict: prompts left-padded, completions right-padded) into pieces of at
most `budget` padded tokens, each trimmed to its own longest prompt and completion; the engine
backpropagates them one after another into the same gradients, then steps the optimizer once.

`share` is what each piece's loss is multiplied by so that the pieces' gradients sum to the
whole batch's, for each TRL loss: dapo (and cispo, vespo) already divide by the batch's kept
token count; grpo, sapo, luspo and dr_grpo average over rows (share: the piece's rows / the
batch's); bnpo divides by the piece's own kept tokens (share: those / the batch's). So the step
is the same step whatever the budget, up to float rounding
(tests/trainer/learner/test_microbatch.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Left-padded to the batch's longest prompt; sliced from the left.
PROMPT_KEYS = {"prompt_ids", "prompt_mask"}
# Right-padded to the batch's longest completion; sliced from the right.
COMPLETION_KEYS = {
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "ref_per_token_logps",
    "sampling_per_token_logps",
    "importance_sampling_ratio",
    "tool_mask",
}
ROW_MEAN_LOSSES = {"grpo", "sapo", "luspo", "dr_grpo"}
BATCH_TOKEN_LOSSES = {"dapo", "cispo", "vespo"}


Lengths = list[tuple[int, int]]  # each row's prompt and completion tokens


def lengths(batch: dict[str, Any]) -> Lengths:
    """Each row's unpadded prompt and completion length."""
    prompts = batch["prompt_mask"].sum(1).tolist()
    return list(zip(prompts, _completion_lengths(batch["completion_mask"]), strict=True))


def pieces(
    batch: dict[str, Any], budget: int, ranks: Sequence[Lengths] = ()
) -> list[dict[str, Any]]:
    """The batch in pieces of at most `budget` padded tokens each (rows x (longest prompt +
    longest completion)), longest rows first; a row longer than the budget is a piece alone.
    0: one piece, the batch as it is. With `ranks` (every rank's `lengths`, this one's included,
    as many rows each), the cuts fall at the same row counts on every rank, each piece within
    the budget everywhere: TRL gathers per-row metrics in each loss pass, which needs as many
    pieces of as many rows on every rank (and under FSDP2 each forward pass is a collective)."""
    if budget <= 0:
        return [batch]
    mine = lengths(batch)
    everyone = [sorted(r, key=lambda pc: -sum(pc)) for r in (ranks or [mine])]
    if any(len(r) != len(mine) for r in everyone):
        raise ValueError("every rank needs as many rows")
    order = sorted(range(len(mine)), key=lambda i: -sum(mine[i]))
    prompt_len, completion_len = [p for p, _ in mine], [c for _, c in mine]
    return [_take(batch, order[s], prompt_len, completion_len) for s in cuts(everyone, budget)]


def cuts(everyone: Sequence[Lengths], budget: int) -> list[slice]:
    """Where pieces of rows end, the same on every rank (each rank's rows longest first, as
    many each): consecutive rows while every rank's piece stays within `budget` padded tokens;
    a row longer than the budget is a piece alone."""
    count, out, start = len(everyone[0]), [], 0
    while start < count:
        end = start + 1
        while end < count and all(_fits(r[start : end + 1], budget) for r in everyone):
            end += 1
        out.append(slice(start, end))
        start = end
    return out


def _fits(rows: Lengths, budget: int) -> bool:
    return len(rows) * (max(p for p, _ in rows) + max(c for _, c in rows)) <= budget


def share(
    loss_type: str, piece: dict[str, Any], batch: dict[str, Any], processes: int = 1
) -> float:
    """What the piece's loss (as TRL computes it on the piece alone) is multiplied by so that the
    pieces' losses, and so their gradients, sum to the whole batch's. `batch` is this process's
    part of a batch trained by `processes` processes whose gradients are averaged
    (trainer/learner/distributed.py); its `rows_in_batch` and `num_items_in_batch` count the whole
    batch's real rows and kept tokens (ballast rows have none)."""
    if loss_type in BATCH_TOKEN_LOSSES:  # TRL divides the whole batch's count by `processes`
        return 1.0
    if loss_type in ROW_MEAN_LOSSES:
        return len(piece["advantages"]) * processes / float(batch["rows_in_batch"])
    if loss_type == "bnpo":
        whole = float(batch["num_items_in_batch"])
        return float(_kept(piece).sum()) * processes / whole if whole else 0.0
    raise ValueError(f"no micro-batch share for loss_type {loss_type!r}")


def _kept(batch: dict[str, Any]) -> torch.Tensor:
    mask: torch.Tensor = batch["completion_mask"]
    if "tool_mask" in batch:
        mask = mask * batch["tool_mask"]
    return mask


def _completion_lengths(mask: torch.Tensor) -> list[int]:
    """Right-padded: the last unmasked position + 1 (a mask may have holes, never a tail)."""
    positions = torch.arange(1, mask.size(1) + 1, device=mask.device)
    return (mask.bool() * positions).amax(1).tolist()


def _take(
    batch: dict[str, Any], rows: list[int], prompt_len: list[int], completion_len: list[int]
) -> dict[str, Any]:
    n = len(prompt_len)
    p = max(prompt_len[i] for i in rows)
    c = max(1, *(completion_len[i] for i in rows))  # TRL reads logits_to_keep=0 as "all"
    index = torch.tensor(rows)
    piece: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == n:
            value = value[index.to(value.device)]
            if key in PROMPT_KEYS:
                value = value[:, value.size(1) - p :]
            elif key in COMPLETION_KEYS:
                value = value[:, :c]
            elif value.dim() > 1:
                raise ValueError(f"the batch's {key!r} is neither prompt- nor completion-shaped")
        elif isinstance(value, list) and len(value) == n:
            value = [value[i] for i in rows]
        piece[key] = value
    return piece
