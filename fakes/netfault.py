"""Network partitions on loopback, for fault tests and bench/chaos.py: packets dropped, not a
refused connection (a peer that vanished, a cable pulled, a security group changed).

`partition(port)`: iptables rules that drop every packet to and from a loopback TCP port (needs
root). Each rule carries the comment `flywheel-chaos-<pid>` and is removed when the block ends;
`clear_partitions()` removes any this process left. The machine may be shared: nothing else is
touched, only rules with our comment, on the port asked for.

`Relay`: a TCP relay in this process that can `blackhole()`: stop forwarding and stop reading,
both ways, with the connections left open, as a partition looks from either end. No root needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Iterator

COMMENT = f"flywheel-chaos-{os.getpid()}"


def _rules(port: int) -> list[list[str]]:
    tag = ["-m", "comment", "--comment", COMMENT, "-j", "DROP"]
    return [
        ["INPUT", "-i", "lo", "-p", "tcp", "--dport", str(port), *tag],
        ["INPUT", "-i", "lo", "-p", "tcp", "--sport", str(port), *tag],
    ]


@contextlib.contextmanager
def partition(port: int) -> Iterator[None]:
    """Drop every packet to and from 127.0.0.1:`port` while the block runs."""
    added: list[list[str]] = []
    try:
        for rule in _rules(port):
            subprocess.run(["iptables", "-I", *rule], check=True)
            added.append(rule)
        yield
    finally:
        for rule in added:
            subprocess.run(["iptables", "-D", *rule], check=False)


def clear_partitions() -> int:
    """Delete every rule this process's partitions left behind (a crash mid-block); how many."""
    listed = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True).stdout
    # (lines as `-A INPUT ... --comment flywheel-chaos-PID -j DROP`: delete each as listed)
    ours = [line.split()[1:] for line in listed.splitlines() if f"--comment {COMMENT} " in line]
    for rule in ours:
        subprocess.run(["iptables", "-D", *rule], check=False)
    return len(ours)


class Relay:
    """127.0.0.1:`port` (a free one) forwarding to `target`: a loopback TCP port, or a Unix
    socket's path (Postgres's: a TCP route to a server that listens on a socket only).
    `blackhole()` stops it moving bytes either way and stops reading, the connections left open;
    `heal()` lets them flow. (The kernel still acknowledges what it buffers: for a partition TCP
    itself notices, partition() this relay's port.)"""

    def __init__(self, target: int | str) -> None:
        self.target = target
        self.port = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> Relay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def blackhole(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._flowing.wait()  # a connect during a partition: the SYN is answered, no more
        try:
            if isinstance(self.target, int):
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
            else:
                up_reader, up_writer = await asyncio.open_unix_connection(self.target)
        except OSError:
            writer.close()
            return
        for a, b in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(a, b))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._flowing.wait()  # blackholed: not even read (the peer's buffers fill)
                data = await reader.read(65536)
                if not data:
                    break
                await self._flowing.wait()  # read just before the partition: held, not sent
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
