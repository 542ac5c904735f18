"""Deployment runtime on localhost: a SuperLink, two SuperNodes, one round via ``flwr run``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_for(condition, timeout: float, what: str, interval: float = 1.0):
    """Poll ``condition()`` until it returns a truthy value or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.slow
def test_one_round_on_a_superlink_with_two_supernodes(tmp_path):
    link_port, *node_ports = free_ports(3)
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local-deployment"\n\n'
        f'[superlink.local-deployment]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n'
    )
    env = dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    out = tmp_path / "run"
    commands = [["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(link_port)]]
    commands += [
        [
            "flower-supernode",
            "--insecure",
            "--superlink",
            f"127.0.0.1:{link_port}",
            "--port",
            str(port),
            "--node-config",
            f"partition-id={i} num-partitions=2",
        ]
        for i, port in enumerate(node_ports)
    ]
    logs = [tmp_path / f"{cmd[0]}-{i}.log" for i, cmd in enumerate(commands)]
    processes: list[subprocess.Popen] = []
    try:
        for cmd, log in zip(commands, logs):
            with open(
                log, "w"
            ) as f:  # own session: the SuperExec and app processes they spawn go with them
                processes.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
            if cmd[0] == "flower-superlink":
                wait_for(lambda: healthy(link_port), 60, "the SuperLink")

        run_config = f"num-server-rounds=1 local-epochs=1 fraction-evaluate=0.0 out-dir='{out}'"
        started = subprocess.run(
            ["flwr", "run", str(ROOT), "--run-config", run_config, "--format", "json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert started.returncode == 0, started.stderr
        run_id = json.loads(started.stdout)["run-id"]

        def status() -> str | None:
            listed = subprocess.run(
                ["flwr", "list", "--run-id", run_id, "--format", "json"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            value = json.loads(listed.stdout)["runs"][0]["status"] if listed.returncode == 0 else ""
            return value if value.startswith("finished") else None

        final = wait_for(status, 240, f"run {run_id} to finish", interval=5.0)
        tail = "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for log in logs)
        assert final == "finished:completed", tail
        rounds = json.loads((out / "results.json").read_text())["rounds"]
        assert [r["round"] for r in rounds] == [0, 1]
        assert rounds[1]["num_excluded"] == 0
    finally:
        for process in processes:
            signal_group(process, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=20)
            finally:  # whatever is left of the session (SuperExec, app processes)
                signal_group(process, signal.SIGKILL)
                process.wait()


def signal_group(process: subprocess.Popen, sig: int) -> None:
    """Signal the session (process group) that ``process`` leads, if any member is left."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
