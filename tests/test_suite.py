"""The suite driver (fedbasin.benchmarks.suite): member selection and input errors, the group
aggregation (mean ± spread) and table, row caching and resume, and the measurement of a real
command line child (its JSON, wall time and own peak memory)."""

from __future__ import annotations

import json
import statistics
import subprocess

import pytest
import torch

from fedbasin.benchmarks import suite
from tests.test_tokenizer_data import NEEDS_SHARED_TEXT


def _vit(path, seed: int):
    """A tiny untrained digits ViT checkpoint."""
    from fedbasin.checkpoint import save_checkpoint
    from fedbasin.models import build_model, make_config

    config = make_config("vit", {"dim": 16, "depth": 1, "heads": 2, "mlp_dim": 32, "image_size": 8, "patch_size": 2,
                                 "channels": 1, "num_classes": 10})
    save_checkpoint(path, "vit", config, build_model("vit", config, seed=seed).state_dict())
    return path


def _row(member: str, group: str, vanilla: float, free: float, learned: float | None = None,
         mid: float | None = None, seconds: float = 1.0) -> dict:
    row = {"member": member, "group": group, "loss": [1.0, 1.1], "accuracy": [0.5, 0.6],
           "barrier": {"vanilla": vanilla, "free": free}, "midpoint_accuracy": {},
           "commands": {"free": {"seconds": seconds, "peak_rss_mib": 100.0}}}
    if learned is not None:
        row["barrier"]["learned"] = learned
        row["commands"]["learned"] = {"seconds": 10 * seconds, "peak_rss_mib": 200.0}
    if mid is not None:
        row["midpoint_accuracy"] = {"vanilla": mid / 2, "free": mid}
    return row


# ---------------------------------------------------------------------------------------------- aggregation


def test_mean_spread_is_the_mean_and_sample_standard_deviation():
    assert suite.mean_spread([1.0, 2.0, 4.0]) == pytest.approx((7 / 3, statistics.stdev([1.0, 2.0, 4.0])))
    assert suite.mean_spread([0.2, 0.4])[1] == pytest.approx(0.1414213, rel=1e-5)
    assert suite.mean_spread([3.0]) == (3.0, None)
    with pytest.raises(ValueError):
        suite.mean_spread([])


def test_groups_aggregate_their_own_members_only():
    rows = [_row("digits-s01", "image", 4.0, 2.0, 0.2, mid=0.5), _row("cifar", "image", 0.4, 0.3, 0.1, mid=0.3),
            _row("gpt2-s01", "text", 1.0, 0.6, seconds=5.0), _row("digits-u012", "universe", 1.5, 0.5, 0.1)]
    groups = suite.summarize(rows)
    assert list(groups) == ["text", "image", "universe"]
    assert groups["image"]["members"] == ["digits-s01", "cifar"]
    assert groups["image"]["barrier/vanilla"] == pytest.approx((2.2, statistics.stdev([4.0, 0.4])))
    assert groups["image"]["barrier/learned"] == pytest.approx((0.15, statistics.stdev([0.2, 0.1])))
    assert groups["image"]["midpoint_accuracy/free"] == pytest.approx((0.4, statistics.stdev([0.5, 0.3])))
    assert groups["text"]["barrier/free"] == (0.6, None)
    assert "barrier/learned" not in groups["text"]  # a member without learned adds nothing there
    assert groups["text"]["seconds/free"] == (5.0, None)
    table = suite.table(rows)
    image = next(line for line in table.splitlines() if line.startswith("| image |"))
    assert f"| 2.200 ± {statistics.stdev([4.0, 0.4]):.3f} |" in image and "| 2 |" in image
    text = next(line for line in table.splitlines() if line.startswith("| GPT-style text |"))
    assert "0.600 (n=1)" in text and "| — |" in text
    member = next(line for line in table.splitlines() if line.startswith("| gpt2-s01 |"))
    assert member.count("|") == 11 and "| 1.000 | 0.600 | — |" in member


# ---------------------------------------------------------------------------------------------- selection, input


def test_member_selection_keeps_order_and_refuses_unknown_names():
    assert [m.name for m in suite.select_members(None)] == list(suite.MEMBERS)
    assert [m.name for m in suite.select_members(["digits-u012", "digits-s01", "digits-u012"])] == [
        "digits-u012", "digits-s01"]
    with pytest.raises(ValueError, match="unknown member 'digits'"):
        suite.select_members(["digits"])


@pytest.mark.parametrize("argv, message", [
    (["--members", "nope"], "unknown member 'nope'"),
    (["--members", "cifar10-w64-s01", "--cifar", "{tmp}/none"], "no train.parquet"),
    (["--members", "gpt2-s01", "--text", "{tmp}/none.txt"], "--text"),
    (["--members", "digits-s01", "--pair-dir", "digits-s01={tmp}"], "holds no trained model"),
    (["--pair-dir", "digits-u012={tmp}"], "is not a pair member"),
    (["--members", "digits-s01", "--eval-examples", "digits=x"], "--eval-examples"),
    (["--members", "digits-s01", "--glmc-path", "{tmp}/none"], "--glmc-path"),
    (["--members", "digits-s01", "--variant", "x=--refine-nonsense 3"], "--variant x: unrecognized arguments"),
    (["--members", "digits-s01", "--variant", "x=--refine-lr -1"], "--variant x: argument --refine-lr"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_work(tmp_path, capsys, monkeypatch, argv, message):
    def no_work(*args, **kwargs):
        raise AssertionError("work started")

    monkeypatch.setattr(suite, "train_member", no_work)
    cache = tmp_path / "cache"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--cache", str(cache)]
    assert suite.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not cache.exists()



def test_variants_are_parsed_once_each_and_shown_beside_the_default():
    assert suite.parse_variants(["b64=--refine-batch-size 64", "d=--refine-dual --refine-lambda '0.2,0.6'"]) == {
        "b64": ["--refine-batch-size", "64"], "d": ["--refine-dual", "--refine-lambda", "0.2,0.6"]}
    for bad, message in (("b64", "expected NAME=OPTIONS"), ("a b=--x", "expected NAME=OPTIONS"),
                         ("default=--x", "is taken"), ("q=--x 'open", "quotation")):
        with pytest.raises(ValueError, match=message):
            suite.parse_variants([bad])
    with pytest.raises(ValueError, match="'v' is taken"):
        suite.parse_variants(["v=--a", "v=--b"])
    row = _row("gpt2-s01", "text", 1.0, 0.06, 0.0155)
    row["refinement"] = {"steps": 1627}
    row["barrier"]["learned:b64"] = 0.0094
    row["commands"]["learned:b64"] = {"seconds": 139.2, "peak_rss_mib": 2218.9}
    row["variants"] = {"b64": {"options": ["--refine-batch-size", "64"], "refinement": {"steps": 970}}}
    lines = suite.table([row]).splitlines()
    assert "| gpt2-s01 | default | (none) | 0.0155 | 1627 | 10.0 |" in lines
    assert "| gpt2-s01 | b64 | --refine-batch-size 64 | 0.0094 | 970 | 139.2 |" in lines
    assert "| member | learned | options |" in suite.table([row])
    assert "| options |" not in suite.table([_row("gpt2-s01", "text", 1.0, 0.06, 0.0155)])  # no variants: no table

# ---------------------------------------------------------------------------------------------- caching, resume


@pytest.fixture
def fake_work(monkeypatch, tmp_path):
    """Training and measuring replaced by fakes that count their calls (``fail`` names a member that fails)."""
    calls = {"train": [], "row": [], "fail": None, "version": "v1"}

    def train_member(member, args):
        calls["train"].append(member.name)
        return suite.model_dirs(member, args)

    def build(member, paths, args, work):
        if member.name == calls["fail"]:
            raise suite.SuiteError("boom")
        calls["row"].append(member.name)
        barrier = {"vanilla": 1.0, "free": 0.5}
        if not args.skip_learned:
            barrier["learned"] = 0.1
        return {"member": member.name, "group": member.group, "loss": [1.0] * len(paths),
                "accuracy": [0.9] * len(paths), "barrier": barrier, "commands": {}, "midpoint_accuracy": {}}

    monkeypatch.setattr(suite, "train_member", train_member)
    monkeypatch.setattr(suite, "pair_row", build)
    monkeypatch.setattr(suite, "universe_row", build)
    monkeypatch.setattr(suite, "code_version", lambda: calls["version"])
    calls["argv"] = ["--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "rows.json")]
    return calls


def test_rows_are_saved_per_member_and_a_rerun_resumes(fake_work, tmp_path, capsys):
    members = ["--members", "digits-s01", "digits-u012"]
    fake_work["fail"] = "digits-u012"
    assert suite.main([*members, *fake_work["argv"]]) == 1
    assert "digits-u012: boom" in capsys.readouterr().err
    stored = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert list(stored) == ["digits-s01"] and stored["digits-s01"]["key"]["code"] == "v1"

    fake_work["fail"], fake_work["row"] = None, []
    assert suite.main([*members, *fake_work["argv"]]) == 0
    assert fake_work["row"] == ["digits-u012"]  # the finished member was reused, not measured again
    out = capsys.readouterr().out
    assert "| digits-s01 |" in out and "| digits-u012 |" in out and "| universe (3 models) | 1 |" in out

    fake_work["row"] = []
    assert suite.main([*members, *fake_work["argv"]]) == 0
    assert fake_work["row"] == []
    assert suite.main([*members, *fake_work["argv"], "--rerun"]) == 0
    assert fake_work["row"] == ["digits-s01", "digits-u012"]


def test_rows_are_remeasured_when_the_code_or_the_evaluation_changes(fake_work):
    argv = ["--members", "digits-s01", *fake_work["argv"]]
    assert suite.main(argv) == 0 and fake_work["row"] == ["digits-s01"]
    fake_work["version"] = "v2"
    assert suite.main(argv) == 0 and fake_work["row"] == ["digits-s01"] * 2
    assert suite.main([*argv, "--eval-examples", "digits=100"]) == 0 and len(fake_work["row"]) == 3
    assert suite.main([*argv, "--eval-examples", "digits=100"]) == 0 and len(fake_work["row"]) == 3
    variant = ["--variant", "b64=--refine-batch-size 64"]
    assert suite.main([*argv, "--eval-examples", "digits=100", *variant]) == 0 and len(fake_work["row"]) == 4
    assert suite.main([*argv, "--eval-examples", "digits=100", *variant]) == 0 and len(fake_work["row"]) == 4


def test_a_row_without_learned_serves_only_skip_learned_runs(fake_work):
    argv = ["--members", "digits-s01", *fake_work["argv"]]
    assert suite.main([*argv, "--skip-learned"]) == 0
    assert suite.main([*argv, "--skip-learned"]) == 0 and len(fake_work["row"]) == 1
    assert suite.main(argv) == 0 and len(fake_work["row"]) == 2  # learned wanted: measured again
    assert suite.main([*argv, "--skip-learned"]) == 0 and len(fake_work["row"]) == 2  # a fuller row serves too


@NEEDS_SHARED_TEXT  # the text member's data must exist
def test_train_only_measures_nothing(fake_work, tmp_path):
    assert suite.main(["--members", "digits-s01", "gpt2-s23", "--train-only", *fake_work["argv"]]) == 0
    assert fake_work["train"] == ["digits-s01", "gpt2-s23"] and fake_work["row"] == []
    assert not (tmp_path / "rows.json").exists()


def test_pair_dirs_point_members_at_models_trained_elsewhere(tmp_path):
    _vit(tmp_path / "pair" / "seed0", 0)
    _vit(tmp_path / "pair" / "seed1", 1)
    args = suite.build_parser().parse_args(["--gpt2-pair", str(tmp_path / "pair"), "--cache", str(tmp_path / "c")])
    args.pair_dirs = suite.parse_pair_dirs([f"gpt2-s01={args.gpt2_pair}"])
    assert suite.model_dirs(suite.MEMBERS["gpt2-s01"], args) == [tmp_path / "pair" / "seed0", tmp_path / "pair" / "seed1"]
    assert suite.model_dirs(suite.MEMBERS["gpt2-s23"], args) == [tmp_path / "c" / "gpt2" / "seed2",
                                                                 tmp_path / "c" / "gpt2" / "seed3"]
    # the universe member shares the digits pair's models: one training serves both
    assert suite.model_dirs(suite.MEMBERS["digits-u012"], args)[:2] == suite.model_dirs(suite.MEMBERS["digits-s01"], args)


# ---------------------------------------------------------------------------------------------- the real CLI


def test_run_cli_returns_the_commands_json_its_time_and_its_own_peak_memory(tmp_path):
    a = _vit(tmp_path / "a", 0)
    held = torch.ones(256 * 2**20)  # 1 GiB in this process: a child's peak must not count it (ru_maxrss would)
    run = suite.run_cli(["eval", a, "--data", "digits", "--max-examples", "50"], tmp_path / "logs" / "eval.log")
    del held
    assert run.summary["command"] == "eval" and run.summary["examples"] == 50
    assert 0 < run.seconds < 60
    assert 50 < run.peak_rss_mib < 900  # torch and the digits loaded in the child, measured there
    with pytest.raises(suite.SuiteError, match="eval failed \\(exit 3\\): .*unknown data source .digitz."):
        suite.run_cli(["eval", a, "--data", "digitz"], tmp_path / "logs" / "bad.log")


def test_midpoint_is_the_barriers_half_way_point(tmp_path):
    from fedbasin.checkpoint import load_checkpoint

    a, b = _vit(tmp_path / "a", 0), _vit(tmp_path / "b", 1)
    mid = load_checkpoint(suite.midpoint(a, b, tmp_path / "mid"))
    sa, sb = load_checkpoint(a).state, load_checkpoint(b).state
    for key, value in mid.state.items():
        torch.testing.assert_close(value, (sa[key] + sb[key]) / 2)


@pytest.mark.slow
def test_end_to_end_on_a_tiny_digits_pair(tmp_path, capsys):
    """One member through the real command line, children side by side (--jobs 2): barriers and midpoint
    accuracies of the data-free endpoint and of two learned ones (a variant of 3 steps, and again with
    refinement seed 1: each its own refinement, its seed recorded)."""
    _vit(tmp_path / "pair" / "seed0", 0)
    _vit(tmp_path / "pair" / "seed1", 1)
    out = tmp_path / "rows.json"
    assert suite.main(["--members", "digits-s01", "--pair-dir", f"digits-s01={tmp_path / 'pair'}", "--cache",
                       str(tmp_path / "cache"), "--out", str(out), "--skip-learned", "--jobs", "2",
                       "--variant", "q=--refine-steps 3 --refine-examples 200", "--refine-seeds", "1"]) == 0
    row = json.loads(out.read_text())["rows"]["digits-s01"]
    assert row["eval_examples"] == 359 and set(row["barrier"]) == {"vanilla", "free", "learned:q", "learned:q@s1"}
    assert [row["refinements"][c]["seed"] for c in ("learned:q", "learned:q@s1")] == [0, 1]
    assert row["refinements"]["learned:q"]["steps"] == 3 and row["key"]["refine_seeds"] == [1]
    assert row["curves"]["learned:q"] != row["curves"]["learned:q@s1"]
    assert len(row["curves"]["free"]) == suite.POINTS
    assert row["barrier"]["vanilla"] == pytest.approx(max(
        loss - (lam * row["loss"][0] + (1 - lam) * row["loss"][1])
        for lam, loss in zip(torch.linspace(0, 1, suite.POINTS).tolist(), row["curves"]["vanilla"])), abs=1e-5)
    assert row["commands"]["free"]["seconds"] > 0 and row["commands"]["free"]["peak_rss_mib"] > 50
    assert set(row["midpoint_accuracy"]) == set(row["barrier"])
    out = capsys.readouterr().out
    assert "| digits-s01 |" in out and "| q (image) | 2 |" in out


def test_a_recipe_of_cli_options_trains_its_seeds_with_fedbasin_train_once(tmp_path, monkeypatch):
    """A member whose recipe names ``fedbasin train`` options (the Hugging Face ViT pair) is trained by that
    command, one independent model per seed, into the cache; a rerun finds them and trains nothing."""
    from fedbasin.checkpoint import load_checkpoint

    recipe = suite.Recipe("image", "digits", train=("--model", "hf-vit", "--dim", "16", "--depth", "1", "--heads",
                                                    "2", "--mlp-dim", "32", "--epochs", "1", "--patch-size", "4"))
    monkeypatch.setitem(suite.RECIPES, "tiny-hf", recipe)
    member = suite.Member("tiny-hf-s01", "image", "tiny-hf", (0, 1))
    args = suite.build_parser().parse_args(["--cache", str(tmp_path / "cache")])
    args.pair_dirs = {}
    paths = suite.train_member(member, args)
    assert paths == [tmp_path / "cache" / "tiny-hf" / f"seed{s}" for s in (0, 1)]
    models = [load_checkpoint(p) for p in paths]
    assert [(m.kind, m.family) for m in models] == [("hf", "vit")] * 2
    assert not torch.equal(*(m.state["vit.embeddings.patch_embeddings.projection.weight"] for m in models))
    stamp = [(p / "model.safetensors").stat().st_mtime_ns for p in paths]
    monkeypatch.setattr(suite.subprocess, "run", lambda *a, **k: pytest.fail("trained a cached model again"))
    assert suite.train_member(member, args) == paths
    assert [(p / "model.safetensors").stat().st_mtime_ns for p in paths] == stamp


def test_a_members_missing_seeds_train_side_by_side_under_jobs(tmp_path, monkeypatch):
    """``--jobs 2``: the two seeds' training commands run at once (each waits at a barrier for the other; run one
    after the other, the first would wait alone and the barrier would break); ``--jobs 1``: in this thread."""
    import threading

    monkeypatch.setitem(suite.RECIPES, "tiny-hf", suite.Recipe("image", "digits", train=("--epochs", "1")))
    member = suite.Member("tiny-hf-s01", "image", "tiny-hf", (0, 1))
    args = suite.build_parser().parse_args(["--cache", str(tmp_path / "cache")])
    args.pair_dirs = {}
    for jobs in (2, 1):
        barrier, seeds, threads = threading.Barrier(jobs, timeout=60), [], set()

        def fake_run(command, **_):
            seeds.append(command[command.index("--seed") + 1])
            threads.add(threading.current_thread())
            barrier.wait()
            return subprocess.CompletedProcess(command, 0)

        monkeypatch.setattr(suite.subprocess, "run", fake_run)
        suite.Slots.set(jobs)
        try:
            suite.train_member(member, args)
        finally:
            suite.Slots.set(1)
        assert sorted(seeds) == ["0", "1"]
        assert (threading.main_thread() in threads) == (jobs == 1)


# ---------------------------------------------------------------------------------------------- seeds, jobs


def test_every_learned_run_is_repeated_per_refinement_seed(monkeypatch):
    class Args:
        skip_learned, variants, refine_seeds = False, {"l28": ["--refine-lambda", "0.2,0.8"]}, [1, 2]

    assert suite.learned_runs(Args) == [
        ("learned", []), ("learned@s1", ["--refine-seed", "1"]), ("learned@s2", ["--refine-seed", "2"]),
        ("learned:l28", ["--refine-lambda", "0.2,0.8"]),
        ("learned:l28@s1", ["--refine-lambda", "0.2,0.8", "--refine-seed", "1"]),
        ("learned:l28@s2", ["--refine-lambda", "0.2,0.8", "--refine-seed", "2"])]
    Args.skip_learned, Args.refine_seeds = True, []
    assert suite.learned_runs(Args) == [("learned:l28", ["--refine-lambda", "0.2,0.8"])]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(suite.Slots, "cores", staticmethod(lambda: 16))
    suite.Slots.set(4)
    try:
        assert suite.child_env()["OMP_NUM_THREADS"] == "4"  # 16 cores shared by 4 children
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert suite.child_env()["OMP_NUM_THREADS"] == "1"  # a given value wins
    finally:
        suite.Slots.set(1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert "OMP_NUM_THREADS" not in suite.child_env()
    assert suite.main(["--members", "digits-s01", "--refine-seeds", "0"]) == 2
    assert suite.main(["--members", "digits-s01", "--jobs", "0"]) == 2


def test_the_variant_table_gives_each_setting_over_pairs_and_seeds():
    rows = []
    for member, barriers, mids in (("digits-s01", (0.01, 0.03, 0.0), (0.62, 0.55, 0.60)),
                                   ("digits-s23", (0.05, 0.02, 0.01), (0.58, 0.61, 0.66))):
        row = _row(member, "image", 1.0, 0.5)  # endpoint accuracies 0.5 / 0.6
        for column, barrier, mid in zip(("learned", "learned@s1", "learned:w"), barriers, mids):
            row["barrier"][column], row["midpoint_accuracy"][column] = barrier, mid
            row["commands"][column] = {"seconds": 2.0, "peak_rss_mib": 300.0}
        row["refinements"] = {"learned": {"steps": 10}, "learned@s1": {"steps": 11}, "learned:w": {"steps": 12}}
        row["variants"] = {"w": {"options": ["--refine-lambda", "0,1"]}}
        rows.append(row)
    lines = suite.table(rows).splitlines()
    assert "| digits-s23 | default@s1 | --refine-seed 1 | 0.0200 | 11 | 2.0 |" in lines
    assert "| digits-s01 | w | --refine-lambda 0,1 | 0.0000 | 12 | 2.0 |" in lines
    default = [0.01, 0.03, 0.05, 0.02]
    assert (f"| default (image) | 4 | {statistics.fmean(default):.4f} ± {statistics.stdev(default):.4f} (0.0500) | "
            f"{statistics.fmean([0.02, -0.05, -0.02, 0.01]):+.4f} (-0.0500) | 2 of 4 |") in lines
    assert "| w (image) | 2 | 0.0050 ± 0.0071 (0.0100) | +0.0300 (+0.0000) | 2 of 2 |" in lines
    # a row stored before per-run refinements (its steps under "refinement"), and the universe member, whose
    # "barrier" is a 3-model merge gap: kept out of the pairs' settings
    old = _row("gpt2-s01", "text", 1.0, 0.06, 0.0155)
    old["refinement"], old["barrier"]["learned@s1"] = {"steps": 1627}, 0.0175
    old["commands"]["learned@s1"] = {"seconds": 3.0, "peak_rss_mib": 1.0}
    universe = _row("digits-u012", "universe", 2.7, 1.5, 0.5)
    universe["barrier"]["learned@s1"] = 0.9
    lines = suite.table([old, universe]).splitlines()
    assert "| gpt2-s01 | default | (none) | 0.0155 | 1627 | 10.0 |" in lines
    assert "| default (GPT-style text) | 2 | 0.0165 ± 0.0014 (0.0175) | — | — |" in lines
    assert not any(line.startswith("| digits-u012 | default") for line in lines)


def test_merge_rows_measure_the_models_ensemble_on_the_same_slice(monkeypatch, tmp_path):
    """``--merge``: a pair's row holds the written merge and the models' ensemble (``fedbasin eval A B``, on the
    slice of every other figure); the commands are recorded instead of run."""
    commands = []

    def run_cli(arguments, log=None):
        arguments = [str(a) for a in arguments]
        commands.append(arguments)
        name = arguments[0]
        if name == "eval":
            models = arguments[1:arguments.index("--data")]
            summary = {"loss": 5.0 - 0.1 * len(models), "accuracy": 0.2 * len(models), "examples": 7}
        elif name == "barrier":
            summary = {"barrier": 0.1, "losses": [1.0] * suite.POINTS}
        else:
            summary = {"refinement": {"steps": 3, "distillation": {"steps": 2}} if name == "merge" else {"steps": 3}}
        return suite.CliRun(summary, 1.0, 10.0)

    monkeypatch.setattr(suite, "run_cli", run_cli)
    args = suite.build_parser().parse_args(["--merge", "--skip-learned", "--eval-examples", "text=7"])
    args.eval_examples, args.variants, args.pair_dirs = suite.parse_eval_examples(args.eval_examples), {}, {}
    args.merge_variants = suite.parse_variants(['long=--distill-budget 240'], "--merge-variant")
    member = suite.MEMBERS["gpt2-s01"]
    row = suite.pair_row(member, [tmp_path / "a", tmp_path / "b"], args, tmp_path / "work")
    assert row["ensemble"] == {"accuracy": 0.4, "loss": 4.8}
    assert [str(tmp_path / "a"), str(tmp_path / "b"), "--data", f"text:{args.text}", "--max-examples", "7"] == \
        next(c for c in commands if c[0] == "eval" and len(c) == 7)[1:]
    assert row["merges"]["merge"]["distillation"] == {"steps": 2} and row["merges"]["merge"]["loss"] == 4.9
    # a merge variant: one more merge with its options, in a folder of its own
    merges = [c for c in commands if c[0] == "merge"]
    assert len(merges) == 2 and merges[1][-2:] == ["--distill-budget", "240"] and merges[1][4].endswith("merge-long")
    assert set(row["merges"]) == {"merge", "merge:long"}
    assert row["merges"]["merge:long"]["options"] == ["--distill-budget", "240"]


def test_the_merge_table_compares_the_written_merge_with_the_better_model():
    """``--merge`` rows: per pair and seed the merge's accuracy and loss beside the better model's and the
    ensemble's (accuracy for image pairs, loss for text pairs), and per group how many merges reach each."""
    image = _row("digits-s01", "image", 1.0, 0.5, 0.01)  # better model: accuracy 0.6, loss 1.0
    image["midpoint_accuracy"]["learned"] = 0.58
    image["ensemble"] = {"accuracy": 0.62, "loss": 0.92}
    image["merges"] = {"merge": {"accuracy": 0.63, "loss": 0.9, "seconds": 240.0, "distillation": {"steps": 900,
                                                                                                  "best_step": 850}},
                       "merge@s1": {"accuracy": 0.59, "loss": 0.95, "seconds": 241.0, "distillation": None}}
    text = _row("llama-s01", "text", 1.0, 0.1, 0.04)
    text["ensemble"] = {"accuracy": 0.21, "loss": 0.98}
    text["merges"] = {"merge": {"accuracy": 0.2, "loss": 1.05, "seconds": 250.0, "distillation": {"steps": 70,
                                                                                                  "best_step": 70}}}
    lines = suite.merge_table([image, text]).splitlines()
    assert "| digits-s01 | merge | 0.600 / 0.620 / 0.580 / 0.630 | 1.0000 / 0.9200 / 0.9000 | 900 (850) | 240.0 |" in lines
    assert "| digits-s01 | merge@s1 | 0.600 / 0.620 / 0.580 / 0.590 | 1.0000 / 0.9200 / 0.9500 | — (—) | 241.0 |" in lines
    assert "| llama-s01 | merge | — | 1.0000 / 0.9800 / 1.0500 | 70 (70) | 250.0 |" in lines
    assert "| image | 2 | +0.0100 (-0.0100) | +0.0750 (+0.0500) | 1 of 2 | 1 of 2 |" in lines
    assert "| GPT-style text | 1 | — | -0.0500 (-0.0500) | 0 of 1 | 0 of 1 |" in lines
    del image["ensemble"]  # a row stored before the ensemble was measured
    assert "| image | 2 | +0.0100 (-0.0100) | +0.0750 (+0.0500) | 1 of 2 | — |" in suite.merge_table([image]).splitlines()
    assert suite.merge_table([_row("digits-s23", "image", 1.0, 0.5)]) == ""
    assert "| digits-s01 | merge |" in suite.table([image])
