"""One process per device: each process's start (jax.distributed) and the local launcher.

`jax-dwdp prefill ... --num-processes N` starts N local processes of the same command (`launch`), one device each
(on a GPU machine each sees every GPU and drives GPU I, $JAX_DWDP_LOCAL_DEVICE; on the CPU each has one host
device), with a coordinator on a free local port; `--coordinator HOST:PORT --process-id I --num-processes N`
instead joins a launch made by another tool (a cluster scheduler, mpirun, a notebook), which then also chooses each
process's device (for `--dwdp-backend ffi`: every GPU visible, $JAX_DWDP_LOCAL_DEVICE naming the process's own).

Every process runs the whole program (multi-controller JAX): the mesh spans all processes' devices, each builds
the same weights and keeps only its own devices' shards (`jax_dwdp.parallel.mesh.put`), and the collectives (the
DWDP all-gather, DEP's all-to-all) cross processes; on the CPU through gloo. With `--pipeline P` each process runs
its own stage and hands its hidden states to the next stage's process (`parallel.pipeline.Handoff`). Process 0
reports progress; the process that holds the logits (the last stage's) prints the results and writes --logits-out.

Failure: the launcher watches its processes; when one exits with an error or is killed, it stops the others
(SIGTERM, then SIGKILL after `GRACE_S`), names the process, and exits non-zero: nobody waits on a dead peer's
collective. Children die with the launcher (PR_SET_PDEATHSIG), so no orphan survives it either. A process of an
outside launch learns of a dead peer through JAX's heartbeat (`--process-timeout` seconds).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

GRACE_S = 5.0  # how long a stopped process gets to exit after SIGTERM before SIGKILL
EXIT_RUNTIME = 1
EXIT_INTERRUPTED = 130


LOCAL_DEVICE_ENV = "JAX_DWDP_LOCAL_DEVICE"


def initialize(coordinator: str, num_processes: int, process_id: int, *, timeout_s: int = 60) -> None:
    """Joins the launch: jax.distributed with CPU collectives over gloo (the GPU backends bring their own).
    Must run before anything touches a JAX device. With $JAX_DWDP_LOCAL_DEVICE=I (set by `launch` on a GPU
    machine) the process drives only GPU I of those it sees (`local_device_ids`): every process sees every GPU, so
    the FFI expert store can map and read its peers' memory on theirs, as one process driving them all does."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service catches SIGTERM (a stopped process would run on until SIGKILL): a process stopped by
    # the launcher, or by a scheduler, ends at once instead.
    jax.config.update("jax_enable_preemption_service", False)
    # The exit barrier waits for the slowest process, which may be writing the logits: not bounded by timeout_s.
    local = os.environ.get(LOCAL_DEVICE_ENV)
    jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=timeout_s, shutdown_timeout_seconds=max(timeout_s, 3600),
                               local_device_ids=[int(local)] if local else None)
    launch_id(timeout_s)  # process 0 publishes it now: a peer never waits on a process 0 that failed later


_LAUNCH_KEY = "jax_dwdp/launch_id"
_launch_id: str | None = None


def launch_id(timeout_s: float = 60.0) -> str:
    """A string that every process of this jax.distributed launch shares and no other launch has (it names the
    launch's UNIX sockets, parallel.fd_exchange): process 0 draws it and publishes it in jax.distributed's
    key-value store, the others read it (waiting up to `timeout_s`)."""
    global _launch_id
    if _launch_id is None:
        import secrets

        import jax
        from jax._src import distributed as jax_distributed

        client = jax_distributed.global_state.client
        if client is None:
            raise RuntimeError("launch_id: this process is not part of a jax.distributed launch")
        if jax.process_index() == 0:
            try:  # published already (by `initialize`), or by an earlier call
                value = client.key_value_try_get(_LAUNCH_KEY)
            except Exception:  # noqa: BLE001 (not found: jax raises its runtime's error)
                value = secrets.token_hex(8)
                client.key_value_set(_LAUNCH_KEY, value)
        else:
            try:
                value = client.blocking_key_value_get(_LAUNCH_KEY, int(timeout_s * 1000))
            except Exception as e:  # noqa: BLE001 (a deadline from the key-value store)
                raise RuntimeError(f"launch_id: process 0 did not publish the launch's id within {timeout_s:g} s "
                                   f"(did it fail before jax_dwdp's initialize or launch_id?): {e}") from None
        _launch_id = value
    return _launch_id


def shutdown() -> None:
    import jax

    global _launch_id
    jax.distributed.shutdown()
    _launch_id = None


def reserve_port() -> socket.socket:
    """A free local port for the coordinator, held until the launch ends: bound with SO_REUSEPORT (not listening),
    so process 0's coordinator (gRPC binds with SO_REUSEPORT) can bind it too while any other program that asks
    the system for a port cannot be handed this one in between (the race of picking a port, closing it, and
    binding it later). Linux (and macOS) have SO_REUSEPORT."""
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        return s
    except BaseException:
        s.close()
        raise


def visible_gpus() -> list[str]:
    """The GPUs the processes may take, without starting JAX (the launcher must not hold a device): none when
    JAX_PLATFORMS leaves out CUDA; the entries of CUDA_VISIBLE_DEVICES when it is set; else nvidia-smi's count."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(_gpu_count())]


def _gpu_count() -> int:
    """GPUs on this machine (nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(argv: list[str], num_processes: int, *, timeout_s: int = 60, status=None) -> int:
    """Runs `jax-dwdp ARGV --process-id I --coordinator 127.0.0.1:PORT` for I in [0, N); returns the exit code:
    0 when all succeed, else the first failure's (the others stopped). `status(text)` reports progress (stderr)."""
    status = status or (lambda text: print(text, file=sys.stderr, flush=True))
    gpus = visible_gpus()
    if gpus and len(gpus) < num_processes:
        status(f"error: --num-processes {num_processes} needs a GPU per process; {len(gpus)} are visible")
        return EXIT_RUNTIME
    port = reserve_port()
    coordinator = f"127.0.0.1:{port.getsockname()[1]}"
    procs: list[subprocess.Popen] = []
    try:
        for i in range(num_processes):
            env = dict(os.environ)
            if gpus:  # every process sees every GPU and drives its own (see initialize)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
                env[LOCAL_DEVICE_ENV] = str(i)
            cmd = [sys.executable, "-m", "jax_dwdp.cli", *argv, "--process-id", str(i), "--coordinator", coordinator,
                   "--process-timeout", str(timeout_s)]
            # Their own process group: a Ctrl-C at the terminal reaches the launcher only, which stops them all and
            # says so once (not one "interrupted" line per process).
            procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent, process_group=0))
        status(f"started {num_processes} processes (coordinator {coordinator}): "
               + ", ".join(f"process {i} pid {p.pid}" for i, p in enumerate(procs)))
        return _wait(procs, status)
    except KeyboardInterrupt:
        _stop(procs)
        status("error: interrupted; stopped every process")
        return EXIT_INTERRUPTED
    finally:
        _stop(procs)
        port.close()


def _wait(procs: list[subprocess.Popen], status) -> int:
    """Waits for every process; on the first failure stops the rest and names it."""
    running = dict(enumerate(procs))
    while running:
        for i, p in list(running.items()):
            code = p.poll()
            if code is None:
                continue
            del running[i]
            if code != 0:
                others = [f"process {j}" for j in running]
                _stop(list(running.values()))
                stopped = f"; stopped {', '.join(others)}" if others else ""
                status(f"error: process {i} (pid {p.pid}) {_describe(code)}{stopped}")
                return code if code > 0 else EXIT_RUNTIME
        time.sleep(0.05)
    return 0


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM, then SIGKILL after GRACE_S, to every process still running; waits for all of them."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
