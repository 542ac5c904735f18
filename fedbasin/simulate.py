"""``fedbasin simulate``: the fedbasin Flower app as a local simulation through ``flwr run``.

``flwr run`` is Flower 1.41's supported way to simulate (``flwr.simulation.run_simulation`` is
deprecated). ``fedbasin simulate`` wraps it so that one command starts, finishes and cleans up:

1. start a private ``flower-superlink --simulation`` on two free localhost ports, with a
   throwaway ``FLWR_HOME`` whose ``config.toml`` names only that SuperLink;
2. ``flwr run PROJECT fedbasin --stream`` with the run config (``[tool.flwr.app.config]`` keys,
   ``out-dir`` made absolute: the ServerApp runs in the SuperLink's process tree) and
   ``num-supernodes`` virtual SuperNodes of 1 CPU each (a GPU share each when CUDA is present);
3. ask ``flwr list --run-id`` for the run's final status (``--stream`` exits 0 even when the
   run failed) and fail unless it is ``finished:completed``;
4. stop the SuperLink and every process it started in every case, Ctrl-C and SIGTERM included.

PROJECT is the directory holding fedbasin's ``pyproject.toml`` (a source checkout). Writes
``OUT/results.json`` (plus checkpoints and ``curves.png``), appends the run's log to
``OUT/flwr-run.log`` (an earlier run's log is never replaced) and prints a per-round table.
Flower's commands are found on PATH, else beside the running interpreter
(:func:`fedbasin.deployment.flower_executable`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import tomllib
from pathlib import Path

from fedbasin.commandline import (
    EXIT_FAILED,
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OUTPUT,
    EXIT_TERMINATED,
    EXIT_USAGE,
)
from fedbasin.config import RunConfigError, resolve_run_config
from fedbasin.deployment import flower_env, flower_executable
from fedbasin.options import toml_value
from fedbasin.server.outputs import RESULTS_FILE, OutDirError, check_out_dir

LOG_FILE = "flwr-run.log"

DEFAULT_SUPERNODES = 3
TABLE_COLUMNS = (  # results key, header, format
    ("round", "round", "{}"),
    ("test_accuracy", "acc", "{:.4f}"),
    ("test_loss", "loss", "{:.3f}"),
    ("train_loss", "train", "{:.3f}"),
    ("eval_accuracy", "client", "{:.4f}"),
    ("align_gain", "gain", "{:.3f}"),
    ("aggregate_seconds", "agg s", "{:.2f}"),
    ("round_seconds", "round s", "{:.1f}"),
    ("num_excluded", "excl", "{}"),
)
TABLE_CAPTION = (
    "acc, loss: global model on the server's test split; train: clients' mean train loss; "
    "client: accuracy on the clients' held-out data; gain: alignment objective gain; "
    "agg s, round s: aggregation and round seconds; excl: excluded replies"
)


def run_config_help() -> str:
    """Every run-config key with its default, and the schema's options with their help (meanings:
    docs/flower.md; the schema: docs/options.md)."""
    from fedbasin.config import CHOICES, DEFAULT_RUN_CONFIG
    from fedbasin.options import run_config_fields

    schema = run_config_fields()
    lines = ["run-config keys (KEY=DEFAULT; TOML values; meanings in docs/flower.md, 'Run config'; "
             "'auto': by model kind and budget, docs/options.md):"]
    for key, value in DEFAULT_RUN_CONFIG.items():
        choices = f"   one of {' | '.join(CHOICES[key])}" if key in CHOICES else ""
        lines.append(f"  {key}={toml_value(value)}{choices}")
        if key in schema:
            lines.append(textwrap.fill(schema[key][2].help.replace("%%", "%"), 78, initial_indent=" " * 6,
                                       subsequent_indent=" " * 6))
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    from fedbasin.commandline import HelpFormatter

    class Formatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    p = subparsers.add_parser(
        "simulate",
        formatter_class=Formatter,
        help="run a federated simulation (flwr run, local SuperLink) and write results.json",
        description=textwrap.fill(
            "Run the fedbasin ServerApp/ClientApp as a local Flower simulation through `flwr run` on a "
            "private SuperLink that is stopped afterwards; print a per-round table and write "
            "OUT/results.json, per-round checkpoints OUT/round-NNNN/, OUT/curves.png and OUT/flwr-run.log "
            "(appended to). Exit codes: 0 done, 1 the run failed or its final model is unusable, 2 a bad "
            "option or run-config value (or one the ServerApp refused), 3 missing data, 4 an unusable --out.",
            78),
        epilog=run_config_help(),
    )
    p.add_argument(
        "--run-config",
        action="append",
        default=[],
        metavar='"KEY=VALUE ..."',
        help='run-config overrides (keys below; repeatable, as with flwr run), e.g. '
             '"num-server-rounds=5 symmetry=\'permutation\'"',
    )
    p.add_argument(
        "--num-supernodes",
        type=int,
        default=DEFAULT_SUPERNODES,
        help="virtual SuperNodes, one data partition and 1 CPU each",
    )
    p.add_argument("--out", metavar="DIR", help="output directory (overrides the run config's out-dir)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the outputs of an earlier run in --out (run config overwrite=true); without "
                   "it a non-empty output directory is refused")
    p.add_argument("--verbose", action="store_true", help="Flower debug logs")
    p.set_defaults(func=run)
    return p


_RUN_CONFIG_ITEM = re.compile(r"""([^\s=]+)=('[^']*'|"[^"]*"|\[[^\]]*\]|\S+)(?=\s|$)""")


def parse_run_config(text: str) -> dict:
    """``"k=v k=v"`` → dict, as ``flwr run --run-config`` reads it: whitespace-separated items whose
    values are TOML (``5``, ``0.1``, ``true``, ``'text'``, ``"a b"``, ``[1, 2]``), so a quoted value is
    a string (``rounds='3'`` is the text "3"); a bare value that is not TOML is taken as a string.
    A key given twice is refused (``flwr run`` would keep the last without a word)."""
    config, position = {}, 0
    while position < len(text):
        if text[position].isspace():
            position += 1
            continue
        item = _RUN_CONFIG_ITEM.match(text, position)
        if item is None:
            raise ValueError(f"run-config item {text[position:].split()[0]!r} is not KEY=VALUE")
        key, value = item.groups()
        if key in config:
            raise ValueError(f"run-config {key} given twice; give it once")
        try:
            config[key] = tomllib.loads(f"value = {value}")["value"]
        except tomllib.TOMLDecodeError:
            config[key] = value
        position = item.end()
    return config


def project_dir() -> Path:
    """The fedbasin project directory (``pyproject.toml`` with ``[tool.flwr.app]``) ``flwr run`` builds."""
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or "flwr" not in tomllib.loads(pyproject.read_text()).get("tool", {}):
        raise FileNotFoundError(
            f"no fedbasin pyproject.toml with [tool.flwr.app] at {root}: `flwr run` builds the app from "
            "a source checkout; install fedbasin with `pip install -e .` from one"
        )
    return root


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalSuperLink:
    """A private ``flower-superlink --simulation`` (own process group, own FLWR_HOME) for one run."""

    def __init__(self, home: Path, env: dict):
        self.home, self.port = home, _free_port()
        self.address = f"127.0.0.1:{self.port}"
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "fedbasin"\n\n[superlink.fedbasin]\naddress = "{self.address}"\n'
            "insecure = true\n"
        )
        self.env = {**env, "FLWR_HOME": str(home)}
        self.log = home / "superlink.log"
        command = [flower_executable("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
                   "--host", "127.0.0.1", "--port", str(self.port),
                   "--control-api-address", f"127.0.0.1:{_free_port()}"]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=_die_with_parent)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float = 60.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"flower-superlink exited with code {self.process.returncode}: "
                                   f"{self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://{self.address}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"flower-superlink did not come up on {self.address} within {timeout:.0f} s")

    def flwr(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([flower_executable("flwr"), *args], check=False, env=self.env, text=True, **kwargs)

    def stop(self) -> None:
        """Stop the SuperLink and everything it started: the SuperExec it spawns runs in a session
        of its own (with the simulation and Ray under it), so every process group in the
        SuperLink's process tree gets SIGTERM, then SIGKILL after a grace period."""
        if self.process.poll() is not None:
            return
        groups = {self.process.pid}
        for pid in _descendants(self.process.pid):
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                pass
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
            for group in groups:
                try:
                    os.killpg(group, sig)
                except ProcessLookupError:
                    pass
            try:
                self.process.wait(grace)
                return
            except subprocess.TimeoutExpired:
                continue


def _die_with_parent() -> None:
    """In the SuperLink child: ask Linux for SIGTERM when the process that started it dies (a
    ``kill -9`` of ``fedbasin simulate`` then still stops the SuperLink); a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C (the same clean-up) but reported with its own exit code."""




def _raise_terminated(signum, frame):
    raise Terminated(f"signal {signum}")


class RunFailed(RuntimeError):
    """The run started but did not end as ``finished:completed`` (exit code 1)."""


class InputUnusable(OSError):
    """An input the run config names (data, hf-pretrained, an hf-config file) cannot be found or
    read (exit code 3)."""


def _check_out_dir(config: dict) -> Path:
    """The output directory, refused before anything starts when it is unusable or a fresh run would
    find earlier outputs there (:func:`~fedbasin.server.outputs.check_out_dir`; the ServerApp checks
    again: it owns the directory)."""
    out = Path(config["out-dir"]).expanduser().resolve()
    check_out_dir(out, fresh=not config["resume"], overwrite=config["overwrite"])
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_REFUSED = re.compile(r"run config refused \((\d+) problems? above\)")


def _refusal(output: str) -> str | None:
    """The problems the ServerApp logged when it refused the run config (one line; None if it did
    not): the lines before its closing ``run config refused (N problems above)`` line."""
    lines = [_ANSI.sub("", line).strip() for line in output.splitlines()]
    closing = [i for i, line in enumerate(lines) if _REFUSED.search(line)]
    if not closing:
        return None
    end = closing[-1]
    count = int(_REFUSED.search(lines[end])[1])
    errors = [i for i in range(end) if "ERROR" in lines[i]][-count:] or list(range(max(0, end - count), end))
    problems = [re.sub(r"^.*?\bERROR\b[\]\s:|-]*", "", lines[i]) for i in errors]
    return "; ".join(p for p in problems if p)


def _append_log(log_path: Path, out: Path, header: str) -> None:
    """Append this invocation's log to ``out/flwr-run.log`` under a header line: the logs of earlier
    runs in ``out`` (the one a resume continues, or the one a refused resume would describe) stay."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / LOG_FILE, "a") as log:
        log.write(header)
        log.write(log_path.read_text(errors="replace"))


def _read_results(out: Path) -> dict:
    path = out / RESULTS_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise RunFailed(f"{path}: unreadable after the run ({type(error).__name__}: {_one_line(error)})") from None


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _stream(link: LocalSuperLink, command: list[str], log_path: Path) -> tuple[int, str]:
    """Run ``flwr ...`` echoing its output to stderr and ``log_path``; returns (exit code, output)."""
    lines = []
    env = dict(link.env, PYTHONUNBUFFERED="1")  # flwr's log lines arrive as they happen, not when a pipe buffer fills
    with open(log_path, "w") as log, subprocess.Popen([flower_executable("flwr"), *command], env=env, text=True,
                                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for line in proc.stdout:
            lines.append(line)
            log.write(line)
            sys.stderr.write(line)
    return proc.returncode, "".join(lines)


def simulate(config: dict, num_supernodes: int = DEFAULT_SUPERNODES, verbose: bool = False,
             project: Path | None = None) -> dict:
    """Run a resolved run config through ``flwr run`` on a private local SuperLink; return results.json.

    The data and model options are checked here first (a missing file fails before anything
    starts). ``project``: the Flower app directory (default: fedbasin's). Raises ``RuntimeError``
    when the run does not end as ``finished:completed`` (:class:`RunFailed`), :class:`RunConfigError`
    when the ServerApp refused the run config (e.g. ``resume=true`` on a damaged ``results.json``).
    """
    import torch

    from fedbasin.config import model_from_config, task_from_config
    from fedbasin.server.server_app import UnusableModelError

    if config["min-nodes"] > num_supernodes:
        raise ValueError(
            f"min-nodes={config['min-nodes']} exceeds --num-supernodes={num_supernodes}"
        )
    try:
        task = task_from_config(config)
    except (OSError, ValueError, RuntimeError) as error:  # missing, unreadable, not UTF-8, too few examples
        raise InputUnusable(f"run-config data={config['data']!r}: {_one_line(error)}") from None
    try:
        model_from_config(task, config, seed=config["seed"])
    except FileNotFoundError as error:  # hf-pretrained / hf-config naming no file: an input is missing
        raise InputUnusable(_one_line(error)) from None
    project = project or project_dir()
    out = _check_out_dir(config)
    run_config = " ".join(f"{k}={toml_value(v)}" for k, v in {**config, "out-dir": str(out)}.items())
    gpus = 1.0 / num_supernodes if torch.cuda.is_available() else 0.0
    federation = (f"num-supernodes={num_supernodes} client-resources-num-cpus=1 "
                  f"client-resources-num-gpus={gpus}" + (" verbose=true" if verbose else ""))
    # one BLAS thread per process unless told otherwise: clients get one CPU each
    env = flower_env({"OMP_NUM_THREADS": "1", **os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"})
    header = (f"===== fedbasin simulate {time.strftime('%Y-%m-%d %H:%M:%S')}: "
              f"{'resume' if config['resume'] else 'fresh run'} in {out} =====\n")
    previous = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM cleans up like Ctrl-C
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with tempfile.TemporaryDirectory(prefix="fedbasin-flwr-") as home:
            link = LocalSuperLink(Path(home), env)
            log_path = Path(home) / LOG_FILE  # copied into out-dir at the end: the ServerApp owns out-dir
            try:
                code, output = _stream(link, ["run", str(project), "fedbasin", "--stream", "--run-config", run_config,
                                              "--federation-config", federation], log_path)
                started = re.search(r"Successfully started run (\d+)", output)
                run_id = started.group(1) if started else None
                if run_id is None:
                    raise RunFailed(f"flwr run did not start a run (exit code {code}); see {out / LOG_FILE}")
                listed = link.flwr("list", "--run-id", run_id, "--format", "json", capture_output=True)
                runs = json.loads(listed.stdout or "{}").get("runs", [])
                status = runs[0]["status"] if runs else f"unknown ({listed.stderr.strip()[-300:]})"
            finally:
                link.stop()
                if log_path.is_file():
                    _append_log(log_path, out, header)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if refused := _refusal(output):  # the ServerApp ran nothing; results.json is an earlier run's
        raise RunConfigError([f"the ServerApp refused the run: {refused} (log: {out / LOG_FILE})"])
    results = _read_results(out)
    final = results.get("final", {})
    if final.get("usable") is False:
        raise UnusableModelError(f"the final global model in {out} is unusable: {final.get('reason')}")
    if status != "finished:completed":
        raise RunFailed(f"run {run_id} ended as {status}; see {out / LOG_FILE}")
    return results


def print_table(rounds: list[dict]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fedbasin simulate", caption=TABLE_CAPTION, box=box.SIMPLE_HEAD)
    columns = [c for c in TABLE_COLUMNS if any(c[0] in r for r in rounds)]
    for _, title, _ in columns:
        table.add_column(title, justify="right", no_wrap=True)
    for r in rounds:
        table.add_row(*(fmt.format(r[key]) if key in r else "" for key, _, fmt in columns))
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    """``fedbasin simulate``, with the exit codes of README.md's table: 0 done, 1 the run failed or
    its final model is unusable, 2 a bad option or run-config value, 3 missing data, 4 an unusable
    out-dir, 130 / 143 stopped by SIGINT / SIGTERM (everything the run started is stopped first)."""
    from fedbasin.server.server_app import UnusableModelError

    try:
        overrides = parse_run_config(" ".join(args.run_config))
        if args.out:
            overrides["out-dir"] = args.out
        if args.overwrite:
            overrides["overwrite"] = True
        config = resolve_run_config(overrides)
        if args.num_supernodes < 1:
            raise ValueError(f"--num-supernodes must be at least 1, got {args.num_supernodes}")
        results = simulate(config, args.num_supernodes, args.verbose)
    except OutDirError as error:
        print(f"fedbasin simulate: {_one_line(error)}", file=sys.stderr)
        return EXIT_OUTPUT
    except (UnusableModelError, RunFailed, OSError) as error:  # OSError: e.g. flwr not installed
        print(f"fedbasin simulate: {_one_line(error)}", file=sys.stderr)
        return EXIT_INPUT if isinstance(error, InputUnusable) else EXIT_FAILED
    except (ValueError, RuntimeError) as error:
        for line in str(error).splitlines():  # a refused run config: one line per key at fault
            print(f"fedbasin simulate: {line}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as stopped:
        name, code = (("SIGTERM", EXIT_TERMINATED) if isinstance(stopped, Terminated)
                      else ("SIGINT", EXIT_INTERRUPTED))
        print(f"fedbasin simulate: stopped by {name}; the SuperLink and every process it started were "
              "stopped; finished rounds are kept (resume=true continues)", file=sys.stderr)
        return code
    print_table(results["rounds"])
    print(f"results: {Path(config['out-dir']) / RESULTS_FILE}")
    return 0
