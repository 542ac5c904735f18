"""Server memory of ``AlignedFedAvg.aggregate_train`` with K client replies of a model of size S.

    python -m fedbasin.benchmarks.bench_server_memory [--clients 2 4 8] [--iterations 2]
        [--universe P] [--aggregator mean|trimmed-mean|median] [--distill-steps N [--distill-weights]] [--trace]
        [--shape small|gpt2-small]

Model: a fedbasin GPT, GPT-2-like in shape but smaller (width 384, 6 layers, 6 heads, MLP 1536,
vocabulary 8192, 256 positions, untied, float32: 17.0 M parameters, S = 65 MiB), or with
``--shape gpt2-small`` GPT-2-small's shape (width 768, 12 layers, 12 heads, MLP 3072, vocabulary
50257, 1024 positions, untied: 163 M parameters, S = 622 MiB). Each K runs
in a fresh process: it builds the broadcast ``ArrayRecord`` (the initialisation, seed 0, plus
Gaussian noise of std 0.01, seed 0, so that its norm gains are not 1, as after training) and K
reply messages (the broadcast weights plus independent Gaussian noise, std 0.01, seed k;
serialised as Flower sends them),
frees everything else, then measures one ``aggregate_train`` call of the default strategy
(orthogonal alignment, ``--iterations`` weight-matching iterations, mean aggregator, outlier
screening on) with ``consume_replies`` on, as inside ``AlignedFedAvg.start`` (each reply's bytes
are released once aligned; ``--keep-replies`` measures a direct call that leaves the messages
intact). The peak is the kernel's high-water mark (``VmHWM``), reset just before the call
through ``/proc/self/clear_refs``; where that is not allowed, ``ru_maxrss`` (the whole life of
the process, an upper bound) is reported instead and flagged.

Reported per K, in units of S: ``held`` — RSS before the call above the process's baseline
(interpreter, imports and a warm-up alignment of a tiny model, measured before any model
exists): the K replies and the broadcast model that the server holds anyway; ``peak`` — peak
RSS during the call above the baseline; ``target`` — K + 3 (issue 9). The warm-up loads what
a running server has loaded after its first round (BLAS/LAPACK buffers and library pages,
about 30 MiB, independent of the model); ``warmup_mib`` is that growth, so the peak above the
cold process is ``peak + warmup_mib / S``. ``--universe``, ``--aggregator`` and ``--distill-steps``
set the strategy's ``universe_iterations``, ``aggregator`` and ``distill`` (:func:`_distiller`: teachers
cached as outputs before the merge, as the ServerApp's, or with ``--distill-weights`` kept as weights);
``--trace`` also prints the RSS at entry, peak and exit of every alignment, canonicalisation,
screening, aggregation, teacher-output caching (``prepare``) and distillation call (:class:`PhaseTrace`). Prints one JSON line per K
and a Markdown table. The children fix glibc's mmap threshold at 64 KiB first, as the
ServerApp does (``fedbasin.heap``: freed model-sized blocks go back to the kernel at once);
``--dynamic-mmap`` measures glibc's default.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import resource
import subprocess
import sys
import time

from fedbasin import heap

SHAPES = {"small": {"vocab_size": 8192, "block_size": 256, "dim": 384, "depth": 6, "heads": 6, "mlp_dim": 1536},
          "gpt2-small": {"vocab_size": 50257, "block_size": 1024, "dim": 768, "depth": 12, "heads": 12,
                         "mlp_dim": 3072}}


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux ≥ 4.0); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _release() -> None:
    """Collect garbage and hand freed heap pages back to the kernel (glibc ``malloc_trim``), so
    that RSS counts live data only."""
    gc.collect()
    heap.trim()


class PhaseTrace:
    """Peak RSS per phase: wraps functions so that each call records the RSS at entry and exit
    and the high-water mark while it ran (nested calls included), in units of ``size`` above
    ``baseline``. Every entry and exit reads and resets ``VmHWM``, so the overall peak is the
    largest value seen by any mark (:attr:`peak`)."""

    def __init__(self, baseline: int, size: int):
        self.baseline, self.size, self.open, self.rows, self.peak = baseline, size, [], [], 0

    def _mark(self) -> int:
        hwm = _status("VmHWM")
        self.peak = max(self.peak, hwm)
        for frame in self.open:
            frame["max"] = max(frame["max"], hwm)
        _reset_peak()
        return _status("VmRSS")

    def _units(self, nbytes: int) -> float:
        return round((nbytes - self.baseline) / self.size, 2)

    def wrap(self, name: str, function):
        @functools.wraps(function)  # keeps the function's attributes (e.g. a distiller's prepare)
        def traced(*args, **kwargs):
            row = {"phase": name, "depth": len(self.open)}
            self.rows.append(row)  # in call order
            frame = {"max": 0, "in": self._mark()}
            self.open.append(frame)
            try:
                return function(*args, **kwargs)
            finally:
                out = self._mark()
                self.open.pop()  # calls nest: the last one opened
                row.update(rss_in=self._units(frame["in"]), peak=self._units(frame["max"]), rss_out=self._units(out))
        return traced

    def patch(self, module, name: str, label: str | None = None) -> None:
        setattr(module, name, self.wrap(label or name, getattr(module, name)))


def _warm_up(shape: dict, distill: bool = False) -> None:
    """Align and average two tiny models once (with ``distill``, also distil one into the other
    for two steps): loads the linear-algebra libraries' buffers and code pages (and torch.optim's
    and autograd's, about 70 MiB) that any such server holds after its first round (not part
    of a round's cost)."""
    import torch

    from fedbasin.alignment import fedbasin_adapter, merge
    from fedbasin.models import build_model
    from fedbasin.server.distill import ensemble_distill

    tiny = {"vocab_size": 64, "block_size": 8, "dim": 32, "depth": 2, "heads": 2, "mlp_dim": 1536}
    models = [build_model("gpt", tiny, seed=seed) for seed in (0, 1)]
    states = [{k: v.detach() for k, v in m.state_dict().items()} for m in models]
    merge(fedbasin_adapter("gpt", models[0].config).spec, states, iterations=1)
    torch.linalg.svd(torch.randn(shape["dim"], shape["dim"], dtype=torch.float64))
    if distill:
        tokens = torch.randint(0, tiny["vocab_size"], (2, 2, tiny["block_size"] + 1),
                               generator=torch.Generator().manual_seed(0))
        batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
        ensemble_distill(models[0], states[0], states[1:], _token_loss, iter(batches), batches, steps=2,
                         eval_every=1)


def _token_loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _distiller(shape: dict, steps: int, cache: bool = True):
    """``distill(merged, clients)`` as the ServerApp builds it (:func:`ensemble_distill`), on
    random-token proxy batches (4 × 64 tokens or the context length, seed 0; two training batches, one selection
    batch). As in the ServerApp, the architecture module has released its weights
    (:func:`~fedbasin.weights.release_weights`) and holds the states it runs for the call
    only; the merge is the student, trained in place."""
    import itertools

    import torch

    from fedbasin.models import build_model
    from fedbasin.server.distill import cache_teacher_outputs, ensemble_distill
    from fedbasin.weights import holding_weights, release_weights

    model = release_weights(build_model("gpt", shape, seed=0))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape["vocab_size"], (3, 4, min(64, shape["block_size"]) + 1), generator=g)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]

    def distill(merged: dict, clients: list):
        with holding_weights(model, merged) as student:
            return ensemble_distill(model, student, clients, _token_loss, itertools.cycle(batches[:2]), batches[2:],
                                    steps=steps, eval_every=steps, in_place=True)

    def prepare(clients: list[dict]):  # as the ServerApp's: the clients' outputs, their weights go in the merge
        with holding_weights(model, clients[0]):
            return cache_teacher_outputs(model, clients, itertools.cycle(batches[:2]), steps)

    if cache:
        distill.prepare = prepare
    return distill


def measure(clients: int, iterations: int, consume: bool = True, fixed_mmap: bool = True,
            universe: int = 1, aggregator: str = "mean", trace: bool = False, distill_steps: int = 0,
            distill_weights: bool = False, shape: str = "small") -> dict:
    """One ``aggregate_train`` with ``clients`` replies, in this process (see the module docstring);
    ``fixed_mmap``: glibc's mmap threshold fixed first, as the ServerApp does (``heap.fix_mmap_threshold``)."""
    fixed_mmap = fixed_mmap and heap.fix_mmap_threshold()
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedbasin.alignment import fedbasin_adapter
    from fedbasin.models import build_model
    from fedbasin.strategies import AlignedFedAvg

    _release()
    cold = _status("VmRSS")
    _warm_up(SHAPES[shape], distill=distill_steps > 0)
    _release()
    baseline = _status("VmRSS")
    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):
        setattr(TaskIdentity, name, value)  # what a ServerApp process sets before sending
    model = build_model("gpt", SHAPES[shape], seed=0)
    spec = fedbasin_adapter("gpt", model.config).spec
    g = torch.Generator().manual_seed(0)
    state = {k: v.detach() + 0.01 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    size = sum(v.numel() * v.element_size() for v in state.values())
    broadcast = ArrayRecord(state)
    nodes = list(range(1, clients + 1))
    replies = []
    for node in nodes:
        g = torch.Generator().manual_seed(node)
        arrays = ArrayRecord({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()})
        instruction = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=node,
                              message_type=MessageType.TRAIN)
        metrics = MetricRecord({"train_loss": 1.0, "num-examples": 100})
        replies.append(Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=instruction))
        del arrays
    del model, state

    class Grid:
        def get_node_ids(self):
            return nodes

    distill = _distiller(SHAPES[shape], distill_steps, cache=not distill_weights) if distill_steps else None
    # the replies are the broadcast plus noise, i.e. in its basis: align them anyway (the cost measured)
    strategy = AlignedFedAvg(spec, iterations=iterations, min_train_nodes=clients,
                             min_available_nodes=clients, universe_iterations=universe, aggregator=aggregator,
                             distill=distill, already_aligned="align")
    list(strategy.configure_train(1, broadcast, ConfigRecord(), Grid()))
    strategy.consume_replies = consume  # what ``start`` does: Flower drops the replies afterwards
    _release()
    held = _status("VmRSS")
    exact = _reset_peak()
    phases = None
    if trace and exact:  # per-phase peaks (their maximum is the call's peak)
        import importlib

        from fedbasin.strategies import aligned_fedavg

        merge_module = importlib.import_module("fedbasin.alignment.merge")  # the package exports merge()

        phases = PhaseTrace(baseline, size)
        for name in ("weight_match", "canonicalize", "to_gauge"):
            phases.patch(merge_module, name)
        for name in ("merge", "cohort_outliers", "aggregate"):
            phases.patch(aligned_fedavg, name)
        if strategy.distill is not None:
            strategy.distill = phases.wrap("distill", strategy.distill)
            if hasattr(strategy.distill, "prepare"):
                strategy.distill.prepare = phases.wrap("prepare", strategy.distill.prepare)
    started, cpu_started = time.perf_counter(), time.process_time()
    merged, metrics = strategy.aggregate_train(1, replies)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    peak = _status("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if phases is not None:
        phases._mark()
        peak = phases.peak
    if merged is None or metrics["num_excluded"]:
        raise RuntimeError(f"the benchmark round did not aggregate every reply: {dict(metrics)}")
    return {
        "clients": clients, "params": size // 4, "model_bytes": size, "baseline_bytes": baseline,
        "held": round((held - baseline) / size, 2), "peak": round((peak - baseline) / size, 2),
        "target": clients + 3, "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1),
        "warmup_mib": round((baseline - cold) / 2**20, 1), "peak_is_exact": exact,
        "consume_replies": consume, "mmap_threshold_fixed": fixed_mmap, "universe_iterations": universe,
        "universe_passes": metrics["universe_passes"], "aggregator": aggregator, "distill_steps": distill_steps,
        "distill_teachers": "weights" if distill_weights else "cached outputs",
        **({"phases": phases.rows} if phases is not None else {}),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 4, 8], metavar="K")
    parser.add_argument("--iterations", type=int, default=2, help="weight-matching iterations")
    parser.add_argument("--keep-replies", action="store_true",
                        help="leave the reply messages intact (a direct aggregate_train call)")
    parser.add_argument("--dynamic-mmap", action="store_true",
                        help="keep glibc's dynamic mmap threshold (the ServerApp fixes it: fedbasin.heap)")
    parser.add_argument("--universe", type=int, default=1, metavar="P",
                        help="universe-matching passes (universe_iterations)")
    parser.add_argument("--aggregator", default="mean", help="mean, trimmed-mean or median")
    parser.add_argument("--distill-steps", type=int, default=0, metavar="N",
                        help="ensemble distillation of the clients into the merge, N steps on random tokens")
    parser.add_argument("--distill-weights", action="store_true",
                        help="distil from the clients' weights kept through the merge (no cached outputs)")
    parser.add_argument("--trace", action="store_true",
                        help="also print the peak RSS of every phase (alignment, screening, aggregation)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small",
                        help="the model: 'small' (17.0 M parameters, the default) or 'gpt2-small' (GPT-2-small's "
                        "shape untied, 163 M)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(args.child, args.iterations, consume=not args.keep_replies,
                                 fixed_mmap=not args.dynamic_mmap, universe=args.universe,
                                 aggregator=args.aggregator, trace=args.trace,
                                 distill_steps=args.distill_steps, distill_weights=args.distill_weights,
                                 shape=args.shape)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    rows = []
    for k in args.clients:
        done = subprocess.run([sys.executable, "-m", "fedbasin.benchmarks.bench_server_memory",
                               "--child", str(k), "--iterations", str(args.iterations),
                               "--universe", str(args.universe), "--aggregator", args.aggregator, "--shape", args.shape,
                               *(["--trace"] if args.trace else []), "--distill-steps", str(args.distill_steps),
                               *(["--keep-replies"] if args.keep_replies else []),
                               *(["--distill-weights"] if args.distill_weights else []),
                               *(["--dynamic-mmap"] if args.dynamic_mmap else [])],
                              env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        for phase in rows[-1].pop("phases", []):
            print(f"  {'  ' * phase['depth']}{phase['phase']}: in {phase['rss_in']}, peak {phase['peak']}, "
                  f"out {phase['rss_out']}", flush=True)
        print(json.dumps(rows[-1]), flush=True)
    r = rows[0]
    print(f"\nS = {r['model_bytes'] / 2**20:.0f} MiB ({r['params'] / 1e6:.1f} M float32 parameters); "
          f"baseline RSS {r['baseline_bytes'] / 2**20:.0f} MiB\n")
    print("| K | held before (× S) | peak during aggregate_train (× S) | target K + 3 | wall s | CPU s | warm-up MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        flag = "" if r["peak_is_exact"] else " (ru_maxrss)"
        print(f"| {r['clients']} | {r['held']} | {r['peak']}{flag} | {r['target']} | {r['seconds']} | "
              f"{r['cpu_seconds']} | {r['warmup_mib']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
