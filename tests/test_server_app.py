"""The ServerApp's own entry point: a run config that cannot run is refused before round 1 with one
log line per problem, no traceback and nothing in ``out-dir`` removed or overwritten; the
learned-refinement keys reach ``learned_refine``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict
from flwr.common.logger import FLOWER_LOGGER

from fedbasin.config import RunConfigError, resolve_run_config, task_from_config
from fedbasin.server import server_app
from tests.test_strategy import serverapp_identity  # noqa: F401  (autouse: a run identity)


@pytest.fixture
def server_log():
    """Every record the ServerApp logs (Flower's logger does not propagate to pytest's caplog)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    FLOWER_LOGGER.addHandler(handler)
    yield records
    FLOWER_LOGGER.removeHandler(handler)


def earlier_run(out: Path) -> dict:
    """An out-dir holding an earlier run's outputs (which a fresh run with overwrite=true would
    remove) and a file of the user's; returns its fingerprint."""
    (out / "round-0000").mkdir(parents=True)
    (out / "round-0000" / "model.safetensors").write_bytes(b"weights")
    (out / "results.json").write_text(json.dumps({"rounds": []}))
    (out / "curves.png").write_bytes(b"png")
    (out / "notes.txt").write_text("mine")
    return fingerprint(out)


def fingerprint(out: Path) -> dict:
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(out.rglob("*")) if p.is_file()}


def run_main(run_config: dict) -> None:
    """``main`` as Flower calls it; a refused config never reaches the grid."""
    context = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    server_app.main(None, context)


def errors(records) -> list[str]:
    assert not any(r.exc_info for r in records), "a traceback was logged"
    return [r.getMessage() for r in records if r.levelno >= logging.ERROR]


def test_bad_keys_end_the_run_before_round_1_with_one_line_each(tmp_path, server_log):
    out = tmp_path / "run"
    before = earlier_run(out)
    bad = {"lr": -1.0, "symmetry": "rotation", "num-server-rounds": "3", "refine-lambda": "0.7,0.2",
           "refine-start": "worst"}
    run_main({"out-dir": str(out), "overwrite": True, **bad})  # returns: no exception, no traceback
    lines = errors(server_log)
    assert len(lines) == len(bad) + 1, lines
    named = {line.removeprefix("run-config ").split("=")[0]: line for line in lines[:-1]}
    assert sorted(named) == sorted(bad) and not any("\n" in line for line in lines)
    assert named["symmetry"].endswith("expected one of ('orthogonal', 'permutation')")
    assert named["refine-start"].endswith(
        "expected one of ('symmetry', 'permutation', 'orthogonal', 'best', 'activations', 'auto')")
    assert named["num-server-rounds"].endswith("has type str; expected int")
    assert named["lr"].endswith("must be at least 0")
    assert "must be 'LO,HI' with 0 <= LO <= HI <= 1" in named["refine-lambda"]
    assert lines[-1].startswith("run config refused (5 problems above): the run ends before round 1")
    assert fingerprint(out) == before  # overwrite=true, yet nothing stored was removed or rewritten


@pytest.mark.parametrize("config, message", [
    ({"data": "text:/nonexistent/corpus.txt", "overwrite": True}, "/nonexistent/corpus.txt"),
    ({}, "is not empty (curves.png, notes.txt, results.json, round-0000); a fresh run never replaces"),
    ({"resume": True, "refine-steps": 5, "proxy-size": 50, "model.position": "rope"},
     "model.position='rope' does not apply to vit"),
], ids=["missing-data", "non-empty-out-dir", "model-key"])
def test_data_model_and_out_dir_refusals_are_one_line_too(tmp_path, server_log, config, message):
    """What fedbasin simulate checks before it starts (data, model, out-dir) is refused the same way
    by the ServerApp itself under a bare ``flwr run``: one line, then the closing line."""
    out = tmp_path / "run"
    before = earlier_run(out)
    run_main({"out-dir": str(out), "max-train-examples": 100, **config})
    lines = errors(server_log)
    assert len(lines) == 2 and message in lines[0] and "\n" not in lines[0], lines
    assert lines[1].startswith("run config refused (1 problem above)")
    assert fingerprint(out) == before


def test_run_server_raises_the_refusal_for_python_callers(tmp_path):
    with pytest.raises(RunConfigError, match="out-dir .* is not a directory") as refused:
        (tmp_path / "file").write_text("x")
        server_app.run_server(None, resolve_run_config({"out-dir": str(tmp_path / "file")}))
    assert len(refused.value.problems) == 1 and (tmp_path / "file").read_text() == "x"


def test_every_bad_key_is_reported_with_what_is_allowed():
    with pytest.raises(RunConfigError) as refused:
        resolve_run_config({"refine-schedule": "linear", "refine-permutations": "gumbel", "refine-lambda": "half",
                            "refine-steps": 5, "proxy-size": 4, "alignment": False, "epochs": 3})
    problems = refused.value.problems
    assert problems == [
        "unknown run-config key 'epochs' (did you mean 'local-epochs'?); known: "
        + str(sorted(resolve_run_config())),
        "run-config refine-permutations='gumbel'; expected one of ('ste', 'sinkhorn', 'fixed', 'auto')",
        "run-config refine-schedule='linear'; expected one of ('constant', 'cosine', 'auto')",
        "run-config refine-lambda='half' must be 'LO,HI' with 0 <= LO <= HI <= 1 (two models train at "
        "λ ~ U(LO, HI) on their path), e.g. '0.4,0.6'",
        "run-config proxy-size=4 is too small: the server's proxy split needs at least 10 examples (0 holds none back)",
        "run-config refine-steps=5 refines the alignment: it needs alignment=true",
    ]
    assert str(refused.value) == "\n".join(problems)
    for text in ("0.5", "0.2,0.3,0.4", "-0.1,0.5", "0.6,nan"):
        with pytest.raises(RunConfigError, match="refine-lambda"):
            resolve_run_config({"refine-lambda": text})
    assert resolve_run_config({"refine-lambda": " 0.1 , 0.9"})["refine-lambda"] == " 0.1 , 0.9"
    # auto refinement and distillation would spend their budgets on a proxy split of two or three examples
    with pytest.raises(RunConfigError, match=r"proxy-size=5 is too small") as refused:
        resolve_run_config({"proxy-size": 5})
    assert len(refused.value.problems) == 1
    assert resolve_run_config({"proxy-size": 10})["proxy-size"] == 10


@pytest.mark.parametrize("overrides, keyword, value", [
    ({}, "mode", "orthogonal"),
    ({"symmetry": "permutation"}, "mode", "permutation"),
    ({"refine-start": "best"}, "mode", "best"),
    ({"refine-start": "permutation"}, "mode", "permutation"),
    ({}, "lambda_range", (0.2, 0.8)),  # an image classifier's auto range
    ({"refine-lambda": "0.1,0.9"}, "lambda_range", (0.1, 0.9)),
    ({}, "schedule", "cosine"),  # an image classifier's auto schedule
    ({"refine-schedule": "constant"}, "schedule", "constant"),
    ({"refine-permutations": "fixed"}, "permutations", "fixed"),
    ({"refine-permutations": "sinkhorn"}, "permutations", "sinkhorn"),
    ({"refine-group": "invertible"}, "group", "invertible"),
    ({"universe-iterations": 3}, "universe_iterations", 3),
    ({"refine-lr": 0.05}, "lr", 0.05),
])
def test_refine_keys_reach_learned_refine(monkeypatch, overrides, keyword, value):
    """The refiner the ServerApp builds calls learned_refine with each key's value (spied on a real,
    2-step refinement of two trained digits ViTs, so that learned_refine also accepts them)."""
    from fedbasin.alignment import learned_refine
    from fedbasin.models import build_model
    from tests.helpers import DIGITS_VIT, expanded, trained_digits_vit
    from tests.test_alignment import spec_of

    seen = {}

    def spy(*args, **kwargs):
        seen.update(expanded(kwargs))
        return learned_refine(*args, **kwargs)

    monkeypatch.setattr(server_app, "learned_refine", spy)
    config = resolve_run_config({"refine-steps": 2, "proxy-size": 40, **overrides})
    refine = server_app.make_refiner(spec_of("vit", DIGITS_VIT), build_model("vit", DIGITS_VIT),
                                     task_from_config(config), config)
    a, b, c = (trained_digits_vit(seed) for seed in (1, 2, 3))
    result = refine(a, [b, c], include_reference=False)
    assert seen[keyword] == value and seen["steps"] == 2
    assert result.start_mode in (("permutation", "orthogonal") if value == "best" else (seen["mode"],))


@pytest.mark.slow
def test_a_bare_flwr_run_with_bad_keys_logs_one_line_each_and_touches_nothing(tmp_path):
    """End to end: ``flwr run . --run-config`` on a local SuperLink (fedbasin simulate's checks
    bypassed): the ServerApp's lines reach the user, no traceback, the earlier outputs survive."""
    from fedbasin.simulate import LocalSuperLink, _stream, project_dir

    out = tmp_path / "run"
    before = earlier_run(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    (tmp_path / "home").mkdir()
    link = LocalSuperLink(tmp_path / "home", env)
    try:
        _, output = _stream(link, ["run", str(project_dir()), "fedbasin", "--stream", "--run-config",
                                   f"lr=-1.0 symmetry='rotation' overwrite=true out-dir='{out}'",
                                   "--federation-config", "num-supernodes=2"], tmp_path / "flwr.log")
    finally:
        link.stop()
    assert "run-config symmetry='rotation'; expected one of ('orthogonal', 'permutation')" in output
    assert "run-config lr=-1.0 must be at least 0" in output
    assert "run config refused (2 problems above): the run ends before round 1" in output
    assert "Traceback" not in output and "round 1" not in output.replace("before round 1", "")
    assert fingerprint(out) == before


def test_simulate_prints_one_line_per_bad_key(tmp_path, capsys):
    from tests.test_simulation import cli

    assert cli("--run-config", "lr=-1.0 refine-schedule='linear'", "--out", str(tmp_path / "run")) == 2
    assert capsys.readouterr().err.splitlines() == [
        "fedbasin simulate: run-config refine-schedule='linear'; expected one of ('constant', 'cosine', 'auto')",
        "fedbasin simulate: run-config lr=-1.0 must be at least 0",
    ]
    assert not (tmp_path / "run").exists()
