"""proxy/config/: the proxy's settings, one class per concern, assembled into ProxySettings."""

from __future__ import annotations

from pathlib import Path

from proxy.config import ProxySettings, Quota
from proxy.config.access import AccessSettings, QuotaSettings
from proxy.config.reads import ReadSettings
from proxy.config.record import RecordSettings
from proxy.config.relay import RelaySettings
from proxy.config.serve import ServeSettings
from tests.settings_split import assert_one_concern_each, flags_and_defaults

SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "proxy_settings.txt"
CONCERNS = (ServeSettings, AccessSettings, QuotaSettings, RelaySettings, RecordSettings)


def test_users_keep_every_variable_flag_and_default() -> None:
    """Split by concern, the settings are the ones users had (taken before the split): the same
    variables, flags and defaults. A setting added, renamed or given another default on purpose
    goes into the snapshot (tests/data/proxy_settings.txt) with it."""
    assert flags_and_defaults(ProxySettings) == SNAPSHOT.read_text().splitlines()


def test_each_setting_belongs_to_one_concern() -> None:
    assert_one_concern_each(ProxySettings, (*CONCERNS, ReadSettings))


def test_the_quota_limits_are_declared_once() -> None:
    """FLYWHEEL_QUOTA_* are made from Quota's fields: a limit added to Quota is a setting, with
    its bounds and description, and ProxySettings.quota carries it."""
    assert set(QuotaSettings.model_fields) == {f"quota_{name}" for name in Quota.model_fields}
    for name, field in Quota.model_fields.items():
        setting = QuotaSettings.model_fields[f"quota_{name}"]
        assert setting.description == field.description and setting.metadata == field.metadata
    settings = ProxySettings(quota_rps=5, quota_concurrency=2, quota_burst_s=3)
    assert settings.quota == Quota(rps=5, concurrency=2, burst_s=3)


def test_lists_are_comma_separated_in_every_concern() -> None:
    """Each concern splits its own lists: two validators of one name in two classes would leave
    one concern's lists unsplit (found splitting the class: `_split` in two of them)."""
    s = ProxySettings(
        upstream="http://a:1,http://b:2",
        api_keys="k1,k2",
        allowed_hosts="a.example, b.example",
        shared_lineages="acme,beta",
    )
    assert s.upstream == ["http://a:1", "http://b:2"]
    assert [k.get_secret_value() for k in s.api_keys] == ["k1", "k2"]
    assert s.allowed_hosts == ["a.example", "b.example"] and s.shared_lineages == ["acme", "beta"]
    names: dict[str, str] = {}
    for kind in (*CONCERNS, ReadSettings):
        for name in kind.__pydantic_decorators__.field_validators:
            assert name not in names, f"{name} in {names[name]} and {kind.__name__}"
            names[name] = kind.__name__
