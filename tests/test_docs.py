"""The documentation site builds with no warning (a broken link, a missing page or anchor, a
docstring mkdocstrings cannot read), and what it generates is there: the README as its front
page, every setting of every settings class in the reference."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.settings import DatabaseSettings
from flywheel.options import env_name
from judge.config import JudgeSettings
from proxy.config import ProxySettings
from trainer.config import TrainerSettings

ROOT = Path(__file__).resolve().parents[1]


def build(site: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )


@pytest.mark.slow
def test_the_site_builds_strict_with_every_setting_and_the_client(tmp_path: Path) -> None:
    done = build(tmp_path / "site")
    assert done.returncode == 0, done.stderr[-3000:]
    settings = (tmp_path / "site" / "reference" / "settings" / "index.html").read_text()
    for kind in (DatabaseSettings, ProxySettings, TrainerSettings, JudgeSettings):
        for name in kind.model_fields:
            assert env_name(kind, name) in settings, (kind.__name__, name)
    client = (tmp_path / "site" / "reference" / "client" / "index.html").read_text()
    assert "Episode" in client and "demonstrate" in client  # from the docstrings
    front = (tmp_path / "site" / "index.html").read_text()
    assert "The two commands" in front and 'href="guide/using/"' in front


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """--strict is what makes the build a check: shown on a copy with one bad link."""
    copy = tmp_path / "repo"
    copy.mkdir()
    for path in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / path, copy)
    shutil.copytree(ROOT / "docs", copy / "docs")
    page = copy / "docs" / "guide" / "deploy.md"
    page.write_text(page.read_text() + "\n[gone](nowhere.md)\n")
    done = build(tmp_path / "site", cwd=copy)
    assert done.returncode != 0 and "nowhere.md" in done.stderr, done.stderr[-2000:]


def test_the_readme_is_a_front_page() -> None:
    """The manual lives in docs/; the README says what it is, the two commands, a quick start and
    where to read on (issue 43: under 250 lines)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).exists(), link
