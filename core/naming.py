"""What a lineage is called and whose it is: the names of lineages, roles and adapters.

A lineage is one line of adapter versions with its own current version (core/policy.py keeps
them): `policy` by default, or one per agent role. A tenant's own lineages are named
`<tenant>.<role>`; the names without a tenant are the default tenant's, and the shared ones for
the tenants the proxy's FLYWHEEL_SHARED_LINEAGES lets in (`sees`). Names appear in adapter names,
directories, model names and metric labels, so they are checked where they come in.
"""

from __future__ import annotations

import re

from core.tenants import TENANT_PATTERN

DEFAULT_LINEAGE = "policy"
# Lineage names appear in adapter names, directories, model names and metric labels: a role,
# after its tenant and a dot for a tenant's own lineage (the dot is nowhere else).
ROLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
LINEAGE_NAME = re.compile(rf"(?:{TENANT_PATTERN}\.)?{ROLE_NAME.pattern}")
ADAPTER_NAME = re.compile(rf"({LINEAGE_NAME.pattern})-v([0-9]{{1,10}})")  # `adapter_name`


def check_lineage(name: str) -> str:
    """A valid lineage name, or ValueError saying what one is."""
    return _checked(
        name,
        LINEAGE_NAME,
        "a role (1-63 letters, digits, '_' or '-', starting with a letter or digit), after "
        "`<tenant>.` for a tenant's own lineage",
    )


def check_role(name: str) -> str:
    """A lineage name without a tenant (what FLYWHEEL_ADAPTER_PER_AGENT names), or ValueError."""
    return _checked(
        name,
        ROLE_NAME,
        "1-63 letters, digits, '_' or '-', starting with a letter or digit (a tenant's "
        "lineages are named `<tenant>.<name>` by the proxy)",
    )


def _checked(name: str, pattern: re.Pattern[str], what: str) -> str:
    if not pattern.fullmatch(name):
        raise ValueError(f"{name!r} is not a lineage name: {what}")
    return name


def tenant_of_lineage(lineage: str) -> str | None:
    """The tenant whose lineage this is (None: the default tenant's, or shared)."""
    return lineage.partition(".")[0] if "." in lineage else None


def lineage_for(tenant: str | None, role: str, *, shared: bool) -> str:
    """The lineage serving `role` to `tenant`: its own, or the shared one it opted into."""
    return role if tenant is None or shared else f"{tenant}.{role}"


def sees(tenant: str | None, lineage: str, *, shared: bool) -> bool:
    """Whether `tenant` may be served (or name) a version of `lineage`: its own lineages, and
    the shared ones (the default tenant's) when it opted into them."""
    owner = tenant_of_lineage(lineage)
    return owner == tenant or (owner is None and shared)


def adapter_name(lineage: str, version: int) -> str:
    return f"{lineage}-v{version}"
