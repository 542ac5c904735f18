"""``fedbasin simulate`` leaves no process behind: stopped by SIGINT or SIGTERM mid-round, or
finishing normally, every process it started (Ray's GCS, raylet, agents and workers) is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = "local-epochs=1 max-train-examples=120 fraction-evaluate=0.0 model.dim=16 model.mlp-dim=32"


def _default_sigint() -> None:
    """SIGINT as a terminal delivers it: a test run started in the background by a non-interactive
    shell inherits SIGINT ignored, and Python then keeps ignoring it (no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(tmp_path: Path, rounds: int) -> tuple[subprocess.Popen, Path]:
    """``fedbasin simulate`` as a subprocess in its own session, output in a log file."""
    log = tmp_path / "simulate.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "fedbasin.cli", "simulate", "--num-supernodes", "2", "--out",
               str(tmp_path / "run"), "--run-config", f"num-server-rounds={rounds} {SMALL}"]
    with open(log, "w") as f:
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                   start_new_session=True, preexec_fn=_default_sigint)
    return process, log


def _session(sid: int) -> list[psutil.Process]:
    """Every live process of session ``sid`` (zombies excluded)."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == sid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    return members


def _wait_for_line(process: subprocess.Popen, log: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert process.poll() is None, f"simulate exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout}s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _assert_nothing_left(process: subprocess.Popen, started: list[psutil.Process], log: Path) -> None:
    """Neither the processes seen while it ran nor anything else in its session survives it."""
    _, alive = psutil.wait_procs(started, timeout=10)  # already stopped by simulate; bounded
    left = {p.pid: p.name() for p in alive if p.status() != psutil.STATUS_ZOMBIE}
    left.update({p.pid: p.name() for p in _session(process.pid)})
    assert not left, f"left running: {left}\n{log.read_text()[-2000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_simulate_and_every_process_it_started(tmp_path, sig, code):
    process, log = _start(tmp_path, rounds=20)
    try:
        _wait_for_line(process, log, "[ROUND 1/", timeout=240)
        started = psutil.Process(process.pid).children(recursive=True)
        assert any("raylet" in p.name() for p in started), [p.name() for p in started]
        os.kill(process.pid, sig)
        assert process.wait(timeout=120) == code, log.read_text()[-3000:]
        _assert_nothing_left(process, started, log)
        assert f"stopped by {sig.name}" in log.read_text()
        assert "Traceback" not in log.read_text()
    finally:
        _kill_session(process)


@pytest.mark.slow
def test_finished_simulate_leaves_no_process(tmp_path):
    process, log = _start(tmp_path, rounds=1)
    try:
        _wait_for_line(process, log, "[ROUND 1/", timeout=240)
        started = psutil.Process(process.pid).children(recursive=True)
        assert process.wait(timeout=240) == 0, log.read_text()[-3000:]
        _assert_nothing_left(process, started, log)
        assert (tmp_path / "run" / "results.json").is_file()
    finally:
        _kill_session(process)


def _kill_session(process: subprocess.Popen) -> None:
    """Clean up after a failed test: SIGKILL whatever is left of the process and its session."""
    for member in _session(process.pid):
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)
