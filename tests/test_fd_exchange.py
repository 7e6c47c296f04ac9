"""jax_dwdp.parallel.fd_exchange: descriptors between processes over UNIX sockets (SCM_RIGHTS), with barriers,
timeouts that name the missing rank, and every received descriptor closed on every path."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import threading

import pytest

from jax_dwdp.parallel.fd_exchange import MAX_FDS, ExchangeError, ExchangeTimeout, FdExchange, close_all


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _memfd(text: str) -> int:
    fd = os.memfd_create("fdx-test")
    os.write(fd, text.encode())
    return fd


def _rank_main(job: str, rank: int, world: int, token: str, timeout_s: float, queue) -> None:
    """One rank: shares two memfds that name it, reads every peer's, closes them, then two barriers back to back
    (a fast rank's second barrier message reaches a slow rank still in the first); reports what it read and
    whether its descriptor count came back."""
    try:
        before = _open_fds()
        mine = [_memfd(f"{token} rank {rank} fd {i}") for i in range(2)]
        with FdExchange(job, rank, world, timeout_s=timeout_s) as fx:
            got = fx.share(mine)
            read = {r: [os.pread(fd, 100, 0).decode() for fd in fds] for r, fds in got.items()}
            close_all(got)
            fx.barrier()
            fx.barrier()
        for fd in mine:
            os.close(fd)
        queue.put((rank, "ok", read, _open_fds() - before))
    except ExchangeTimeout as e:
        queue.put((rank, "timeout", e.missing, str(e)))
    except Exception as e:  # noqa: BLE001 (reported to the test)
        queue.put((rank, "error", type(e).__name__, str(e)))


def _run(world: int, ranks: list[int], timeout_s: float) -> tuple[str, dict]:
    ctx = multiprocessing.get_context("spawn")  # the test process has JAX threads: no fork
    job, token = secrets.token_hex(6), secrets.token_hex(4)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(job, r, world, token, timeout_s, queue)) for r in ranks]
    for p in procs:
        p.start()
    results = {}
    for _ in ranks:
        rank, *rest = queue.get(timeout=timeout_s + 60)
        results[rank] = rest
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0, f"a rank process exited with {p.exitcode}"
    return token, results


def test_three_processes_share_descriptors_and_barrier():
    token, results = _run(3, [0, 1, 2], timeout_s=30)
    for rank, (status, read, leaked) in results.items():
        assert status == "ok", (rank, status, read, leaked)
        assert set(read) == {0, 1, 2} - {rank}
        for peer, texts in read.items():  # the peer's own memory, through the received descriptors, in order
            assert texts == [f"{token} rank {peer} fd {i}" for i in range(2)]
        assert leaked == 0, f"rank {rank} kept {leaked} descriptors open"


def test_a_missing_rank_is_named_within_the_timeout():
    """Rank 2 never starts: ranks 0 and 1 stop after the timeout with an error naming rank 2 (and close what they
    had received from each other)."""
    _, results = _run(3, [0, 1], timeout_s=1.5)
    for rank in (0, 1):
        status, missing, message = results[rank]
        assert status == "timeout" and missing == [2], results[rank]
        assert "rank(s) [2] did not answer within 1.5 s" in message


def test_threads_in_one_process_and_descriptor_accounting():
    """Four ranks as threads (the same protocol, fast): 0 to 5 descriptors each, three exchanges; afterwards the
    process holds exactly the descriptors it held before."""
    job, world = secrets.token_hex(6), 4
    before = _open_fds()
    out: dict[int, object] = {}

    def rank_main(rank):
        try:
            mine = [_memfd(f"r{rank}f{i}") for i in range(rank + (rank == 3) * 2)]
            with FdExchange(job, rank, world, timeout_s=20) as fx:
                for _ in range(2):
                    got = fx.share(mine)
                    out[rank] = {r: [os.pread(fd, 20, 0).decode() for fd in fds] for r, fds in got.items()}
                    close_all(got)
                fx.barrier()
            for fd in mine:
                os.close(fd)
        except Exception as e:  # noqa: BLE001
            out[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for rank in range(world):
        want = {r: [f"r{r}f{i}" for i in range(r + (r == 3) * 2)] for r in range(world) if r != rank}
        assert out[rank] == want, (rank, out[rank])
    assert _open_fds() == before


def test_bad_arguments_are_clear_errors():
    job = secrets.token_hex(6)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        FdExchange(job, 2, 2)
    with pytest.raises(ValueError, match="non-empty string"):
        FdExchange("", 0, 2)
    with FdExchange(job, 0, 2, timeout_s=0.2) as fx:
        with pytest.raises(ExchangeError, match="rank 0 of job .* is already listening"):
            FdExchange(job, 0, 2)
        with pytest.raises(ValueError, match=f"at most {MAX_FDS}"):
            fx.share([0] * (MAX_FDS + 1))
        with pytest.raises(ExchangeTimeout, match=r"rank\(s\) \[1\]"):
            fx.barrier()
    with FdExchange(job, 0, 1) as alone:  # a world of one: nothing to exchange; the name is free again
        assert alone.share([]) == {} and alone.barrier() is None


def _raw_send(job, sender, seq, kind, fds=(), payload=b""):
    """A message as a peer would send it (the module's wire format), from a raw socket."""
    import socket

    from jax_dwdp.parallel import fd_exchange as fdx

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(fdx._address(job, 0))
        data = fdx._HEADER.pack(fdx._MAGIC, sender, seq, kind, len(fds), len(payload)) + payload
        socket.send_fds(s, [data], list(fds)) if fds else s.sendall(data)


def _fake_rank1(job):
    """Rank 1's listening socket, so that rank 0's own messages to it have somewhere to go."""
    import socket

    from jax_dwdp.parallel import fd_exchange as fdx

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(fdx._address(job, 1))
    listener.listen(8)
    return listener


def test_a_peers_next_message_is_kept_for_the_next_exchange_and_payloads_arrive():
    """Rank 1's barrier (exchange 1) arrives before its share (exchange 0): rank 0's share takes the share and keeps
    the barrier for its barrier() call; the payload comes through whole."""
    job = secrets.token_hex(6)
    before = _open_fds()
    with _fake_rank1(job) as listener, FdExchange(job, 0, 2, timeout_s=10) as fx:
        _raw_send(job, 1, 1, 1)  # exchange 1, a barrier: early
        fd = _memfd("from rank 1")
        _raw_send(job, 1, 0, 0, [fd], b"x" * 5000)
        os.close(fd)
        got = fx.exchange([], b"hello")
        assert list(got) == [1] and got[1].payload == b"x" * 5000
        assert os.pread(got[1].fds[0], 20, 0) == b"from rank 1"
        close_all({1: got[1].fds})
        fx.barrier(timeout_s=5)  # served by the kept message: returns at once
        conn, _ = listener.accept()  # rank 0's own share reached rank 1, payload and all
        with conn:
            data = conn.recv(1 << 16)
        assert data.endswith(b"hello")
    assert _open_fds() == before


def test_a_message_of_the_wrong_kind_is_a_clear_error():
    job = secrets.token_hex(6)
    before = _open_fds()
    with _fake_rank1(job), FdExchange(job, 0, 2, timeout_s=10) as fx:
        fd = _memfd("stray")
        _raw_send(job, 1, 0, 1, [fd])  # a barrier message (with a descriptor) where a share is due
        os.close(fd)
        with pytest.raises(ExchangeError, match="unexpected message from rank 1"):
            fx.share([])
    assert _open_fds() == before
