"""One process per device: each process's start (jax.distributed) and the local launcher.

`jax-dwdp prefill ... --num-processes N` starts N local processes of the same command (`launch`), one device each
(on a GPU machine each sees every GPU and drives GPU I, $JAX_DWDP_LOCAL_DEVICE; on the CPU each has one host
device), with a coordinator on a free local port; `--coordinator HOST:PORT --process-id I --num-processes N`
instead joins a launch made by another tool (a cluster scheduler, mpirun, a notebook), which then also chooses each
process's device (for `--experts ffi`: every GPU visible, $JAX_DWDP_LOCAL_DEVICE naming the process's own).

Every process runs the whole program (multi-controller JAX): the mesh spans all processes' devices, each builds
the same weights and keeps only its own devices' shards (`jax_dwdp.devices.put`), and the collectives (the
DWDP all-gather, DEP's all-to-all) cross processes; on the CPU through gloo. With `--pipeline P` each process runs
its own stage and hands its hidden states to the next stage's process (`parallel.pipeline.Handoff`). Process 0
reports progress; the process that holds the logits (the last stage's) prints the results and writes --logits-out.

Failure: the launcher watches its processes; when one exits with an error or is killed, it stops the others
(SIGTERM, then SIGKILL after `GRACE_S`), names the process, and exits non-zero: nobody waits on a dead peer's
collective. Children die with the launcher (PR_SET_PDEATHSIG), so no orphan survives it either. A process of an
outside launch learns of a dead peer through JAX's heartbeat (`--process-timeout` seconds).

Messages: jax.distributed ends a process whose launch fails (a peer that never joins, a coordinator that is not
there, a peer that stops answering) with a C++ abort and a stack dump, which no Python handler can catch. So
every process of a launch runs under a parent that reads its stderr (`supervise`, or the launcher itself): the
native libraries' own log lines (XLA, gRPC, gloo) are held back unless --verbose (`NativeLogFilter`), and such a
death becomes one line that says what happened (`explain_death`).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 5.0  # how long a stopped process gets to exit after SIGTERM before SIGKILL
EXIT_RUNTIME = 1
EXIT_INTERRUPTED = 130


LOCAL_DEVICE_ENV = "JAX_DWDP_LOCAL_DEVICE"
SUPERVISED_ENV = "JAX_DWDP_SUPERVISED"  # set in a process whose stderr a parent reads (`supervise`, `launch`)
PARENT_ENV = "JAX_DWDP_PARENT_PID"  # the pid of that parent, which the process must not outlive (die_with_parent)

# The start of a native library's log line: glog / absl ("E1207 03:17:57.924346 7178 file.cc:454] ..."), a check
# failure's stack dump, the C++ runtime's last words, gloo's connection lines.
_NATIVE = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\]|\*\*\* |\s+@\s+0x|terminate called|  what\(\):|"
                     r"Rank \d+ is connected)")
# Lines of jax-dwdp's own: results, progress ("compiling ..."), errors and notes, Python's tracebacks (--debug).
_OURS = re.compile(r"^(error:|warning:|notice:|started |Traceback|\{|jax-dwdp|usage:)|\.\.\.$")


class NativeLogFilter:
    """Decides, line by line, what of a process's stderr a user sees: everything but the native libraries' log
    messages (a message runs from its first line to the next line of jax-dwdp's own). Held-back lines are kept
    (the last `keep`) for `explain_death`."""

    def __init__(self, verbose: bool = False, keep: int = 200):
        self.verbose, self.keep = verbose, keep
        self.held: list[str] = []
        self._inside = False

    def passes(self, line: str) -> bool:
        if _NATIVE.match(line):
            self._inside = True
        elif self._inside and _OURS.search(line.rstrip("\n")):
            self._inside = False
        if not self._inside:
            return True
        self.held = (self.held + [line.rstrip("\n")])[-self.keep:]
        return self.verbose

    def relay(self, stream, out) -> None:
        """Copies `stream`'s lines to `out` through the filter until the stream ends."""
        for line in iter(stream.readline, ""):
            if self.passes(line):
                out.write(line)
                out.flush()


NATIVE_LOG_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "GRPC_VERBOSITY": "ERROR"}  # errors only (3 hides fatal ones too)


def quiet_native_logs(verbose: bool) -> None:
    """Keeps XLA's and gRPC's own log lines (below fatal) off stderr unless `verbose`, where the user has not chosen
    a level; must run before jax starts (the entry script calls it before importing jax)."""
    if not verbose:
        for name, value in NATIVE_LOG_ENV.items():
            os.environ.setdefault(name, value)


def ensure_host_devices(need: int) -> None:
    """A CPU-only run over `need` devices needs that many host devices, which XLA creates only if told before its
    backend starts; the flag is ignored by GPU backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    if need > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={need}".strip()


def check_options(num_processes: int, coordinator: str | None, process_id: int | None, timeout_s: float) -> None:
    """A launch's options on their own (the CLI's --num-processes, --coordinator, --process-id, --process-timeout):
    a consistent set; a ValueError naming the option otherwise."""
    joined = coordinator is not None or process_id is not None
    if num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    if not timeout_s > 0:
        raise ValueError(f"--process-timeout must be > 0 seconds, got {timeout_s}")
    if coordinator is not None:
        check_address(coordinator)
    if joined and (coordinator is None or process_id is None or num_processes < 2):
        raise ValueError("joining a launch needs --coordinator HOST:PORT, --process-id I and --num-processes N "
                         "(N >= 2)")
    if joined and not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must lie in [0, {num_processes}), got {process_id}")


def check_layout(num_processes: int, pipeline: int, ranks: int, *, experts: str | None = None, joined: bool = False,
                 chunked: bool = False, share_gpu: bool = False) -> None:
    """A launch of `num_processes` >= 2 against the layout it runs (`pipeline` stages x `ranks` per stage, `experts`
    their backend, `chunked` a chunked prefill): one device per process; a ValueError naming the option otherwise.
    `joined`: this process joins a launch made by another tool, and finds out about its GPUs when its driver is
    built (a launcher of its own asks first: it must not start processes that cannot run). `share_gpu`: every
    process on one GPU, the rehearsal of a multi-GPU launch; only ranks whose experts come from the FFI store,
    which need no device collective (NCCL, which XLA's collectives run on, refuses two ranks on one GPU: the XLA
    all-gather, DEP's all-to-all and the pipeline's hand-off cannot run there)."""
    devices = pipeline * ranks
    if devices != num_processes:
        raise ValueError(f"--num-processes {num_processes}: one process per device, but the layout (--pipeline "
                         f"{pipeline} x {ranks} ranks) uses {devices} device(s)")
    if pipeline > 1 and ranks > 1:
        raise ValueError("across processes, --pipeline runs one device per stage and --dwdp / --dep ranks one stage: "
                         "not both yet")
    if experts == "ffi" and not joined and not visible_gpus():
        raise ValueError("--experts ffi across processes needs a CUDA GPU per process; none is visible (use "
                         "--experts xla)")
    if chunked:
        raise ValueError("--prefill-chunk runs on one device, in one process")
    if share_gpu and (experts != "ffi" or pipeline > 1):
        raise ValueError("--share-gpu runs --dwdp N --experts ffi ranks only: the XLA all-gather, DEP's all-to-all and "
                         "the pipeline's hand-off run on NCCL, which refuses two ranks on one GPU")


def check_address(address: str) -> None:
    """--coordinator HOST:PORT (an IPv6 host in brackets), checked before jax.distributed sees it."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or host in ("[]",):
        raise ValueError(f"--coordinator {address!r}: expected HOST:PORT, e.g. 10.0.0.1:1234 or [::1]:1234")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--coordinator {address!r}: the port {port!r} is not a number in [1, 65535]")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"--coordinator {address!r}: write an IPv6 host in brackets, e.g. [::1]:{port}")


def _answers(coordinator: str) -> bool:
    host, _, port = coordinator.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except OSError:
        return False


def explain_death(code: int, held: list[str], *, process_id: int, num_processes: int, coordinator: str,
                  timeout_s: float) -> str:
    """One line for a process of a launch that died without saying why itself (a native abort)."""
    text = "\n".join(held)
    who = f"process {process_id} of {num_processes}"
    if "RegisterTask" in text and ("DEADLINE_EXCEEDED" in text or "Deadline Exceeded" in text):
        if process_id != 0 and not _answers(coordinator):
            return (f"{who}: nothing answers at {coordinator}, where process 0 of the launch (the coordinator) "
                    f"should run; waited {timeout_s:g} s (--process-timeout)")
        others = [i for i in range(num_processes) if i != process_id]
        missing = (f"process {others[0]}" if len(others) == 1 else
                   f"one or more of processes {', '.join(map(str, others))}")
        return f"{who}: {missing} did not join the launch at {coordinator} within {timeout_s:g} s (--process-timeout)"
    dead = re.search(r"stopped sending heartbeats\):\s*\n([\d, ]+)", text)
    if dead:
        ids = dead.group(1).strip().rstrip(",")
        return (f"{who}: process {ids} stopped answering (no heartbeat for {timeout_s:g} s, --process-timeout); "
                "this process stopped too")
    fatal = [line.split("] ", 1)[1] for line in held if line[:1] == "F" and "] " in line]
    why = f": {fatal[-1][:200]}" if fatal else ""
    return f"{who} {_describe(code)}{why} (--verbose shows the native libraries' messages)"


def hand_off(argv: list[str], *, num_processes: int, coordinator: str | None, process_id: int | None,
             timeout_s: int, verbose: bool = False, share_gpu: bool = False) -> int | None:
    """Where a checked `jax-dwdp ARGV` of one process per device runs when not in this process: in N local
    processes that this one starts (`launch`: no process id given), or, for a process of an outside launch, in a
    child whose stderr this one reads (`supervise`, unless this is that child). Returns their exit code; None when
    this process runs the command itself."""
    if num_processes > 1 and process_id is None:
        return launch(argv, num_processes, timeout_s=timeout_s, verbose=verbose, share_gpu=share_gpu)
    if process_id is not None and not os.environ.get(SUPERVISED_ENV):
        return supervise(argv, process_id=process_id, num_processes=num_processes, coordinator=coordinator,
                         timeout_s=timeout_s, verbose=verbose)
    return None


def supervise(argv: list[str], *, process_id: int, num_processes: int, coordinator: str, timeout_s: float,
              verbose: bool = False) -> int:
    """Runs this process's part of an outside launch (`jax-dwdp ARGV`) as a child whose stderr passes through
    `NativeLogFilter`; stdout (the results) is the child's own. SIGTERM is passed on; Ctrl-C reaches the child
    from the terminal. Returns the child's exit code, or 1 after one line for a native abort."""
    env = dict(os.environ, **{SUPERVISED_ENV: "1", PARENT_ENV: str(os.getpid())})
    child = subprocess.Popen([sys.executable, "-m", "jax_dwdp.cli", *argv], env=env, stderr=subprocess.PIPE,
                             text=True, errors="replace")
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child has it too (same process group) and reports it
    try:
        logs = NativeLogFilter(verbose)
        logs.relay(child.stderr, sys.stderr)
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if child.poll() is None:
            child.kill()
            child.wait()
    if code in (0, 1, 2, EXIT_INTERRUPTED):  # jax-dwdp's own exits: it has said why
        return code
    print("error: " + explain_death(code, logs.held, process_id=process_id, num_processes=num_processes,
                                    coordinator=coordinator, timeout_s=timeout_s), file=sys.stderr, flush=True)
    return EXIT_RUNTIME


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


def join_launch(coordinator: str, num_processes: int, process_id: int, *, timeout_s: int = 60) -> None:
    """`initialize` for a process whose stdout carries its results (the CLI's: --json is one JSON object there).
    Native libraries print to file descriptor 1 (gloo: "Rank i is connected ..."), so fd 1 is pointed at stderr and
    sys.stdout keeps the results through a duplicate of the original."""
    sys.stdout.flush()
    results = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(results, "w", buffering=1)
    initialize(coordinator, num_processes, process_id, timeout_s=timeout_s)


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


def host_gather(array, name: str, *, timeout_s: float = 600.0):
    """The whole of `array` (a jax.Array split over this launch's processes) as one numpy array on every process,
    through jax.distributed's key-value store: host memory and the coordinator's gRPC, no device collective. For
    processes that share one GPU (`launch(share_gpu=True)`), where NCCL, which XLA's collectives use, refuses two
    ranks on one device. Each process publishes its addressable shards (their index and bytes) under `name`, unique
    per gather in a launch, then reads every process's."""
    import io

    import jax
    import numpy as np
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("host_gather: this process is not part of a jax.distributed launch")
    key = f"jax_dwdp/{launch_id()}/gather/{name}/"
    fields = {}
    for i, shard in enumerate(array.addressable_shards):
        bounds = [sl.indices(n)[:2] for sl, n in zip(shard.index, array.shape)]
        fields[f"bounds_{i}"] = np.asarray(bounds, np.int64).reshape(-1, 2)
        # raw bytes: np.save keeps no ml_dtypes type (bfloat16 would come back as void)
        fields[f"data_{i}"] = np.ascontiguousarray(np.asarray(shard.data)).reshape(-1).view(np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **fields)
    client.key_value_set_bytes(key + str(jax.process_index()), buf.getvalue())
    out = np.empty(array.shape, array.dtype)
    for process in range(jax.process_count()):
        try:
            blob = client.blocking_key_value_get_bytes(key + str(process), int(timeout_s * 1000))
        except Exception as e:  # noqa: BLE001 (a deadline from the key-value store)
            raise RuntimeError(f"host_gather({name!r}): process {process} did not publish its shards within "
                               f"{timeout_s:g} s: {e}") from None
        with np.load(io.BytesIO(blob)) as parts:
            for i in range(len(parts.files) // 2):
                where = tuple(slice(a, b) for a, b in parts[f"bounds_{i}"])
                out[where] = parts[f"data_{i}"].view(array.dtype).reshape(out[where].shape)
    return out


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


def die_with_parent() -> None:
    """In a process started by `launch` or `supervise` (their pid in $JAX_DWDP_PARENT_PID), as its first step:
    SIGKILL when that parent dies (Linux prctl PR_SET_PDEATHSIG), and exit at once if it has died already. Done by
    the child itself rather than in a preexec_fn, which would run JAX's at-fork warning in a parent that has
    imported it and is unsafe in a parent with threads."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass
    if os.getppid() != int(parent):  # the parent died before the prctl
        os._exit(EXIT_RUNTIME)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(argv: list[str], num_processes: int, *, timeout_s: int = 60, status=None, verbose: bool = False,
           share_gpu: bool = False) -> int:
    """Runs `jax-dwdp ARGV --process-id I --coordinator 127.0.0.1:PORT` for I in [0, N); returns the exit code:
    0 when all succeed, else the first failure's (the others stopped). `status(text)` reports progress (stderr);
    the processes' stderr passes through `NativeLogFilter` (verbose: everything). `share_gpu`: every process
    drives the first visible GPU (the one-GPU rehearsal of a multi-GPU launch, see `check_layout`)."""
    status = status or (lambda text: print(text, file=sys.stderr, flush=True))
    gpus = visible_gpus()
    if share_gpu and not gpus:
        status("error: --share-gpu: no GPU is visible")
        return EXIT_RUNTIME
    if gpus and not share_gpu and len(gpus) < num_processes:
        status(f"error: --num-processes {num_processes} needs a GPU per process; {len(gpus)} are visible (one "
               "GPU: --share-gpu rehearses the launch on it)")
        return EXIT_RUNTIME
    port = reserve_port()
    coordinator = f"127.0.0.1:{port.getsockname()[1]}"
    procs: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    try:
        for i in range(num_processes):
            env = dict(os.environ, **{SUPERVISED_ENV: "1", PARENT_ENV: str(os.getpid())})
            if gpus:  # every process sees every GPU and drives its own (see initialize)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
                env[LOCAL_DEVICE_ENV] = "0" if share_gpu else str(i)
            cmd = [sys.executable, "-m", "jax_dwdp.cli", *argv, "--process-id", str(i), "--coordinator", coordinator,
                   "--process-timeout", str(timeout_s)]
            # Their own process group: a Ctrl-C at the terminal reaches the launcher only, which stops them all and
            # says so once (not one "interrupted" line per process).
            procs.append(subprocess.Popen(cmd, env=env, process_group=0,
                                          stderr=subprocess.PIPE, text=True, errors="replace"))
            relays.append(threading.Thread(target=NativeLogFilter(verbose).relay, args=(procs[-1].stderr, sys.stderr),
                                           daemon=True))
            relays[-1].start()
        status(f"started {num_processes} processes (coordinator {coordinator}): "
               + ", ".join(f"process {i} pid {p.pid}" for i, p in enumerate(procs)))
        return _wait(procs, status)
    except KeyboardInterrupt:
        _stop(procs)
        status("error: interrupted; stopped every process")
        return EXIT_INTERRUPTED
    finally:
        _stop(procs)
        for relay in relays:
            relay.join(timeout=GRACE_S)
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
