"""Supervised warm starts of the tiny demo models (demo/calc_tools.py, demo/sql_model.py): padding,
per-token log-probabilities, and sampling as vLLM does, in plain torch on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from demo.tiny_model import is_complete


def built_with(out_dir: Path, recipe: dict[str, Any]) -> bool:
    """Whether `out_dir` holds a complete model whose warm_start.json records `recipe` (another
    recipe rebuilds). Compared as JSON reads it back, so a tuple in the recipe equals the list
    it was saved as."""
    if not is_complete(out_dir):
        return False
    try:
        saved = json.loads((out_dir / "warm_start.json").read_text())["recipe"]
    except (OSError, ValueError, KeyError):
        return False
    return bool(saved == json.loads(json.dumps(recipe)))


def pad_rows(rows: list[tuple[list[int], list[float]]], pad: int) -> tuple[Any, Any]:
    """(ids, loss mask) tensors, right-padded (causal attention never looks at the padding)."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float)
    return ids, mask


def token_logprobs(model: Any, ids: Any, shared: int) -> Any:
    """log p(ids[:, t] | ids[:, :t]) for t >= 1; the first `shared` tokens (the same in every
    row) go through the model once, as a cache that every row reuses."""
    import torch

    rows = ids.shape[0]
    if shared == 0:
        logits = model(input_ids=ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    cache = model.model(input_ids=ids[:1, :shared], use_cache=True).past_key_values
    cache.batch_repeat_interleave(rows)
    positions = torch.arange(shared, ids.shape[1])[None].expand(rows, -1)
    hidden = model.model(
        input_ids=ids[:, shared:], past_key_values=cache, position_ids=positions, use_cache=False
    ).last_hidden_state[:, :-1]
    logits = model.lm_head(hidden).float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, shared + 1 :, None]).squeeze(-1)
    return torch.cat([torch.zeros(rows, shared), logprobs], 1)


def sample_texts(
    model: Any, episodes: Any, prompts: list[list[int]], generator: Any, max_new: int = 40
) -> list[str]:
    """Completions at temperature 1 (plain sampling, as vLLM does with this model's defaults).
    `episodes` has the `tokenizer` and its `end_ids` (the tokens that end a completion)."""
    import torch

    texts = [""] * len(prompts)
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    ends = torch.tensor(sorted(episodes.end_ids))
    for rows in by_length.values():
        ids = torch.tensor([prompts[i] for i in rows])
        out: list[list[int]] = [[] for _ in rows]
        done = torch.zeros(len(rows), dtype=torch.bool)
        with torch.no_grad():
            step = model(input_ids=ids, use_cache=True)
            for t in range(max_new):
                probs = torch.softmax(step.logits[:, -1].float(), -1)
                token = torch.multinomial(probs, 1, generator=generator)[:, 0]
                for k in (~done).nonzero()[:, 0].tolist():
                    out[k].append(int(token[k]))
                done |= torch.isin(token, ends)
                if bool(done.all()) or t == max_new - 1:
                    break
                positions = torch.full((len(rows), 1), ids.shape[1] + t)
                step = model(
                    input_ids=token[:, None],
                    past_key_values=step.past_key_values,
                    position_ids=positions,
                    use_cache=True,
                )
        for k, i in enumerate(rows):
            tokens = [x for x in out[k] if x not in episodes.end_ids]
            texts[i] = episodes.tokenizer.decode(tokens)
    return texts
