"""Where a CUDA toolkit is found, `pip install` says that it is building the FFI libraries and how to skip that,
on the terminal (pip hides build output), and says nothing of the kind with JAX_DWDP_BUILD_FFI=0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _fake_toolkit(tmp_path: Path) -> Path:
    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    (home / "include" / "cuda.h").write_text("/* a CUDA toolkit as cuda_paths.cuda_home() sees one */\n")
    return home


def _env(tmp_path: Path, home: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_DWDP_BUILD_FFI"}
    env.update(CUDA_HOME=str(home), JAX_DWDP_NOTICE_TTY=str(tmp_path / "tty"), **extra)
    return env


def _requires(tmp_path, env):
    code = "import build_backend; print(build_backend._ffi_requires())"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT / "ffi", env=env, capture_output=True, text=True,
                          check=True, timeout=120)


def test_build_requirements_step_says_the_ffi_build_runs_and_how_to_skip_it(tmp_path):
    home = _fake_toolkit(tmp_path)
    run = _requires(tmp_path, _env(tmp_path, home))
    tty = (tmp_path / "tty").read_text()
    print(tty)
    assert "nvidia-cutlass" in run.stdout  # the FFI build's requirements were asked for
    assert tty.count("\n") == 1 and tty.startswith("jax_dwdp: ")
    assert f"a CUDA toolkit is at {home}" in tty and "builds the FFI libraries" in tty
    assert "JAX_DWDP_BUILD_FFI=0 skips it" in tty
    assert tty in run.stderr  # and in the build log


def test_no_notice_when_the_build_is_skipped(tmp_path):
    run = _requires(tmp_path, _env(tmp_path, _fake_toolkit(tmp_path), JAX_DWDP_BUILD_FFI="0"))
    assert run.stdout.strip() == "[]"
    assert not (tmp_path / "tty").exists() and "jax_dwdp:" not in run.stderr


def test_setup_py_announces_the_cmake_build(tmp_path):
    """The build step itself: a CMake that fails at once (a stand-in on PATH) still shows the announcement, then
    the 'did not build' line, on the terminal too (unset JAX_DWDP_BUILD_FFI: not an error); the outcome is
    recorded in the library folder's BUILD.json, which `jax-dwdp prefill` reports where no terminal is."""
    home = _fake_toolkit(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text("#!/bin/sh\nexit 3\n")
    (bin_dir / "cmake").chmod(0o755)
    env = _env(tmp_path, home, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(tmp_path / "build"),
                          "--build-lib", str(tmp_path / "lib")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    tty = (tmp_path / "tty").read_text()
    print(tty, run.stdout[-2000:], run.stderr[-2000:])
    assert run.returncode == 0
    assert tty.startswith("jax_dwdp: building the FFI libraries with CMake") and "JAX_DWDP_BUILD_FFI=0 skips" in tty
    assert "did not build" in tty and "did not build" in run.stderr
    record = json.loads((tmp_path / "lib" / "jax_dwdp" / "_lib" / "BUILD.json").read_text())
    assert record["outcome"] == "failed" and "exit status 3" in record["detail"], record
