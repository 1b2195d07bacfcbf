"""Query parameters several routes share.

`IsoTime`: a point in time as the OpenAPI document declares it (`format: date-time`, ISO 8601).
pydantic alone also takes a number as seconds since 1970, so `until=0.5` read as 1970 and
answered 200 where the document promises a date-time: the parameter and its schema must agree.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BeforeValidator


def _iso(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            pass
        raise ValueError("an ISO 8601 date-time, e.g. 2026-11-28T07:00:00Z")
    return value


IsoTime = Annotated[datetime, BeforeValidator(_iso)]
