"""The KL term's reference (`beta` > 0): the policy a lineage is held near (docs/off_policy.md).

`kl_anchor=start` (the default): the policy this lineage's GRPO started from, that is the last
weights no GRPO step made. A supervised step makes them (a warm start from demonstrations: the
KL holds GRPO near what the demonstrations taught, as InstructGPT's KL to its SFT model does), and
so does taking a version over whole: the lineage's first version, or one imported or rolled back
to. A version's adapter directory keeps its anchor (`anchor.safetensors`), so a restarted trainer
or a rollback holds the same reference as the engine that made the version.

`kl_anchor=base`: the base model (the adapter off), TRL's own reference for a PEFT model. After a
warm start that pulls the policy back towards the answers the demonstrations replaced.

The anchor is the engine's own LoRA weights (a copy; the base is shared), put in place for the
reference's no-gradient pass and taken out after it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FILE = "anchor.safetensors"  # beside a version's adapter; vLLM reads only the adapter's files


class Anchor:
    """The reference's LoRA weights. `params`: the engine's own trainable LoRA parameters by
    their PEFT names, which carry the engine's adapter name (`adapter`); files carry none, so a
    lineage's anchor loads under whatever adapter name its next engine gives it."""

    def __init__(self, params: dict[str, torch.nn.Parameter], adapter: str) -> None:
        self._params = params
        self._tag = f".{adapter}."
        self.weights = self._now()
        self._held: dict[str, torch.Tensor] = {}

    def _now(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self._params.items()}

    def hold(self) -> None:
        """The weights now become the anchor (a supervised step, a version taken over)."""
        self.weights = self._now()

    def take(self, adapter_dir: Path | None) -> None:
        """A version taken over whole: its kept anchor if it has one, else its own weights."""
        path = adapter_dir / FILE if adapter_dir is not None else None
        if path is None or not path.exists():
            self.hold()
            return
        weights = {self._named(k): v for k, v in load_file(path).items()}
        if weights.keys() != self._params.keys():
            raise ValueError(f"{path} does not fit this engine's adapter")
        self.weights = {
            n: w.to(self._params[n].device, self._params[n].dtype) for n, w in weights.items()
        }

    def save(self, adapter_dir: Path) -> None:
        save_file(
            {n.replace(self._tag, ".", 1): w.contiguous() for n, w in self.weights.items()},
            str(adapter_dir / FILE),
        )

    def _named(self, key: str) -> str:
        """A file's key (`...lora_A.weight`) as this engine names it (`lora_A.ADAPTER.weight`)."""
        head, _, tail = key.rpartition(".")
        return f"{head}{self._tag}{tail}"

    # The reference pass (trainer/learner/grpo.py): the anchor's weights in, the policy's back.
    def __enter__(self) -> Anchor:
        self._held = self._now()
        with torch.no_grad():
            for n, p in self._params.items():
                p.copy_(self.weights[n])
        return self

    def __exit__(self, *_: object) -> None:
        with torch.no_grad():
            for n, p in self._params.items():
                p.copy_(self._held[n])
        self._held = {}
