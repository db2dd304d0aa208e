"""A TCP proxy between an application under test and PostgreSQL, which injects the network's faults.

The application connects to the proxy (:attr:`FaultProxy.port`) instead of the server; the proxy opens a
connection to the server for each one and copies bytes both ways until told to misbehave:

- :meth:`~FaultProxy.reset`: every open connection is reset (an RST on both sides), as when a server or
  a load balancer restarts. The application hears about it at once.
- :meth:`~FaultProxy.lose_commit_answers`: the next COMMITs reach the server and take effect, but their
  answers never reach the client, whose connection is reset instead: the outcome is unknown to it. With
  ``then="silence"`` the connection goes silent for good instead, as a hung peer's (below): nothing tells
  the client that the answer will never come.
- :meth:`~FaultProxy.hold`: all traffic, on open and on new connections, stops for some seconds and then
  resumes with nothing lost (a network partition that heals, a stop-the-world pause).
- :meth:`~FaultProxy.silence` ``("hung")``: every open connection goes silent for good, as behind a hung
  pooler or server process: the proxy still reads what the client sends (so the client's kernel gets its
  ACKs), forwards nothing and answers nothing. TCP keepalives cannot tell; only a deadline on the client's
  own waits can. New connections work.
- :meth:`~FaultProxy.silence` ``("dead")``: every open connection goes silent for good as a dead host
  does: the kernel drops its packets (``iptables`` rules on its loopback ports, so this needs root and
  the ``iptables`` command), so not even an ACK comes back. TCP's retransmission timeout, keepalives and
  ``tcp_user_timeout`` can tell. New connections work.

The server side of a silenced connection is kept open, with whatever transaction it had, as a hung peer
would keep it, for :attr:`FaultProxy.release_after` seconds: the server itself must end a transaction
whose client vanished (``idle_in_transaction_session_timeout``). Then it is closed, so that a long run
does not pile up server connections.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import struct
import subprocess
import threading
from collections import Counter, deque
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager, suppress
from typing import Any, Literal, TypeVar

from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["FaultProxy", "can_drop_packets", "running_proxy"]

T = TypeVar("T")

#: What a COMMIT looks like on the wire: a simple Query or a Parse message carrying the statement's text.
_COMMIT = b"COMMIT\x00"


def can_drop_packets() -> str | None:
    """``None`` when :meth:`FaultProxy.silence` ``("dead")`` can run here, else why it cannot."""
    if shutil.which("iptables") is None:
        return "the iptables command is not installed (apt-get install iptables)"
    probe = subprocess.run(["iptables", "-w", "-n", "-L", "INPUT"], capture_output=True, check=False)
    if probe.returncode != 0:
        return "iptables cannot change the firewall here (it needs root): " + probe.stderr.decode().strip()
    return None


class _Link:
    """One client connection and its server connection."""

    def __init__(
        self,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.client_reader, self.client_writer = client
        self.server_reader, self.server_writer = server
        self.client_port: int = self.client_writer.get_extra_info("peername")[1]
        #: Silent for good: nothing is forwarded either way any more.
        self.silent = False
        #: A COMMIT went up whose answer is to be lost, and what then becomes of the link.
        self.losing_answer: Literal["reset", "silence"] | None = None
        self.tasks: list[asyncio.Task[None]] = []

    def reset(self) -> None:
        """Close both sides with an RST (SO_LINGER 0), not a FIN."""
        for writer in (self.client_writer, self.server_writer):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()

    def close(self) -> None:
        for writer in (self.client_writer, self.server_writer):
            writer.transport.abort()


class FaultProxy:
    """The proxy, serving from a thread of its own until :meth:`close`.

    :param url: the server's libpq URL or conninfo (TCP, or a Unix socket directory as its host).
    :param release_after: seconds a silenced connection's server side is kept open.
    """

    def __init__(self, url: str, *, release_after: float = 30.0) -> None:
        params = conninfo_to_dict(url)
        host, port = str(params.get("host") or "127.0.0.1"), str(params.get("port") or "5432")
        #: Where the proxy connects: a Unix socket's path, or a host and port.
        self.upstream: str | tuple[str, int] = (
            f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, int(port))
        )
        self.release_after = release_after
        #: Faults injected, by name, and connections seen.
        self.counts: Counter[str] = Counter()
        self._loop = asyncio.new_event_loop()
        self._links: set[_Link] = set()
        self._dropped_ports: set[int] = set()
        self._chain: str | None = None
        #: What becomes of the links of the next COMMITs whose answers are lost, in order.
        self._commits_to_lose: deque[Literal["reset", "silence"]] = deque()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        self._flowing = self._call(self._make_event())
        self._server = self._call(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port: int = self._server.sockets[0].getsockname()[1]

    def conninfo(self, url: str) -> str:
        """``url`` (a libpq conninfo or URL) pointed at the proxy instead of the server."""
        return make_conninfo(url, host="127.0.0.1", port=str(self.port))

    # The faults.

    def reset(self) -> int:
        """Reset every open connection (RST on both sides); return how many there were."""
        return self._call(self._reset())

    def lose_commit_answers(self, count: int = 1, *, then: Literal["reset", "silence"] = "reset") -> None:
        """Let the next ``count`` COMMITs through, but never forward their answers: reset the client
        instead, or (``then="silence"``) make its connection silent for good."""
        self._call(self._lose(count, then))

    def hold(self, seconds: float) -> None:
        """Stop all traffic for ``seconds``, then let it flow again; returns at once."""
        self._call(self._hold(seconds))

    def silence(self, kind: Literal["hung", "dead"]) -> int:
        """Make every open connection silent for good (see the module); return how many there were."""
        links = self._call(self._silence())
        if kind == "dead":
            self._drop_packets([link.client_port for link in links])
        self.counts[f"silence ({kind})"] += 1
        return len(links)

    @property
    def open_links(self) -> int:
        """Connections open through the proxy now, silent ones included."""
        return len(self._links)

    def close(self) -> None:
        """Stop serving, close every connection, and remove the firewall rules it added."""
        try:
            self._call(self._close())
        finally:
            self._remove_rules()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    # Inside the proxy's event loop.

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _make_event(self) -> asyncio.Event:
        event = asyncio.Event()
        event.set()
        return event

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if isinstance(self.upstream, str):
                server = await asyncio.open_unix_connection(self.upstream)
            else:
                server = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        link = _Link((reader, writer), server)
        self._links.add(link)
        self.counts["connections"] += 1
        link.tasks = [
            asyncio.create_task(self._pump(link, up=True)),
            asyncio.create_task(self._pump(link, up=False)),
        ]

    async def _pump(self, link: _Link, *, up: bool) -> None:
        """Copy one direction of ``link`` until either side closes it."""
        reader = link.client_reader if up else link.server_reader
        writer = link.server_writer if up else link.client_writer
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                if link.silent:
                    continue  # read (and so ACKed by the kernel), never forwarded
                if up and self._commits_to_lose and _COMMIT in data:
                    link.losing_answer = then = self._commits_to_lose.popleft()
                    self.counts["commit answer lost" + (" (then silent)" if then == "silence" else "")] += 1
                elif not up and link.losing_answer == "silence":
                    self._make_silent(link)  # the COMMIT's answer: dropped, and the link silent from now
                    continue
                elif not up and link.losing_answer:
                    link.reset()  # the COMMIT's answer: dropped, and the client reset instead
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if not link.silent:  # a silenced one is released by its timer (_silence)
                link.close()
                self._links.discard(link)

    def _release(self, link: _Link) -> None:
        link.close()
        self._links.discard(link)

    async def _reset(self) -> int:
        links = [link for link in self._links if not link.silent]
        for link in links:
            link.reset()
        self.counts["reset"] += 1
        return len(links)

    async def _lose(self, count: int, then: Literal["reset", "silence"]) -> None:
        self._commits_to_lose.extend([then] * count)

    async def _hold(self, seconds: float) -> None:
        self._flowing.clear()
        self.counts["hold"] += 1
        self._loop.call_later(seconds, self._flowing.set)

    async def _silence(self) -> list[_Link]:
        links = [link for link in self._links if not link.silent]
        for link in links:
            self._make_silent(link)
        return links

    def _make_silent(self, link: _Link) -> None:
        link.silent = True
        self._loop.call_later(self.release_after, self._release, link)

    async def _close(self) -> None:
        self._server.close()
        self._flowing.set()
        for link in list(self._links):
            link.close()
        tasks = [task for link in self._links for task in link.tasks]
        for task in asyncio.all_tasks(self._loop):
            if task is not asyncio.current_task():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._links.clear()

    # The kernel's part of "dead".

    def _drop_packets(self, client_ports: list[int]) -> None:
        """Drop every packet between the proxy and these client ports, both ways."""
        if not client_ports:
            return
        if self._chain is None:
            self._chain = f"FIDEM{self.port}"
            _iptables("-N", self._chain)
            _iptables("-I", "INPUT", "-j", self._chain)
        for port in client_ports:
            if port in self._dropped_ports:
                continue
            self._dropped_ports.add(port)
            for sport, dport in ((port, self.port), (self.port, port)):
                _iptables(
                    "-A", self._chain, "-i", "lo", "-p", "tcp",
                    "--sport", str(sport), "--dport", str(dport), "-j", "DROP",
                )  # fmt: skip

    def _remove_rules(self) -> None:
        if self._chain is None:
            return
        _iptables("-D", "INPUT", "-j", self._chain)
        _iptables("-F", self._chain)
        _iptables("-X", self._chain)
        self._chain = None


def _iptables(*args: str) -> None:
    subprocess.run(["iptables", "-w", *args], check=True, capture_output=True)


@contextmanager
def running_proxy(url: str, **options: Any) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of the server of ``url``, closed (rules removed) when the block ends."""
    proxy = FaultProxy(url, **options)
    try:
        yield proxy
    finally:
        proxy.close()
