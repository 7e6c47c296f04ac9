"""File descriptors between the processes of one launch, over UNIX domain sockets (SCM_RIGHTS).

The transport for DWDP's store across processes (issue 17, `ffi/README.md` "Next: one process per GPU"): each
process exports its rank's expert blocks as POSIX file descriptors (`cuMemExportToShareableHandle`), every process
receives every peer's descriptors through `FdExchange.share` and imports them (`cuMemImportFromShareableHandle`).
`FdExchange.exchange` sends a small payload with the descriptors (the store's configuration, then whether the
import worked, so every rank learns of a peer's failure); `barrier` synchronises the ranks. Nothing here touches
CUDA; the descriptors can be of anything (the tests send memfds).

Each rank listens on a socket in Linux's abstract namespace, named by the launch's `job` and the rank: no file is
created, so nothing is left behind by a process that dies; the name goes when its socket closes. A rank that does
not answer within `timeout_s` (per call) is named in the error (`ExchangeTimeout`), so no process waits forever on a
dead peer. Only processes of the same user are heard (SO_PEERCRED). Received descriptors belong to the caller (close
them: `close_all`); a process needs room for world x descriptors-per-rank of them at once (RLIMIT_NOFILE: a message
the kernel had to truncate is an error that says so).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import NamedTuple

MAX_FDS = 253  # SCM_RIGHTS' per-message limit on Linux (SCM_MAX_FD)
_HEADER = struct.Struct("<4sIIIII")  # magic, sender rank, exchange number, kind (0 fds, 1 barrier), count, payload
MAX_PAYLOAD = 1 << 20
_MAGIC = b"JDFX"
_FDS, _BARRIER = 0, 1


class ExchangeError(RuntimeError):
    """A peer sent something other than the protocol's message, or the exchange was misused."""


class ExchangeTimeout(ExchangeError):
    """Some peers did not connect or answer in time; `missing` names their ranks."""

    def __init__(self, what: str, missing: list[int], timeout_s: float):
        self.missing = missing
        super().__init__(f"{what}: rank(s) {missing} did not answer within {timeout_s:g} s (exited, or never started?)")


class Message(NamedTuple):
    fds: list[int]
    payload: bytes


def _address(job: str, rank: int) -> bytes:
    return f"\0jax_dwdp-fdx-{job}-{rank}".encode()


def close_all(fds_by_rank: dict[int, list[int]]) -> None:
    for fds in fds_by_rank.values():
        for fd in fds:
            os.close(fd)


class FdExchange:
    """Rank `rank` of `world` processes; `job` names the launch (the same string in every process, unique per
    launch). A context manager: the listening socket closes on exit, on every path."""

    def __init__(self, job: str, rank: int, world: int, *, timeout_s: float = 60.0):
        if not 0 <= rank < world:
            raise ValueError(f"FdExchange: rank {rank} is not in [0, {world})")
        if not job or "\0" in job:
            raise ValueError(f"FdExchange: job {job!r} must be a non-empty string without NUL")
        self.job, self.rank, self.world, self.timeout_s = job, rank, world, timeout_s
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(_address(job, rank))
        except OSError as e:
            self._listener.close()
            raise ExchangeError(f"FdExchange: rank {rank} of job {job!r} is already listening ({e})") from None
        self._listener.listen(4 * world)  # room for every peer's message of this exchange and of its next
        self._seq = 0  # this rank's exchanges so far: a fast peer's next message waits in _early until asked for
        self._early: dict[tuple[int, int], tuple[int, Message]] = {}  # (seq, sender) -> (kind, message)

    def close(self) -> None:
        self._listener.close()
        for _, message in self._early.values():
            for fd in message.fds:
                os.close(fd)
        self._early.clear()

    def __enter__(self) -> FdExchange:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the two exchanges ------------------------------------------------------------------------------------

    def share(self, fds: list[int], *, timeout_s: float | None = None) -> dict[int, list[int]]:
        """Sends `fds` (duplicated by the kernel; the caller keeps its own) to every peer and returns every peer's:
        {rank: [fd, ...]} for the other ranks, in the order each peer gave them. Raises ExchangeTimeout naming the
        ranks not heard from; descriptors already received are closed then."""
        return {r: m.fds for r, m in self.exchange(fds, timeout_s=timeout_s).items()}

    def exchange(self, fds: list[int] = (), payload: bytes = b"", *,
                 timeout_s: float | None = None) -> dict[int, Message]:
        """`share` with a payload of up to MAX_PAYLOAD bytes: {rank: Message(fds, payload)} of every peer."""
        if len(fds) > MAX_FDS:
            raise ValueError(f"FdExchange.share: {len(fds)} descriptors, at most {MAX_FDS} per rank")
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"FdExchange.exchange: a payload of {len(payload)} bytes, at most {MAX_PAYLOAD}")
        return self._all_to_all(_FDS, list(fds), bytes(payload), "share", timeout_s)

    def barrier(self, *, timeout_s: float | None = None) -> None:
        """Returns once every rank has called barrier()."""
        self._all_to_all(_BARRIER, [], b"", "barrier", timeout_s)

    # ---- the protocol: every rank connects to every peer and sends one message; accepts one from every peer ----

    def _all_to_all(self, kind: int, fds: list[int], payload: bytes, what: str,
                    timeout_s: float | None) -> dict[int, Message]:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        seq, self._seq = self._seq, self._seq + 1
        peers = [r for r in range(self.world) if r != self.rank]
        unsent = list(peers)
        received: dict[int, Message] = {}
        try:
            for key in [k for k in self._early if k[0] == seq]:  # a peer already past this exchange sent it early
                got_kind, got = self._early.pop(key)
                received[key[1]] = got
                if got_kind != kind:
                    raise ExchangeError(f"FdExchange.{what}: rank {key[1]}'s exchange {seq} was of another kind")
            # Sends first (a peer's listen backlog holds the connection until it accepts), retrying peers that
            # are not listening yet; then accepts.
            while unsent:
                for peer in list(unsent):
                    if self._send(peer, seq, kind, fds, payload, deadline, timeout_s):
                        unsent.remove(peer)
                if unsent:
                    if time.monotonic() > deadline:
                        raise ExchangeTimeout(f"FdExchange.{what} (rank {self.rank})", unsent, timeout_s)
                    time.sleep(0.01)
            while len(received) < len(peers):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [p for p in peers if p not in received]
                    raise ExchangeTimeout(f"FdExchange.{what} (rank {self.rank})", missing, timeout_s)
                self._listener.settimeout(left)
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(max(deadline - time.monotonic(), 0.001))
                    sender, got_seq, got_kind, got = self._receive(conn, what)
                    if sender is None:  # another user's process: not heard
                        continue
                bad = sender == self.rank or not 0 <= sender < self.world or got_seq < seq
                if not bad and got_seq > seq and (got_seq, sender) not in self._early:
                    self._early[(got_seq, sender)] = (got_kind, got)  # the peer's next exchange: kept for it
                    continue
                if bad or got_seq > seq or sender in received or got_kind != kind:
                    for fd in got.fds:
                        os.close(fd)
                    raise ExchangeError(f"FdExchange.{what}: unexpected message from rank {sender} (its exchange "
                                        f"{got_seq}, kind {got_kind}; this rank is at exchange {seq}, kind {kind})")
                received[sender] = got
        except BaseException:
            close_all({r: m.fds for r, m in received.items()})
            raise
        return received

    def _send(self, peer: int, seq: int, kind: int, fds: list[int], payload: bytes, deadline: float,
              timeout_s: float) -> bool:
        """One message to `peer`; False when the peer is not listening yet (or its backlog is full)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(max(deadline - time.monotonic(), 0.001))  # a live peer that never accepts: no hang
            try:
                s.connect(_address(self.job, peer))
            except (ConnectionRefusedError, FileNotFoundError, BlockingIOError):
                return False
            except TimeoutError:
                raise ExchangeTimeout(f"FdExchange (rank {self.rank}) sending", [peer], timeout_s) from None
            data = _HEADER.pack(_MAGIC, self.rank, seq, kind, len(fds), len(payload)) + payload
            sent = socket.send_fds(s, [data], fds) if fds else s.send(data)
            if sent < len(data):
                s.sendall(data[sent:])
            return True

    def _receive(self, conn: socket.socket, what: str) -> tuple[int | None, int, int, Message]:
        """(sender, exchange number, kind, message); sender None for a process of another user (dropped)."""
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        try:
            data, fds, flags, _ = socket.recv_fds(conn, _HEADER.size, MAX_FDS)
        except TimeoutError:
            raise ExchangeError(f"FdExchange.{what}: a peer connected but sent nothing in time") from None
        try:
            if uid != os.getuid():
                for fd in fds:
                    os.close(fd)
                return None, 0, 0, Message([], b"")
            if flags & socket.MSG_CTRUNC:
                raise ExchangeError(f"FdExchange.{what}: the kernel dropped descriptors of a message (this process "
                                    f"has too many open: raise RLIMIT_NOFILE, `ulimit -n`)")
            while 0 < len(data) < _HEADER.size:
                more = conn.recv(_HEADER.size - len(data))
                if not more:
                    break
                data += more
            if len(data) != _HEADER.size:
                raise ExchangeError(f"FdExchange.{what}: a short message ({len(data)} bytes)")
            magic, sender, seq, kind, count, size = _HEADER.unpack(data)
            if magic != _MAGIC or count != len(fds) or size > MAX_PAYLOAD:
                raise ExchangeError(f"FdExchange.{what}: a message that is not the protocol's (from rank {sender}? "
                                    f"{count} descriptors announced, {len(fds)} received)")
            payload = b""
            while len(payload) < size:
                more = conn.recv(size - len(payload))
                if not more:
                    raise ExchangeError(f"FdExchange.{what}: rank {sender}'s message ended early")
                payload += more
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return sender, seq, kind, Message(fds, payload)
