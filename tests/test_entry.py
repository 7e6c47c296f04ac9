"""Ctrl-C while the jax-dwdp console script is still importing jax: one line and exit 130, not a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.processes import popen_default_sigint

ROOT = Path(__file__).resolve().parent.parent
ENTRY = "import sys; from jax_dwdp.entry import main; sys.exit(main())"  # what pip's jax-dwdp script runs
MARKER = "fake jax: importing"


def _slow_jax(tmp_path: Path) -> dict[str, str]:
    """An environment whose `import jax` announces itself and then takes a minute (the real one takes seconds)."""
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text(
        f"import sys, time\nsys.stderr.write({MARKER + chr(10)!r})\nsys.stderr.flush()\ntime.sleep(60)\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def _start(env, *args):
    return popen_default_sigint([sys.executable, "-c", ENTRY, *args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)


def test_console_script_is_the_entry_module():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["jax-dwdp"] == "jax_dwdp.entry:main"


def test_ctrl_c_during_the_jax_import_is_one_line_and_exit_130(tmp_path):
    proc = _start(_slow_jax(tmp_path), "prefill", "--preset", "tiny")
    try:
        assert proc.stderr.readline().strip() == MARKER  # the process is inside `import jax` now
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    print(f"exit {proc.returncode}, stderr {err!r}")
    assert proc.returncode == 130
    assert err.splitlines() == ["error: interrupted while starting (importing jax); nothing was done"]
    assert out == ""


def test_help_and_usage_errors_do_not_import_jax(tmp_path):
    env = _slow_jax(tmp_path)
    done = subprocess.run([sys.executable, "-c", ENTRY, "--help"], env=env, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0 and "usage: jax-dwdp" in done.stdout and MARKER not in done.stderr
    bad = subprocess.run([sys.executable, "-c", ENTRY, "prefill", "--nope"], env=env, capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and MARKER not in bad.stderr


def test_the_cli_runs_with_pythons_own_sigint_handler(monkeypatch):
    """After the import the CLI's KeyboardInterrupt handling (its cleanup) takes over again."""
    from jax_dwdp import cli, entry

    seen = []
    monkeypatch.setattr(cli, "main", lambda: seen.append(signal.getsignal(signal.SIGINT)) or 0)
    monkeypatch.setattr(sys, "argv", ["jax-dwdp", "plan", "--preset", "tiny"])
    before = signal.getsignal(signal.SIGINT)
    assert entry.main() == 0
    assert seen == [before] and signal.getsignal(signal.SIGINT) is before


def test_debug_keeps_the_traceback(tmp_path):
    proc = _start(_slow_jax(tmp_path), "--debug", "prefill", "--preset", "tiny")
    try:
        assert proc.stderr.readline().strip() == MARKER
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in err and "Traceback" in err
