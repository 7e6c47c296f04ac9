"""One process per device on the CPU (`--num-processes`, jax.distributed with gloo): results equal one process, a
dead process stops the launch with a clear error, and no process outlives it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jax_dwdp.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "jax_dwdp.cli"]
PIDS = re.compile(r"process (\d+) pid (\d+)")


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)  # each process: one host device
    return env


def _prefill(args, out: Path, timeout=600):
    proc = subprocess.run(CLI + ["prefill", *args, "--dtype", "float32", "--iters", "1", "--logits-out", str(out)],
                          capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out), proc


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, one device: the tiny preset, 3 sequences of 24 tokens (random tokens of seed 0)."""
    out = tmp_path_factory.mktemp("ref") / "ref.npy"
    return _prefill(["--preset", "tiny", "--batch", "3", "--seq-len", "24"], out)[0]


@pytest.mark.parametrize("scheme", [["--dwdp", "2"], ["--dep", "2"], ["--dwdp", "2", "--dwdp-backend", "local"],
                                    ["--pipeline", "2", "--microbatches", "2"], ["--pipeline", "3"],
                                    ["--pipeline", "2", "--microbatches", "2", "--scan"]],
                         ids=["dwdp-xla", "dep", "replicated", "pipeline-2", "pipeline-3", "pipeline-2-scanned"])
def test_processes_equal_one(tmp_path, reference, scheme):
    """3 sequences over 2 ranks in 2 processes (one padding row): DWDP's all-gather / DEP's all-to-all cross
    processes; or 2 (3) pipeline stages in 2 (3) processes, the hidden states handed from process to process (with
    3, process 0 skips the hand-off between processes 1 and 2; scanned: each process's stage one scanned program)."""
    n = scheme[1]
    logits, proc = _prefill(["--preset", "tiny", "--batch", "3", "--seq-len", "24", "--num-processes", n, *scheme],
                            tmp_path / "mp.npy")
    err = _rel(logits, reference)
    print(f"{' '.join(scheme)}, {n} processes vs one: {err:.2e}")
    assert logits.shape == reference.shape and err <= 1e-5
    assert f"started {n} processes" in proc.stderr
    assert proc.stdout.count("logits written") == 1 and proc.stdout.count("model:") == 1  # process 0 reports, alone


def test_four_processes_six_experts_from_a_checkpoint(tmp_path):
    """6 experts over 4 ranks (2 slots each, two of them empty), each process loading the HF checkpoint."""
    from tests.checkpoint_helpers import write_hf

    cfg = ModelConfig.preset("tiny").replace(num_experts=6, num_hidden_layers=2)
    hf = write_hf(tmp_path / "hf", cfg, seed=3)
    args = ["--checkpoint", str(hf), "--batch", "4", "--seq-len", "20"]
    ref, _ = _prefill(args, tmp_path / "ref.npy")
    logits, _ = _prefill(args + ["--num-processes", "4", "--dwdp", "4"], tmp_path / "mp.npy")
    err = _rel(logits, ref)
    print(f"4 processes, dwdp 4, 6 experts vs one process: {err:.2e}")
    assert err <= 1e-5


def test_two_processes_load_their_experts_split_from_orbax(tmp_path):
    """8 experts over 2 ranks: each process restores its experts straight into the split placement (its own chunks
    only, see CheckpointLayers) from a converted Orbax checkpoint; equal to one process."""
    from tests.checkpoint_helpers import write_hf

    hf = write_hf(tmp_path / "hf", ModelConfig.preset("tiny").replace(num_hidden_layers=2), seed=5)
    subprocess.run(CLI + ["convert", str(hf), str(tmp_path / "orbax"), "--json"], check=True, capture_output=True,
                   timeout=300, env=_env(), cwd=ROOT)
    args = ["--checkpoint", str(tmp_path / "orbax"), "--batch", "2", "--seq-len", "16"]
    ref, _ = _prefill(args, tmp_path / "ref.npy")
    logits, _ = _prefill(args + ["--num-processes", "2", "--dwdp", "2"], tmp_path / "mp.npy")
    err = _rel(logits, ref)
    print(f"2 processes, dwdp 2, Orbax, experts loaded split vs one process: {err:.2e}")
    assert err <= 1e-5


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


class _Launch:
    """A long multi-process prefill whose stderr is read as it comes."""

    def __init__(self, tmp_path):
        args = ["prefill", "--preset", "tiny", "--batch", "2", "--seq-len", "16", "--dwdp", "2", "--num-processes", "2",
                "--iters", "100000", "--process-timeout", "30"]
        self.proc = subprocess.Popen(CLI + args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env=_env(), cwd=ROOT, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")), daemon=True).start()

    def wait_for(self, text: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, f"the launch ended early: {''.join(self.lines)[-2000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout} s: {''.join(self.lines)[-2000:]}"
            time.sleep(0.1)

    def pids(self) -> dict[int, int]:
        line = next(line for line in self.lines if "started 2 processes" in line)
        return {int(i): int(pid) for i, pid in PIDS.findall(line)}

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def test_a_killed_process_stops_the_launch_with_a_clear_error(tmp_path):
    launch = _Launch(tmp_path)
    try:
        launch.wait_for("running 1 warm-up")  # both processes are in the timed loop (collectives every layer)
        pids = launch.pids()
        time.sleep(1.0)
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        code = launch.proc.wait(timeout=60)
        took = time.monotonic() - t0
        text = "".join(launch.lines)
        print(f"launcher exit {code} {took:.1f} s after the kill: {text.strip().splitlines()[-1]}")
        assert code != 0
        assert "error: process 1" in text and "SIGKILL" in text and "stopped process 0" in text
        assert not any(_alive(pid) for pid in pids.values()), "a process outlived the launch"
    finally:
        launch.close()


def test_processes_die_with_their_launcher(tmp_path):
    launch = _Launch(tmp_path)
    try:
        launch.wait_for("started 2 processes")
        pids = launch.pids()
        os.kill(launch.proc.pid, signal.SIGKILL)
        launch.proc.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids.values()), "a process outlived its killed launcher"
    finally:
        launch.close()


@pytest.mark.parametrize("args,message", [
    (["--dwdp", "2", "--num-processes", "3"], "one process per device"),
    (["--pipeline", "2", "--dwdp", "2", "--num-processes", "4"], "not both yet"),
    (["--dwdp", "2", "--num-processes", "2", "--process-id", "0"], "joining a launch needs --coordinator"),
    (["--dwdp", "2", "--num-processes", "2", "--tokens", "/nonexistent.npy"], "--tokens /nonexistent.npy: no such file"),
    (["--dwdp", "2", "--num-processes", "2", "--dtype", "fp8"], "dtype 'fp8' is not supported"),
    (["--dwdp", "2", "--num-processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:1"],
     "--process-id must lie in [0, 2)"),
    # prefill options and the layout: once by the launcher, not once per process after jax.distributed started
    (["--dwdp", "2", "--num-processes", "2", "--iters", "0"], "--iters must be >= 1"),
    (["--pipeline", "2", "--num-processes", "2", "--microbatches", "0"], "--microbatches must be >= 1"),
    (["--dwdp", "2", "--num-processes", "2", "--dwdp-backend", "foo"], "--experts 'foo'"),
    (["--dep", "2", "--num-processes", "2", "--dwdp-backend", "local"], "--dep has one way to move tokens"),
    (["--dwdp", "2", "--num-processes", "2", "--dwdp-backend", "ffi"], "needs a CUDA GPU per process"),
    (["--dep", "2", "--num-processes", "2", "--share-gpu"], "--share-gpu runs --dwdp N --experts ffi ranks only"),
    (["--dwdp", "2", "--share-gpu"], "--share-gpu shares one GPU between the processes of a launch"),
])
def test_inconsistent_process_options_are_one_line_errors(args, message):
    """Checked by the launcher before it starts a process (or by a process that joins): one line, not one per
    process."""
    proc = subprocess.run(CLI + ["prefill", "--preset", "tiny", *args], capture_output=True, text=True, timeout=120,
                          env=_env(), cwd=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert message in lines[0]
    assert "started" not in proc.stderr  # no process was started


def test_a_launch_runs_one_device_per_process(monkeypatch):
    """distributed.check_layout, what the launcher (and a joining process) checks of the layout before jax starts."""
    from jax_dwdp import distributed
    from jax_dwdp.distributed import check_layout

    check_layout(2, 1, 2)
    check_layout(3, 3, 1)
    for args, kwargs, message in [
        ((3, 1, 2), {}, "--num-processes 3: one process per device, but the layout (--pipeline 1 x 2 ranks) uses 2 "
                        "device(s)"),
        ((4, 2, 2), {}, "across processes, --pipeline runs one device per stage and --dwdp / --dep ranks one stage: "
                        "not both yet"),
        ((2, 2, 1), {"chunked": True}, "--prefill-chunk runs on one device, in one process"),
    ]:
        with pytest.raises(ValueError) as e:
            check_layout(*args, **kwargs)
        assert str(e.value) == message
    monkeypatch.setattr(distributed, "visible_gpus", lambda: [])
    with pytest.raises(ValueError, match="--experts ffi across processes needs a CUDA GPU per process; none is"):
        check_layout(2, 1, 2, experts="ffi")
    check_layout(2, 1, 2, experts="ffi", joined=True)  # a joined process finds out from its own devices
    check_layout(2, 1, 2, experts="xla")
    monkeypatch.setattr(distributed, "visible_gpus", lambda: ["0", "1"])
    check_layout(2, 1, 2, experts="ffi")
    check_layout(2, 1, 2, experts="ffi", share_gpu=True)  # the one-GPU rehearsal
    for args, kwargs in (((2, 1, 2), {"experts": "xla"}), ((2, 2, 1), {"experts": "ffi"}), ((2, 1, 2), {})):
        with pytest.raises(ValueError, match="--share-gpu runs --dwdp N --experts ffi ranks only: .*NCCL, which "
                                             "refuses two ranks on one GPU"):
            check_layout(*args, **kwargs, share_gpu=True)
    monkeypatch.setattr(distributed, "visible_gpus", lambda: [])
    with pytest.raises(ValueError, match="--experts ffi across processes needs a CUDA GPU per process; none is"):
        check_layout(2, 1, 2, experts="ffi", share_gpu=True)


def test_a_command_line_is_handed_to_a_launch_or_a_supervised_child_or_runs_here(monkeypatch):
    from jax_dwdp import distributed

    calls = []
    monkeypatch.setattr(distributed, "launch", lambda argv, n, **kw: calls.append(("launch", argv, n, kw)) or 3)
    monkeypatch.setattr(distributed, "supervise", lambda argv, **kw: calls.append(("supervise", argv, kw)) or 4)
    monkeypatch.delenv(distributed.SUPERVISED_ENV, raising=False)
    options = dict(coordinator=None, process_id=None, timeout_s=9)
    assert distributed.hand_off(["a"], num_processes=1, **options) is None and calls == []
    assert distributed.hand_off(["a"], num_processes=2, verbose=True, **options) == 3
    assert calls.pop() == ("launch", ["a"], 2, {"timeout_s": 9, "verbose": True, "share_gpu": False})
    assert distributed.hand_off(["a"], num_processes=2, share_gpu=True, **options) == 3
    assert calls.pop() == ("launch", ["a"], 2, {"timeout_s": 9, "verbose": False, "share_gpu": True})
    joined = dict(options, coordinator="127.0.0.1:1", process_id=1)
    assert distributed.hand_off(["b"], num_processes=2, **joined) == 4
    assert calls.pop() == ("supervise", ["b"], dict(joined, num_processes=2, verbose=False))
    monkeypatch.setenv(distributed.SUPERVISED_ENV, "1")  # the supervised child runs the command itself
    assert distributed.hand_off(["b"], num_processes=2, **joined) is None and calls == []


def test_a_joined_process_keeps_stdout_for_its_results():
    """join_launch points file descriptor 1 (where native libraries print) at stderr; print() still reaches the
    original stdout."""
    code = ("from jax_dwdp import distributed; import os; distributed.initialize = lambda *a, **k: None; "
            "distributed.join_launch('127.0.0.1:1', 2, 0); os.write(1, b'Rank 0 is connected\\n'); print('result')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env(),
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "result\n" and proc.stderr == "Rank 0 is connected\n"


def test_ctrl_c_stops_every_process_with_one_line(tmp_path):
    """SIGINT to the launcher (the children are in their own process group, so a terminal's Ctrl-C reaches only
    the launcher): every process stopped, one "interrupted" line, exit 130."""
    launch = _Launch(tmp_path)
    try:
        launch.wait_for("running 1 warm-up")
        pids = launch.pids()
        assert all(os.getpgid(pid) != os.getpgid(launch.proc.pid) for pid in pids.values())
        os.kill(launch.proc.pid, signal.SIGINT)
        code = launch.proc.wait(timeout=60)
        text = "".join(launch.lines)
        print(f"launcher exit {code}: {text.strip().splitlines()[-1]}")
        assert code == 130 and text.count("interrupted") == 1 and "stopped every process" in text, text[-2000:]
        assert not any(_alive(pid) for pid in pids.values()), "a process outlived the launch"
    finally:
        launch.close()


def test_the_coordinator_port_is_held_until_the_launch_ends():
    """reserve_port: while held, no other program can bind the port (a plain bind fails), the coordinator can
    (SO_REUSEPORT, as gRPC binds); closed, the port is free again."""
    import socket

    from jax_dwdp.distributed import reserve_port

    held = reserve_port()
    port = held.getsockname()[1]
    other = socket.socket()
    with pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    other.close()
    coordinator = socket.socket()
    coordinator.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    coordinator.bind(("127.0.0.1", port))
    coordinator.listen()
    coordinator.close()
    held.close()
    again = socket.socket()
    again.bind(("127.0.0.1", port))
    again.close()


def test_json_output_is_one_object():
    """--json over 2 processes: stdout is the reporter's JSON object alone (gloo's own lines go to stderr)."""
    import json

    proc = subprocess.run(CLI + ["prefill", "--preset", "tiny", "--batch", "2", "--seq-len", "16", "--dwdp", "2",
                                 "--num-processes", "2", "--iters", "1", "--json"],
                          capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["command"] == "prefill" and result["logits_finite"]


def _in_launch(code: str, n: int = 2) -> list[str]:
    """Runs `code` in each process of a fresh CPU launch of n processes (after jax_dwdp's initialize; sys.argv[1:]
    = coordinator, n, process id); returns the lines they print, process by process."""
    from jax_dwdp.distributed import reserve_port

    code = ("import sys; from jax_dwdp.distributed import initialize; "
            "initialize(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), timeout_s=60)\n" + code)
    with reserve_port() as held:  # the coordinator's port, held until the launch ends
        port = held.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, "-c", code, f"127.0.0.1:{port}", str(n), str(i)], env=_env(),
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(n)]
        lines = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=120)
                assert p.returncode == 0, err[-2000:]
                lines += out.splitlines()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return lines


def _launch_ids(n: int = 2) -> list[str]:
    """Each process of a fresh CPU launch of n processes: its launch_id."""
    lines = _in_launch("from jax_dwdp.distributed import launch_id; print('ID', launch_id())", n)
    return [line.split()[1] for line in lines if line.startswith("ID ")]


def test_host_gather_assembles_an_array_split_over_processes():
    """distributed.host_gather (the logits of processes that share one GPU, where NCCL does not run): arrays
    sharded by rows over two processes' devices come back whole on every process, equal to what every process drew
    from the same seed; two gathers in a row, each under its own name, one of them bfloat16 (an ml_dtypes type)."""
    code = """
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax_dwdp.distributed import host_gather
mesh = Mesh(np.array(jax.devices()), ("r",))
import ml_dtypes
for name, shape, dtype in (("a", (6, 5), np.float32), ("b", (4, 3), ml_dtypes.bfloat16)):
    want = np.random.default_rng(7).standard_normal(shape).astype(dtype)
    arr = jax.make_array_from_callback(shape, NamedSharding(mesh, P("r")), lambda index: want[index])
    got = host_gather(arr, name)
    print("OK" if got.shape == shape and got.dtype == want.dtype and np.array_equal(got, want) else f"BAD {got} {want}")
"""
    assert _in_launch(code) == ["OK", "OK"] * 2


def test_launch_id_is_shared_by_a_launch_and_new_for_the_next():
    """The id that names a launch's UNIX sockets (the FFI store's descriptor exchange): process 0 draws it at
    initialize, every process reads the same; another launch draws another."""
    first, second = _launch_ids(), _launch_ids()
    assert len(first) == 2 and first[0] == first[1] and len(first[0]) == 16
    assert len(second) == 2 and second[0] == second[1] and second[0] != first[0]
