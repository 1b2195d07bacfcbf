"""The base model an Engine trains an adapter on, and the adapter's LoRA configuration (what vLLM
can load: no DoRA, bias or modules_to_save). QLoRA's 4-bit base needs bitsandbytes and CUDA.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from trainer.config import TrainerSettings
from trainer.learner.distributed import World, shard_base


def four_bit() -> Any:
    """QLoRA's base: NF4 weights, double quantisation, bfloat16 compute (bitsandbytes, CUDA)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(  # type: ignore[no-untyped-call]
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def base_model(settings: TrainerSettings, bf16: bool, *, meta: bool) -> Any:
    """The base model from its directory; `meta`: its shapes only (no memory), for a rank that
    will receive its shard of rank 0's weights."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    if meta:
        with torch.device("meta"):
            config = AutoConfig.from_pretrained(settings.model)
            return AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    return AutoModelForCausalLM.from_pretrained(
        settings.model,
        dtype=dtype,
        quantization_config=four_bit() if settings.load_in_4bit else None,
    )


def lora(settings: TrainerSettings) -> LoraConfig:
    return LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        lora_dropout=0.0,
        target_modules=settings.lora_modules,  # vLLM loads these (no DoRA, bias, modules_to_save)
        bias="none",
        use_dora=False,
        task_type="CAUSAL_LM",
    )


def adapted(
    settings: TrainerSettings, bf16: bool, resume_from: Path | None, base: Any | None, adapter: str
) -> tuple[Any, LoraConfig | None]:
    """The model an Engine trains, with its adapter (new, or `resume_from`'s), and the LoRA
    configuration TRL still has to wrap it in (None: the model has its adapter). `base`: another
    engine's PeftModel, which gets one more adapter (its weights are not copied)."""
    peft_config = None
    model: Any
    if base is not None:  # one more adapter on another engine's PeftModel
        model = base
        if adapter in model.peft_config:  # a rebuild (another LoRA configuration)
            model.delete_adapter(adapter)
        if resume_from is None:
            model.add_adapter(adapter, lora(settings))
        else:
            model.load_adapter(resume_from, adapter_name=adapter, is_trainable=True)
        model.set_adapter(adapter)  # only its weights train, so its optimizer has only them
    else:
        # sharded: rank 0 reads the weights and hands each rank its shard (`shard_base`)
        model = base_model(settings, bf16, meta=settings.shard_base and not World.current().leader)
        if resume_from is None:
            peft_config = lora(settings)
        else:
            with warnings.catch_warnings():  # a meta model: rank 0 hands the weights over
                warnings.filterwarnings("ignore", message=".*to a meta parameter")
                model = PeftModel.from_pretrained(model, resume_from, is_trainable=True)
        if settings.shard_base:  # FSDP2 over the ranks, around the adapter it leaves whole
            if peft_config is not None:
                model, peft_config = get_peft_model(model, peft_config), None
            shard_base(model, World.current())
    return model, peft_config
