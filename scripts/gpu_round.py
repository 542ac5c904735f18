"""A real Flower deployment round on a GPU: a SuperLink and SuperNodes on 127.0.0.1 (no Ray), the
fedbasin app submitted with ``flwr run``, clients and server on ``device="cuda"``, the server
distilling the clients' ensemble into the aligned merge. Prints each round's figures and the
processes seen on the GPU while the run went (``nvidia-smi``: evidence of where the work ran).

    python scripts/gpu_round.py [--out DIR] [--rounds 2] [--nodes 2] [--run-config "KEY=VALUE ..."]

Needs an NVIDIA GPU, PyTorch with CUDA and Flower 1.41 (``flower-superlink``, ``flower-supernode``
and ``flwr`` on PATH). Data: scikit-learn's bundled digits (offline). docs/scale.md, "On a GPU",
quotes its output.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from fedbasin.deployment import LocalFederation, wait_for

ROOT = Path(__file__).resolve().parents[1]
RUN_CONFIG = ("device='cuda' init='client' local-epochs=10 proxy-size=300 refine-steps=100 "
              "distill-steps=300 distill-teacher='probabilities' fraction-evaluate=0.0")


def gpu_processes() -> list[str]:
    """``pid, used memory`` of every compute process on the GPU now."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                              capture_output=True, text=True, check=False)
    except FileNotFoundError:  # no NVIDIA driver here
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def watch_gpu(seen: dict, stop: threading.Event, interval: float = 1.0) -> None:
    """Record the largest memory each GPU process was seen with until ``stop`` is set."""
    while not stop.is_set():
        for line in gpu_processes():
            pid, _, used = line.partition(",")
            seen[pid.strip()] = max(seen.get(pid.strip(), 0), int(used.strip().split()[0] or 0))
        stop.wait(interval)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-round"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--run-config", default="", help="more KEY=VALUE pairs, after the script's own")
    parser.add_argument("--timeout", type=float, default=400)
    args = parser.parse_args(argv)
    if args.out.exists():
        print(f"gpu_round: {args.out} exists; name a new --out", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True)
    run_dir = (args.out / "run").resolve()
    pairs = shlex.split(f"num-server-rounds={args.rounds} min-nodes={args.nodes} {RUN_CONFIG} "
                        f"out-dir='{run_dir}' {args.run_config}", posix=False)
    config = " ".join({p.partition("=")[0]: p for p in pairs}.values())  # a later KEY= replaces an earlier one
    seen: dict[str, int] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch_gpu, args=(seen, stop), daemon=True)
    federation = LocalFederation(args.out / "federation")
    t0 = time.perf_counter()
    status = "not started"
    try:
        federation.start_superlink()
        for i in range(args.nodes):
            federation.start_supernode(f"supernode-{i}", f"partition-id={i} num-partitions={args.nodes}")
        wait_for(lambda: sum(n["status"] == "online" for n in
                             federation.flwr("supernode", "list", "local-deployment")["nodes"]) >= args.nodes,
                 120, "the SuperNodes online", interval=1.0)
        watcher.start()
        run_id = federation.submit(ROOT, config)
        status = federation.wait_finished(run_id, args.timeout)
    finally:
        stop.set()
        federation.close()
    seconds = time.perf_counter() - t0
    print(f"run config: {config}")
    print(f"status: {status} after {seconds:.1f} s (SuperLink start to finish)")
    print(f"GPU processes seen (pid: peak MiB): {seen}")
    print(f"processes left running: {federation.left_running()}")
    results_file = run_dir / "results.json"
    if not results_file.exists():
        print(federation.tails(), file=sys.stderr)
        return 1
    results = json.loads(results_file.read_text())
    for record in results["rounds"]:
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()
                 if not isinstance(v, (list, dict))}
        print(json.dumps(shown))
    (args.out / "summary.json").write_text(json.dumps({"status": status, "seconds": seconds, "gpu_processes": seen,
                                                       "run_config": config, "rounds": results["rounds"]},
                                                      indent=1, default=str))
    return 0 if status == "finished:completed" and seen else 1


if __name__ == "__main__":
    sys.exit(main())
