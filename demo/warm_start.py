"""The warm starts of the tiny task models (demo/calculator.py, demo/calc_tools_model.py,
demo/sql_model.py): one build skeleton (`build`: idempotent by recipe, seeded, trained, measured,
saved with its figures in `warm_start.json`), one supervised loop (`train`), and padding,
per-token log-probabilities and sampling as vLLM does, in plain torch on CPU.

Each model supplies what is its own: its tokenizer, the token ids of its texts, its batches (the
loss of a step) and its measurements. Same seed, same recipe: the same weights, bit for bit.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from demo.tiny_model import is_complete, random_model, save_atomically

T = TypeVar("T")


def build(
    out_dir: Path,
    recipe: dict[str, Any],
    *,
    seed: int,
    tokenizer: Callable[[], Any],
    texts: Callable[[Any], T],
    warm_start: Callable[[Any, T, random.Random], None],
    measure: Callable[[Any, T, int], dict[str, Any]],
) -> Path:
    """The tiny Qwen2 on `tokenizer()`, `warm_start`ed (on `texts(tokenizer)`, the token ids it
    needs, with random.Random(seed)) and `measure`d, saved into `out_dir` with its figures; a
    model already built there with the same recipe is kept (call it under one_build_at_a_time)."""
    if built_with(out_dir, recipe):
        return out_dir
    import torch

    torch.set_num_threads(1)  # measured faster than 2 on a shared 2-core machine
    started = time.monotonic()
    made = tokenizer()
    model = random_model(made, seed=seed)
    shaped = texts(made)
    warm_start(model, shaped, random.Random(seed))
    trained = time.monotonic()
    measured = measure(model, shaped, seed)
    save_atomically(out_dir, made, model)
    figures = {
        "recipe": recipe,
        "seed": seed,
        "train_s": round(trained - started, 1),
        "measure_s": round(time.monotonic() - trained, 1),
        **measured,
    }
    (out_dir / "warm_start.json").write_text(json.dumps(figures, indent=1))
    return out_dir


def train(model: Any, *, steps: int, lr: float, warmup: int, loss: Callable[[int], Any]) -> None:
    """Full-weight supervised steps: AdamW, a linear warm-up over `warmup` steps then a linear
    decay (to no less than 5%), gradients clipped to norm 1. `loss(step)` draws that step's
    batch and returns its loss."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1 - s / steps)
    )
    model.train()
    for step in range(steps):
        value = loss(step)
        optimizer.zero_grad()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()


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
