"""File descriptors between the processes of one launch, over UNIX domain sockets (SCM_RIGHTS).

The transport for DWDP's store across processes (issue 17, `ffi/README.md` "Next: one process per GPU"): each
process exports its rank's expert blocks as POSIX file descriptors (`cuMemExportToShareableHandle`), every process
receives every peer's descriptors through `FdExchange.share` and imports them (`cuMemImportFromShareableHandle`),
and `FdExchange.barrier` orders the teardown: a process frees its exported memory only after every peer has said
that it unmapped it. Nothing here touches CUDA; the descriptors can be of anything (the tests send memfds).

Each rank listens on a socket in Linux's abstract namespace, named by the launch's `job` and the rank: no file is
created, so nothing is left behind by a process that dies; the name goes when its socket closes. A rank that does
not answer within `timeout_s` is named in the error (`ExchangeTimeout`), so no process waits forever on a dead peer.
Received descriptors belong to the caller (close them: `close_all`).
"""

from __future__ import annotations

import os
import socket
import struct
import time

MAX_FDS = 253  # SCM_RIGHTS' per-message limit on Linux (SCM_MAX_FD)
_HEADER = struct.Struct("<4sIIII")  # magic, sender rank, exchange number, kind (0 fds, 1 barrier), count
_MAGIC = b"JDFX"
_FDS, _BARRIER = 0, 1


class ExchangeError(RuntimeError):
    """A peer sent something other than the protocol's message, or the exchange was misused."""


class ExchangeTimeout(ExchangeError):
    """Some peers did not connect or answer in time; `missing` names their ranks."""

    def __init__(self, what: str, missing: list[int], timeout_s: float):
        self.missing = missing
        super().__init__(f"{what}: rank(s) {missing} did not answer within {timeout_s:g} s (exited, or never started?)")


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
        self._early: dict[tuple[int, int], tuple[int, list[int]]] = {}  # (seq, sender) -> (kind, fds)

    def close(self) -> None:
        self._listener.close()
        for _, fds in self._early.values():
            for fd in fds:
                os.close(fd)
        self._early.clear()

    def __enter__(self) -> FdExchange:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the two exchanges ------------------------------------------------------------------------------------

    def share(self, fds: list[int]) -> dict[int, list[int]]:
        """Sends `fds` (duplicated by the kernel; the caller keeps its own) to every peer and returns every peer's:
        {rank: [fd, ...]} for the other ranks, in the order each peer gave them. Raises ExchangeTimeout naming the
        ranks not heard from; descriptors already received are closed then."""
        if len(fds) > MAX_FDS:
            raise ValueError(f"FdExchange.share: {len(fds)} descriptors, at most {MAX_FDS} per rank")
        return self._all_to_all(_FDS, list(fds), "share")

    def barrier(self) -> None:
        """Returns once every rank has called barrier() (e.g. "I have unmapped your blocks")."""
        self._all_to_all(_BARRIER, [], "barrier")

    # ---- the protocol: every rank connects to every peer and sends one message; accepts one from every peer ----

    def _all_to_all(self, kind: int, fds: list[int], what: str) -> dict[int, list[int]]:
        deadline = time.monotonic() + self.timeout_s
        seq, self._seq = self._seq, self._seq + 1
        peers = [r for r in range(self.world) if r != self.rank]
        unsent = list(peers)
        received: dict[int, list[int]] = {}
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
                    if self._send(peer, seq, kind, fds, deadline):
                        unsent.remove(peer)
                if unsent:
                    if time.monotonic() > deadline:
                        raise ExchangeTimeout(f"FdExchange.{what} (rank {self.rank})", unsent, self.timeout_s)
                    time.sleep(0.01)
            while len(received) < len(peers):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [p for p in peers if p not in received]
                    raise ExchangeTimeout(f"FdExchange.{what} (rank {self.rank})", missing, self.timeout_s)
                self._listener.settimeout(left)
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(max(deadline - time.monotonic(), 0.001))
                    sender, got_seq, got_kind, got = self._receive(conn, what)
                bad = sender == self.rank or not 0 <= sender < self.world or got_seq < seq
                if not bad and got_seq > seq and (got_seq, sender) not in self._early:
                    self._early[(got_seq, sender)] = (got_kind, got)  # the peer's next exchange: kept for it
                    continue
                if bad or got_seq > seq or sender in received or got_kind != kind:
                    for fd in got:
                        os.close(fd)
                    raise ExchangeError(f"FdExchange.{what}: unexpected message from rank {sender} (its exchange "
                                        f"{got_seq}, kind {got_kind}; this rank is at exchange {seq}, kind {kind})")
                received[sender] = got
        except BaseException:
            close_all(received)
            raise
        return received

    def _send(self, peer: int, seq: int, kind: int, fds: list[int], deadline: float) -> bool:
        """One message to `peer`; False when the peer is not listening yet."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(max(deadline - time.monotonic(), 0.001))  # a live peer that never accepts: no hang
            try:
                s.connect(_address(self.job, peer))
            except (ConnectionRefusedError, FileNotFoundError):
                return False
            except TimeoutError:
                raise ExchangeTimeout(f"FdExchange (rank {self.rank}) sending", [peer], self.timeout_s) from None
            header = _HEADER.pack(_MAGIC, self.rank, seq, kind, len(fds))
            if fds:
                socket.send_fds(s, [header], fds)
            else:
                s.sendall(header)
            return True

    def _receive(self, conn: socket.socket, what: str) -> tuple[int, int, int, list[int]]:
        try:
            data, fds, _, _ = socket.recv_fds(conn, _HEADER.size, MAX_FDS)
        except TimeoutError:
            raise ExchangeError(f"FdExchange.{what}: a peer connected but sent nothing in time") from None
        try:
            if len(data) != _HEADER.size:
                raise ExchangeError(f"FdExchange.{what}: a short message ({len(data)} bytes)")
            magic, sender, seq, kind, count = _HEADER.unpack(data)
            if magic != _MAGIC or count != len(fds):
                raise ExchangeError(f"FdExchange.{what}: a message that is not the protocol's (from rank {sender}? "
                                    f"{count} descriptors announced, {len(fds)} received)")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return sender, seq, kind, fds
