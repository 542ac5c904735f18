"""A Flower deployment on localhost (SuperLink + SuperNodes + ``flwr`` CLI), for the deployment
tests and the round-time measurement (``python -m fedbasin.benchmarks.round_time``).

Everything lives under one work directory: a throwaway ``FLWR_HOME`` with its ``config.toml``,
one log file per process. Every process is started in its own session (process group) so that
what it spawns (SuperExec, ServerApp and ClientApp processes) is stopped with it;
:meth:`LocalFederation.close` signals those groups SIGTERM, waits (bounded), then SIGKILLs what
is left. Waits poll health endpoints, log lines and run status with a deadline; nothing sleeps
a fixed time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

FEDERATION = "local-deployment"


def flower_executable(name: str) -> str:
    """The path of Flower's ``name`` command (``flower-superlink``, ``flower-supernode``, ``flwr``):
    on PATH, else beside the running interpreter (``venv/bin/fedbasin`` run without the venv's
    ``bin`` on PATH). ``FileNotFoundError`` names both places when it is in neither."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise FileNotFoundError(f"{name} is neither on PATH nor beside the interpreter in {beside.parent}; "
                            "install flwr into this Python environment (pip install -e .)")


def flower_env(env: dict) -> dict:
    """``env`` with the interpreter's directory at the end of PATH where it is missing, so that the
    processes Flower starts in turn (SuperExec, ServerApp, ClientApp) find their commands too."""
    directory = str(Path(sys.executable).parent)
    path = env.get("PATH", "")
    if directory in path.split(os.pathsep):
        return dict(env)
    return {**env, "PATH": os.pathsep.join(p for p in (path, directory) if p)}


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that are free on 127.0.0.1 right now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.5):
    """Poll ``condition()`` until it returns a truthy value (returned) or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        if value := condition():
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def write_node_keys(private_path: Path) -> Path:
    """An EC P-384 key pair in OpenSSH format (``private_path`` and ``private_path.pub``), as
    ``ssh-keygen -t ecdsa -b 384`` writes it; returns the public key's path."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    private_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                               serialization.NoEncryption()))
    private_path.chmod(0o600)
    public_path = private_path.with_name(private_path.name + ".pub")
    public_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                          serialization.PublicFormat.OpenSSH) + b"\n")
    return public_path


class LocalFederation:
    """SuperLink and SuperNodes on 127.0.0.1 under ``workdir``; a context manager.

    ``certificates``: a directory from ``scripts/make_certs.sh`` (TLS on; else ``--insecure``).
    ``node_auth``: start the SuperLink with ``--enable-supernode-auth`` (needs TLS).
    """

    def __init__(self, workdir: Path, certificates: Path | None = None, node_auth: bool = False,
                 env: dict | None = None):
        if node_auth and certificates is None:
            raise ValueError("SuperNode authentication needs TLS certificates")
        self.workdir = Path(workdir)
        self.certificates = certificates
        self.node_auth = node_auth
        self.home = self.workdir / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.link_port = free_ports(1)[0]
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = dict(flower_env(dict(os.environ if env is None else env)), FLWR_HOME=str(self.home),
                        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
        tls = (f'root-certificates = "{certificates / "ca.crt"}"\n' if certificates else "insecure = true\n")
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{FEDERATION}"\n\n'
            f'[superlink.{FEDERATION}]\naddress = "127.0.0.1:{self.link_port}"\n{tls}'
        )

    # -- processes --------------------------------------------------------------------------

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        """Start ``command`` in its own session, output to ``<name>.log``."""
        with open(self.log(name), "w") as log:
            process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self.processes[name] = process
        return process

    def start_superlink(self, timeout: float = 60) -> subprocess.Popen:
        command = [flower_executable("flower-superlink"), "--host", "127.0.0.1", "--port", str(self.link_port)]
        if self.certificates:
            c = self.certificates
            command += ["--ssl-ca-certfile", str(c / "ca.crt"), "--ssl-certfile", str(c / "server.pem"),
                        "--ssl-keyfile", str(c / "server.key")]
        else:
            command.append("--insecure")
        if self.node_auth:
            command.append("--enable-supernode-auth")
        process = self.start("superlink", command)
        wait_for(lambda: self._healthy() or self._exited("superlink"), timeout, "the SuperLink")
        return process

    def start_supernode(self, name: str, node_config: str, private_key: Path | None = None) -> subprocess.Popen:
        command = [flower_executable("flower-supernode"), "--superlink", f"127.0.0.1:{self.link_port}",
                   "--port", str(free_ports(1)[0]), "--node-config", node_config]
        command += ["--root-certificates", str(self.certificates / "ca.crt")] if self.certificates else ["--insecure"]
        if private_key is not None:
            command += ["--auth-supernode-private-key", str(private_key)]
        return self.start(name, command)

    def _exited(self, name: str) -> bool:
        process = self.processes[name]
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.tail(name)}")
        return False

    def _healthy(self) -> bool:
        scheme = "https" if self.certificates else "http"
        context = ssl.create_default_context(cafile=str(self.certificates / "ca.crt")) if self.certificates else None
        try:
            with urllib.request.urlopen(f"{scheme}://127.0.0.1:{self.link_port}/health", timeout=2,
                                        context=context) as response:
                return response.status == 200
        except OSError:
            return False

    def tail(self, name: str, chars: int = 3000) -> str:
        path = self.log(name)
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def tails(self) -> str:
        return "\n".join(f"--- {name}.log\n{self.tail(name)}" for name in self.processes)

    def close(self, timeout: float = 20) -> None:
        """SIGTERM every process group, wait up to ``timeout`` s, SIGKILL whatever is left and
        wait (bounded) until no live process remains in any of the groups."""
        for process in self.processes.values():
            _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(process.pid, signal.SIGKILL)  # the group's other members (app processes)
            process.wait()
        try:  # SIGKILL is delivered asynchronously; callers check left_running() themselves
            wait_for(lambda: not self.left_running(), timeout, "the federation's processes to exit", interval=0.2)
        except TimeoutError:
            pass

    def left_running(self) -> list[int]:
        """PIDs of live (non-zombie) processes in the process groups this federation started."""
        import psutil

        groups = {process.pid for process in self.processes.values()}
        left = []
        for candidate in psutil.process_iter():
            try:
                if os.getpgid(candidate.pid) in groups and candidate.status() != psutil.STATUS_ZOMBIE:
                    left.append(candidate.pid)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        return left

    def __enter__(self) -> LocalFederation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the flwr CLI -------------------------------------------------------------------------

    def flwr(self, *args: str, timeout: float = 120) -> dict:
        """``flwr ARGS --format json`` against this federation; the parsed JSON reply."""
        done = subprocess.run([flower_executable("flwr"), *args, "--format", "json"], env=self.env, capture_output=True,
                              text=True, timeout=timeout, check=False)
        try:
            reply = json.loads(done.stdout)
        except json.JSONDecodeError:
            reply = {"success": False}
        if done.returncode != 0 or not reply.get("success", True):
            raise RuntimeError(f"flwr {' '.join(args)} failed ({done.returncode}): {done.stdout} {done.stderr}")
        return reply

    def register(self, public_key: Path) -> int:
        """Register a SuperNode's public key with the SuperLink; its node id."""
        return int(self.flwr("supernode", "register", str(public_key), FEDERATION)["node-id"])

    def submit(self, app: Path, run_config: str) -> int:
        return int(self.flwr("run", str(app), FEDERATION, "--run-config", run_config)["run-id"])

    def status(self, run_id: int) -> str:
        return self.flwr("list", FEDERATION, "--run-id", str(run_id))["runs"][0]["status"]

    def wait_finished(self, run_id: int, timeout: float) -> str:
        return wait_for(lambda: (s := self.status(run_id)).startswith("finished") and s, timeout,
                        f"run {run_id} to finish", interval=2.0)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


__all__ = ["LocalFederation", "flower_env", "flower_executable", "free_ports", "wait_for", "write_node_keys"]
