"""Which `Host` a request may name: a web page that reaches a loopback proxy under a name of its
own (DNS rebinding: evil.example resolving to 127.0.0.1) must not read or post through it.

FLYWHEEL_ALLOWED_HOSTS lists the host names (any port); `*.example.com` admits its subdomains,
`*` any name. Unset, a proxy listening on loopback answers to localhost, 127.0.0.1 and [::1]
only, one listening on another address to any name (it needs API keys there, which a page
cannot send without the browser asking the proxy first). The probes and the scrape (`/livez`,
`/healthz`, `/metrics`) answer under any name: kubelets and Prometheus call by address.
"""

from __future__ import annotations

from starlette.types import Scope

from proxy import route_table
from proxy.errors import ApiError


class HostCheck:
    def __init__(self, allowed: list[str]) -> None:
        names = [normal(name) for name in allowed]
        self._any = "*" in names
        self._names = frozenset(n for n in names if not n.startswith("*."))
        self._suffixes = tuple(n[1:] for n in names if n.startswith("*."))  # ".example.com"
        self._listed = ", ".join(allowed)

    def check(self, scope: Scope) -> None:
        """Raise a 421 for a Host not allowed (a request without one, not from a browser, may
        pass)."""
        if self._any or any(row.probe for row in route_table.ROUTES.of_path(scope["path"])):
            return
        for key, value in scope["headers"]:
            if key == b"host":
                name = normal(host_name(value.decode("latin-1")))
                if name in self._names or name.endswith(self._suffixes):
                    return
                raise ApiError(
                    421,
                    f"this proxy does not answer to Host {value.decode('latin-1')!r} (only "
                    f"{self._listed}): a web page reaching it under another name is refused. "
                    "If that is how you reach it, add the name to FLYWHEEL_ALLOWED_HOSTS "
                    "(comma-separated host names, any port; * for any).",
                    code="host_not_allowed",
                )


def host_name(header: str) -> str:
    """`example.com:8000` -> `example.com`, `[::1]:8000` -> `[::1]`."""
    header = header.strip()
    if header.startswith("["):
        return header[: header.find("]") + 1] or header
    return header.partition(":")[0]


def normal(name: str) -> str:
    return name.strip().lower().rstrip(".")
