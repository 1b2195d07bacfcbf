"""What the settings tests of a process split by concern share (tests/proxy/test_config.py,
tests/trainer/test_config.py): its users' variables, flags and defaults, and which concern holds
each setting."""

from __future__ import annotations

from pydantic_settings import BaseSettings

from flywheel.options import _default, env_name

DATABASE = {"home", "database_url", "require_database_url", "log_level"}  # DatabaseSettings'


def flags_and_defaults(whole: type[BaseSettings]) -> list[str]:
    """`FLYWHEEL_X --x default`, a line per setting, by name: what a snapshot holds."""
    return [
        f"{env_name(whole, name)} --{name.replace('_', '-')} {_default(field)}"
        for name, field in sorted(whole.model_fields.items())
    ]


def assert_one_concern_each(whole: type[BaseSettings], concerns: tuple[type, ...]) -> None:
    """Every setting of `whole` is in exactly one of `concerns` (or is the database's)."""
    seen: dict[str, str] = {}
    for kind in concerns:
        for name in kind.model_fields:
            assert name not in seen, f"{name} is in {seen[name]} and {kind.__name__}"
            seen[name] = kind.__name__
    assert set(seen) | DATABASE == set(whole.model_fields)
