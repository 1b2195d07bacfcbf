"""Where things are: the base model, vLLM, the adapters directory, the lineages this trainer
trains and its own name."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import NoDecode

from core import naming
from core.settings import FlywheelSettings, split_commas, vllm_base_urls
from trainer import models


class WhereSettings(FlywheelSettings):
    # --- where things are -----------------------------------------------------------------
    model: Path = Field(
        ...,
        description="Base model: a Hugging Face directory (the one vLLM serves), a .gguf file or "
        "a packaged model (`smollm2-135m`), converted once into `home/models/`, or a hub id "
        "(org/name, where the hub is reachable). trainer/models.py.",
    )
    vllm: Annotated[list[str], NoDecode] = Field(
        ..., description="vLLM base URL(s); every new adapter is loaded into each before use."
    )
    vllm_api_key: SecretStr | None = Field(None, description="Bearer key for vLLM's endpoints.")
    adapters_dir: Path = Field(
        ..., description="Where adapters are written (`policy-vN/`); vLLM must read the same path."
    )
    lineage: str = Field(
        "policy",
        description="The adapter lineage it trains (named `<lineage>-vN`): the transitions the "
        "proxy served from it (its FLYWHEEL_ADAPTER_PER_AGENT). A tenant's own lineage is "
        "`<tenant>.<lineage>` (`acme.policy`): only that tenant's calls. One trainer per lineage.",
    )
    lineages: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Several lineages trained by this one process, over one copy of the base "
        "model (a LoRA adapter and optimizer state each), in turn: `acme.policy,globex.policy`, "
        "or patterns (`*.policy`: every tenant's policy, taken in as it appears). Empty: "
        "`lineage` alone.",
    )
    lineage_discover_s: float = Field(
        10.0,
        gt=0,
        description="How often a `lineages` pattern (`*.policy`) looks for lineages it does not "
        "train yet (credited transitions waiting, or a current version).",
    )
    trainer_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="Who holds a claim (shown in the transition table).",
    )

    _split_where = field_validator("vllm", "lineages", mode="before")(split_commas)

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_model(cls, spec: object, info: ValidationInfo) -> object:
        """A GGUF file, a packaged model or a hub id becomes the directory it converts to."""
        if not isinstance(spec, str | Path):
            return spec
        try:
            return models.resolve(spec, Path(info.data.get("home", ".flywheel")))
        except models.ModelNotFound as e:
            raise ValueError(str(e)) from e

    _lineage = field_validator("lineage")(naming.check_lineage)

    @field_validator("lineages")
    @classmethod
    def _check_lineages(cls, lineages: list[str]) -> list[str]:
        for name in lineages:
            naming.check_lineage(name.replace("*", "x"))  # a pattern: `*` for any part
        if len(set(lineages)) != len(lineages):
            raise ValueError(f"lineages named twice: {','.join(lineages)}")
        return lineages

    @field_validator("vllm")
    @classmethod
    def _check_vllm(cls, urls: list[str]) -> list[str]:
        if not urls:
            raise ValueError("give at least one --vllm URL (or FLYWHEEL_VLLM)")
        return vllm_base_urls(urls, "vllm")
