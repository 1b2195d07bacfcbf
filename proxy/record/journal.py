"""The disk journal: where recorded transitions wait while Postgres is unreachable.

Append-only JSON-lines segments (one `TransitionRecord` a line), fsync'd before the writer moves
on. A segment is deleted only
after its rows are committed in Postgres, and replays are idempotent (rows carry their ids), so a
crash at any point repeats rows at worst and never loses one. Rows that Postgres refuses as data
(not as an outage) go to `rejected/` with the error beside them, for a person to look at. A
segment holding a line that does not parse (a damaged disk, a hand-edited file) is copied whole
to `quarantine/` and rewritten with its good lines, which replay as usual.

Rewards posted while Postgres is unreachable wait here too, in `rewards-*.jsonl` segments (one
post a line: proxy/record/reward_journal.py), and are replayed after the transition segments.
At start-up, `redrive_rejected` puts what `rejected/` holds back into the journal: a row refused
before a fix or a migration is tried once more, and is rejected again (with the new error) if
Postgres still refuses it.

Every method may raise `OSError` (disk full, read-only, I/O error): the recorder runs each in
`guard()`, which keeps the failure (`error`, for /healthz) until the operation works again, and
decides what then happens to the records.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from core.record import TransitionRecord
from proxy import metrics

log = logging.getLogger(__name__)


class Journal:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.rejected_dir = directory / "rejected"
        self.rejected_dir.mkdir(parents=True, exist_ok=True)
        self.quarantine_dir = directory / "quarantine"
        self._seq = 0
        self.pending = sum(_count_lines(p) for p in [*self.segments(), *self.reward_segments()])
        self._errors: dict[str, str] = {}  # operation -> its last failure, until it works

    @property
    def error(self) -> str | None:
        """Why the journal is failing (None: its last operations worked)."""
        return "; ".join(f"{op}: {e}" for op, e in self._errors.items()) or None

    def failing(self, operation: str) -> bool:
        return operation in self._errors

    @contextlib.contextmanager
    def guard(self, operation: str) -> Iterator[None]:
        """A journal operation: an OSError is logged, counted and kept until it works again (the
        caller goes on after the block either way)."""
        try:
            yield
        except OSError as e:
            if operation not in self._errors:
                log.error("journal %s failed: %r; records stay in memory", operation, e)
            self._errors[operation] = repr(e)
            metrics.journal_errors.labels(operation).inc()
            metrics.journal_ok.set(0)
        else:
            if self._errors.pop(operation, None) is not None:
                log.warning("journal %s works again", operation)
            metrics.journal_ok.set(0 if self._errors else 1)

    def segments(self) -> list[Path]:
        return sorted(self.directory.glob("segment-*.jsonl"))

    def append(self, records: list[TransitionRecord]) -> None:
        self._seq += 1
        path = self.directory / f"segment-{time.time_ns():020d}-{os.getpid()}-{self._seq:06d}.jsonl"
        _write_durably(path, b"".join(orjson.dumps(r) + b"\n" for r in records))
        self.pending += len(records)

    def read(self, segment: Path) -> list[TransitionRecord]:
        """The segment's records; one with lines that do not parse is quarantined first."""
        data = segment.read_bytes()
        lines = data.splitlines()
        good: list[TransitionRecord] = []
        for line in lines:
            try:
                good.append(TransitionRecord.from_json(orjson.loads(line)))
            except (orjson.JSONDecodeError, TypeError, AttributeError):  # not a record's line
                continue
        if bad := len(lines) - len(good):
            self._quarantine(segment, data, good, bad)
        return good

    def _quarantine(
        self, segment: Path, data: bytes, good: list[TransitionRecord], bad: int
    ) -> None:
        """Keep the whole segment aside, then leave only its good lines to be replayed (a crash in
        between repeats both steps: the copy is overwritten, the rows are idempotent)."""
        self.quarantine_dir.mkdir(exist_ok=True)
        _write_durably(self.quarantine_dir / segment.name, data)
        if good:
            _write_durably(segment, b"".join(orjson.dumps(r) + b"\n" for r in good))
        else:
            segment.unlink()
        self.pending = max(0, self.pending - bad)
        metrics.journal_quarantined.inc(bad)
        log.error(
            "journal segment %s: %d line(s) unreadable, copied to %s; replaying its %d good ones",
            segment.name,
            bad,
            self.quarantine_dir,
            len(good),
        )

    def quarantined(self) -> int:
        """Segments kept aside for a person to look at."""
        return len(list(self.quarantine_dir.glob("*.jsonl"))) if self.quarantine_dir.exists() else 0

    def remove(self, segment: Path, count: int) -> None:
        segment.unlink()
        self.pending = max(0, self.pending - count)

    def reject(self, record: TransitionRecord, error: str) -> None:
        path = self.rejected_dir / f"{record.id}.json"
        _write_durably(path, orjson.dumps({"error": error, "record": record}))

    # --- rewards, and rejected rows tried again ------------------------------------------------

    def reward_segments(self, *, before: list[Path] | None = None) -> list[Path]:
        """Reward posts' segments, oldest first; with `before` (transition segments), only those
        written before all of them: replay applies a reward after the transitions ahead of it."""
        found = sorted(self.directory.glob("rewards-*.jsonl"), key=_written_at)
        if before:
            first = min(map(_written_at, before))
            found = [p for p in found if _written_at(p) < first]
        return found

    def append_rewards(self, posts: list[dict[str, Any]]) -> None:
        """Reward posts (JSON objects, one a line), fsync'd like transitions."""
        self._seq += 1
        name = f"rewards-{time.time_ns():020d}-{os.getpid()}-{self._seq:06d}.jsonl"
        _write_durably(self.directory / name, b"".join(orjson.dumps(p) + b"\n" for p in posts))
        self.pending += len(posts)

    def read_rewards(self, segment: Path) -> list[dict[str, Any]]:
        """A rewards segment's posts; lines that do not parse are copied to quarantine/ first."""
        data = segment.read_bytes()
        lines = data.splitlines()
        good = []
        for line in lines:
            with contextlib.suppress(orjson.JSONDecodeError):
                if isinstance(post := orjson.loads(line), dict):
                    good.append(post)
        if bad := len(lines) - len(good):
            self.quarantine_dir.mkdir(exist_ok=True)
            _write_durably(self.quarantine_dir / segment.name, data)
            _write_durably(segment, b"".join(orjson.dumps(p) + b"\n" for p in good))
            self.pending = max(0, self.pending - bad)
            metrics.journal_quarantined.inc(bad)
            log.error("journal segment %s: %d line(s) unreadable, quarantined", segment.name, bad)
        return good

    def reject_rewards(self, post: dict[str, Any], error: str) -> None:
        path = self.rejected_dir / f"rewards-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
        _write_durably(path, orjson.dumps({"error": error, "post": post}))

    def redrive_rejected(self) -> int:
        """Everything `rejected/` holds back into the journal, to be tried once more (after a fix
        or a migration); returns how many. Written durably before the files are removed (a crash
        in between only repeats rows, and replays are idempotent)."""
        files = sorted(self.rejected_dir.glob("*.json"))
        records: list[TransitionRecord] = []
        posts: list[dict[str, Any]] = []
        for path in list(files):
            try:
                kept = orjson.loads(path.read_bytes())
                if "post" in kept:
                    posts.append(kept["post"])
                else:
                    records.append(TransitionRecord.from_json(kept["record"]))
            except (orjson.JSONDecodeError, TypeError, KeyError, AttributeError):
                log.error("rejected/%s does not parse; left there", path.name)
                files.remove(path)
        if records:
            self.append(records)
        if posts:
            self.append_rewards(posts)
        for path in files:
            path.unlink()
        if files:
            log.warning("%d rejected row(s) from %s are tried again", len(files), self.rejected_dir)
        return len(files)


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)  # whole segments only: a reader never sees half of one
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _written_at(segment: Path) -> int:
    """`segment-<ns>-...` or `rewards-<ns>-...`: when it was written (time.time_ns())."""
    return int(segment.name.split("-")[1])


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n")
