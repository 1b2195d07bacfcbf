"""The base model an Engine trains an adapter on, and the adapter's LoRA configuration (what vLLM
can load: no DoRA, bias or modules_to_save). QLoRA's 4-bit base needs bitsandbytes and CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig
from transformers import AutoConfig, AutoModelForCausalLM

from trainer.config import TrainerSettings


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
