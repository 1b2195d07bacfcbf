"""trainer/config/: the trainer's settings, one class per concern, in TrainerSettings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.settings_split import assert_one_concern_each, flags_and_defaults
from trainer.config import TrainerSettings
from trainer.config.data import DataSettings
from trainer.config.learning import LearningSettings
from trainer.config.release import ReleaseSettings
from trainer.config.where import WhereSettings

SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "trainer_settings.txt"
CONCERNS = (WhereSettings, DataSettings, LearningSettings, ReleaseSettings)


def test_users_keep_every_variable_flag_and_default() -> None:
    """Split by concern, the settings are the ones users had (taken before the split): the same
    variables, flags and defaults. A setting added, renamed or given another default on purpose
    goes into the snapshot (tests/data/trainer_settings.txt) with it."""
    assert flags_and_defaults(TrainerSettings) == SNAPSHOT.read_text().splitlines()


def test_each_setting_belongs_to_one_concern() -> None:
    assert_one_concern_each(TrainerSettings, CONCERNS)


@pytest.fixture
def where(tmp_path: Path) -> dict[str, object]:
    """A model directory (its config is all the settings read of it) and an adapters directory."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    return {"model": tmp_path / "model", "adapters_dir": tmp_path / "adapters"}


def test_lists_are_comma_separated_in_every_concern(
    monkeypatch: pytest.MonkeyPatch, where: dict[str, object]
) -> None:
    """Each concern splits its own lists (a list validator of one name in two classes would leave
    one concern's lists unsplit, as it did once in the proxy's)."""
    monkeypatch.setenv("FLYWHEEL_VLLM", "http://a:1,http://b:2")  # where
    monkeypatch.setenv("FLYWHEEL_AGENTS", "writer,checker")  # data
    monkeypatch.setenv("FLYWHEEL_LORA_TARGETS", "q_proj,v_proj")  # learning
    s = TrainerSettings(**where)  # type: ignore[arg-type]
    assert s.vllm == ["http://a:1", "http://b:2"]
    assert s.agents == ["writer", "checker"]
    assert s.lora_targets == ["q_proj", "v_proj"]


def test_what_spans_two_concerns_is_still_checked(where: dict[str, object]) -> None:
    """lora_rank (learning) against vLLM's ranks, backoff bounds (data): checked on the whole."""
    with pytest.raises(ValidationError, match="lora_rank must be one vLLM accepts"):
        TrainerSettings(**where, vllm=["http://a:1"], lora_rank=7)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="backoff_max_s must be at least backoff_s"):
        TrainerSettings(**where, vllm=["http://a:1"], backoff_s=10, backoff_max_s=1)  # type: ignore[arg-type]
