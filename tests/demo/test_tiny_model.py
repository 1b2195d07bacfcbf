"""The model builders' lock (demo/tiny_model.one_build_at_a_time): the tests' background build
and a test that needs the model at once must not build it twice, nor over each other's files."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from demo.tiny_model import one_build_at_a_time


def test_a_second_builder_waits_for_the_first_and_finds_the_model_built(tmp_path: Path) -> None:
    builds: list[str] = []

    @one_build_at_a_time
    def build(out_dir: Path, tag: str) -> Path:
        if (out_dir / "weights").exists():  # the builder's own is-it-built check
            return out_dir
        builds.append(tag)
        out_dir.mkdir()
        time.sleep(0.5)  # long enough for the other thread to arrive meanwhile
        (out_dir / "weights").write_text(tag)
        return out_dir

    target = tmp_path / "models" / "m"
    threads = [threading.Thread(target=build, args=(target, tag)) for tag in "ab"]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join()
    assert builds == ["a"]
    assert (target / "weights").read_text() == "a"
    assert build.__name__ == "build"
