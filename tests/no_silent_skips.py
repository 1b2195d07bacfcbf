"""A pytest plugin: under CI (`CI=true`, which .ci/run sets) a skipped test fails the run.

A test that needs root, iptables, openssl or a package the lock pins skips on a developer's
machine that lacks it; on CI, whose machine is set up to provide all of them, such a skip would
hide a test that never ran. The summary (`-ra`, pyproject.toml) prints every skip and its reason
either way; under CI this plugin then ends the run failed, naming them.
"""

from __future__ import annotations

import os

import pytest


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


class NoSilentSkips:
    def __init__(self) -> None:
        self.skipped: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            self.skipped.append(f"{report.nodeid}: {reason}")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.skipped or not on_ci():
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_sep("=", f"{len(self.skipped)} skipped under CI, where none may be")
            for line in self.skipped:
                reporter.write_line(line)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(NoSilentSkips(), "no-silent-skips")
