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
is the same step whatever the budget, up to float rounding (tests/test_microbatch.py).
"""

from __future__ import annotations

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


def pieces(batch: dict[str, Any], budget: int) -> list[dict[str, Any]]:
    """The batch in pieces of at most `budget` padded tokens each (rows x (longest prompt +
    longest completion)); a row longer than the budget is a piece alone. 0: one piece, the batch
    as it is."""
    if budget <= 0:
        return [batch]
    prompt_len = batch["prompt_mask"].sum(1).tolist()
    completion_len = _completion_lengths(batch["completion_mask"])
    order = sorted(range(len(prompt_len)), key=lambda i: -(prompt_len[i] + completion_len[i]))
    groups: list[list[int]] = []
    longest_p = longest_c = 0
    for i in order:
        p, c = max(longest_p, prompt_len[i]), max(longest_c, completion_len[i])
        if groups and (len(groups[-1]) + 1) * (p + c) <= budget:
            groups[-1].append(i)
            longest_p, longest_c = p, c
        else:
            groups.append([i])
            longest_p, longest_c = prompt_len[i], completion_len[i]
    return [_take(batch, rows, prompt_len, completion_len) for rows in groups]


def share(
    loss_type: str, piece: dict[str, Any], batch: dict[str, Any], processes: int = 1
) -> float:
    """What the piece's loss (as TRL computes it on the piece alone) is multiplied by so that the
    pieces' losses, and so their gradients, sum to the whole batch's. `batch` is this process's
    part of a batch trained by `processes` processes whose gradients are averaged
    (trainer/distributed.py); its `rows_in_batch` and `num_items_in_batch` count the whole
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
