"""Every CLI error path: the documented exit code, one line on stderr naming the culprit, no
traceback, and nothing written or deleted."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from fedbasin import cli
from fedbasin.checkpoint import save_checkpoint
from fedbasin.cli import EXIT_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OUTPUT, EXIT_USAGE, main

from .helpers import trained_like

ROOT = Path(__file__).resolve().parents[1]
PROGRESS = re.compile(r"\d+/\d+ \[[^\]]*\]\s*$")  # tqdm's "3/20 [00:01<00:02, 9.1it/s]"
VIT = dict(image_size=8, patch_size=2, channels=1, num_classes=10, dim=16, depth=1, heads=2, mlp_dim=32)


def _save_vit(path: Path, seed: int = 0, **changes) -> Path:
    model = trained_like("vit", {**VIT, **changes}, seed=seed, dtype=torch.float32)
    save_checkpoint(path, "vit", model.config, model.state_dict())
    return path


@pytest.fixture
def models(tmp_path):
    """Two compatible digits ViTs, a deeper one, one with another activation, one with a NaN."""
    ckpts = tmp_path / "ckpts"
    paths = {
        "a": _save_vit(ckpts / "a", 1),
        "b": _save_vit(ckpts / "b", 2),
        "deep": _save_vit(ckpts / "deep", 3, depth=2),
        "relu": _save_vit(ckpts / "relu", 4, activation="relu"),
        "nan": _save_vit(ckpts / "nan", 5),
    }
    weights = paths["nan"] / "model.safetensors"
    state = safetensors.torch.load_file(weights)
    state["blocks.0.mlp.up.weight"][0, 0] = float("nan")
    safetensors.torch.save_file(state, weights)
    return {k: str(v) for k, v in paths.items()}


def _tree(root: Path) -> dict:
    """Every path under ``root``, files with size and mtime: 'nothing written or deleted'."""
    return {str(p): "dir" if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def _error_lines(err: str) -> list[str]:
    """stderr without progress bars (errors after work started follow its tqdm output)."""
    return [line for line in err.splitlines() if line.strip() and not PROGRESS.search(line)]


def _fails(capsys, root: Path, code: int, argv: list, *culprits: str) -> str:
    """Run the CLI; assert the exit code, one stderr line naming every culprit, no stdout, and
    that nothing under ``root`` changed. Returns the line."""
    before = _tree(root)
    assert main([str(a) for a in argv]) == code
    captured = capsys.readouterr()
    lines = _error_lines(captured.err)
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert lines[0].startswith(f"fedbasin {argv[0]}: ")
    for culprit in culprits:
        assert culprit in lines[0], lines[0]
    assert _tree(root) == before
    return lines[0]


def _usage_fails(capsys, root: Path, argv: list, *culprits: str) -> str:
    """argparse errors exit through SystemExit(2) with one line (what the console script sees)."""
    before = _tree(root)
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    assert exit_info.value.code == EXIT_USAGE
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    for culprit in culprits:
        assert culprit in lines[0], lines[0]
    assert _tree(root) == before
    return lines[0]


# ---- argument values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights, culprit",
    [("nan,1", "weight 0 is nan"), ("1,-1", "weight 1 is -1"), ("0,0", "all weights are zero"),
     ("1,inf", "weight 1 is inf"), ("1,two", "weight 1 is 'two'"), ("-1,1", "weight 0 is -1"),
     ("-0.5,2", "weight 0 is -0.5"), ("-inf,1", "weight 0 is -inf")],
)
@pytest.mark.parametrize("joined", [False, True], ids=["--weights W", "--weights=W"])
def test_merge_refuses_bad_weights(models, tmp_path, capsys, weights, culprit, joined):
    """A value that starts like a negative number is the option's value, judged by it (not an
    unknown option), written either way."""
    given = [f"--weights={weights}"] if joined else ["--weights", weights]
    _usage_fails(capsys, tmp_path, ["merge", models["a"], models["b"], "--out", tmp_path / "m", *given],
                 "--weights", culprit)


@pytest.mark.parametrize(
    "given, culprits",
    [(["--iterations", "3", "--align-iterations", "5"], ["both --iterations and --align-iterations"]),
     (["--align-iter=3", "--align-iterations", "5"], ["both --align-iter and --align-iterations"]),
     (["--weights", "-1,1", "--weights=1,1"], ["--weights given twice"]),
     (["--refine-data", "digits", "--refine-dual", "--no-refine-dual"], ["--refine-dual", "--no-refine-dual"])],
)
def test_an_option_given_twice_is_refused(models, tmp_path, capsys, given, culprits):
    """argparse keeps the last of two values without a word; fedbasin names both instead (a flag
    repeated, e.g. --no-align --no-align, means the same and passes)."""
    _usage_fails(capsys, tmp_path, ["merge", models["a"], models["b"], "--out", tmp_path / "m", *given], *culprits)


def test_a_flag_repeated_means_the_same(models, tmp_path, capsys):
    assert main(["merge", models["a"], models["b"], "--out", str(tmp_path / "m"), "--no-align", "--no-al"]) == 0


@pytest.mark.parametrize(
    "option, value",
    [("--max-examples", "-5"), ("--max-examples", "many"), ("--points", "0"), ("--points", "1"), ("--iterations", "2.5"),
     ("--tol", "nan"), ("--tol", "-1")],
)
def test_barrier_refuses_bad_sizes(models, tmp_path, capsys, option, value):
    _usage_fails(capsys, tmp_path, ["barrier", models["a"], models["b"], "--data", "digits",
                                    f"{option}={value}"], option, value)


@pytest.mark.parametrize(
    "argv, culprit, why",
    [(["align", "--stream", "--seen-tokens", "text:t.txt"], "--seen-tokens", "not supported with --stream"),
     (["align", "--stream", "--refine-data", "digits"], "--refine-data", "not supported with --stream"),
     (["align", "--stream", "--head-weight", "2"], "--head-weight", "not supported with --stream"),
     (["align", "--refine-steps", "5"], "--refine-steps", "without --refine-data"),
     (["merge", "--refine-lambda", "0", "1"], "--refine-lambda", "without --refine-data"),
     (["align", "--token-weighting", "count"], "--token-weighting", "without --seen-tokens text:FILE"),
     (["align", "--tokenizer", "tok"], "--tokenizer", "without --seen-tokens text:FILE or --refine-data"),
     (["merge", "--no-align", "--symmetry", "permutation"], "--symmetry", "with --no-align"),
     (["merge", "--no-align", "--universe-iterations", "3"], "--universe-iterations", "with --no-align"),
     (["barrier", "--seen-tokens", "text:t.txt"], "--seen-tokens", "without --align")],
)
def test_options_that_would_be_ignored_are_refused(models, tmp_path, capsys, argv, culprit, why):
    """Every option given is honoured: one that the other options make ineffective is a usage error
    naming it, before any work."""
    command, *options = argv
    target = ["--data", "digits"] if command == "barrier" else ["--out", tmp_path / "o"]
    _fails(capsys, tmp_path, EXIT_USAGE, [command, models["a"], models["b"], *target, *options], culprit, why)


def test_options_at_their_defaults_or_enabled_are_accepted(models, tmp_path, capsys):
    """The refusal looks at what changes behaviour: a default value spelt out, or an option with
    the one that enables it, runs."""
    assert main(["align", models["a"], models["b"], "--out", str(tmp_path / "o"), "--iterations", "2",
                 "--refine-lambda", "auto", "--token-weighting", "sqrt"]) == 0
    assert main(["barrier", models["a"], models["b"], "--data", "digits", "--max-examples", "20", "--points", "2",
                 "--align", "--symmetry", "permutation"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("argv, culprits", [
    (["align", "--refine-data", "digits", "--refine-seed", str(2**70)], ["--refine-seed", "below 2**63"]),
    (["align", "--refine-data", "digits", "--refine-budget", "1e308"], ["--refine-budget", "at most"]),
    (["merge", "--refine-data", "digits", "--distill-budget", "1e12"], ["--distill-budget", "at most"]),
    (["align", "--refine-data", "digits", "--refine-examples", "1"], ["--refine-examples", "at least 2"]),
    (["align", "--iterations", str(2**63)], ["--iterations", "below 2**63"]),
    (["merge", "--weights=1e308,1e308"], ["--weights", "sum overflows"]),
])
def test_huge_or_too_small_numbers_are_refused_naming_the_option(models, tmp_path, capsys, argv, culprits):
    """Values beyond what the work can take (an int64 seed, a budget whose step count overflows, a
    proxy too small to split, weights whose sum is infinite) are usage errors naming the option, not
    internal errors (exit 70) or late input errors."""
    command, *options = argv
    _usage_fails(capsys, tmp_path, [command, models["a"], models["b"], "--out", tmp_path / "o", *options], *culprits)


def test_the_smallest_proxy_refines(models, tmp_path, capsys):
    """Two proxy examples: one trains, one selects, none is left to report on (was a ZeroDivisionError)."""
    assert main(["align", models["a"], models["b"], "--out", str(tmp_path / "o"), "--refine-data", "digits",
                 "--refine-examples", "2", "--refine-steps", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["refinement"]["proxy_examples"] == 2


def test_barrier_points_are_bounded_and_shown(models, tmp_path, capsys):
    """--points has an upper bound (a λ grid of 1e20 points was allocated before anything failed), and each path's points
    draw a progress bar."""
    _usage_fails(capsys, tmp_path, ["barrier", models["a"], models["b"], "--data", "digits", "--points", "1002"],
                 "--points", "from 2 to 1001")
    assert main(["barrier", models["a"], models["b"], "--data", "digits", "--max-examples", "20", "--points", "3",
                 "--align"]) == 0
    err = capsys.readouterr().err
    assert "vanilla path" in err and "aligned path" in err


def test_summaries_are_strict_json(capsys):
    """A non-finite number in a summary is JSON null (bare NaN is not JSON; other tools refuse it)."""
    assert cli._emit({"loss": float("nan"), "curve": [1.0, float("inf")], "nested": {"x": -float("inf")}}) == 0

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    assert json.loads(capsys.readouterr().out, parse_constant=refuse) == {
        "loss": None, "curve": [1.0, None], "nested": {"x": None}}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_checkpoints_of_other_float_dtypes_evaluate_merge_and_keep_their_dtype(models, tmp_path, capsys, dtype):
    """A float16 or float64 checkpoint (align writes them) evaluates, interpolates and refines as float32
    (was an internal error on the dtype of the inputs), and what is written keeps the reference's dtype."""
    from fedbasin.checkpoint import load_checkpoint

    def stored_as(name, source):
        checkpoint = load_checkpoint(source)
        state = {k: v.to(dtype) for k, v in checkpoint.state.items()}
        return str(save_checkpoint(tmp_path / name, "vit", checkpoint.config, state))

    a, b = stored_as("a", models["a"]), stored_as("b", models["b"])

    def run(*argv):
        assert main([str(x) for x in argv]) == 0
        return json.loads(capsys.readouterr().out)

    ours, reference = run("eval", a, "--data", "digits"), run("eval", models["a"], "--data", "digits")
    assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-2)  # the same model, rounded to the dtype
    assert run("eval", a, b, "--data", "digits")["examples"] == reference["examples"]
    assert run("barrier", a, b, "--data", "digits", "--max-examples", "20", "--points", "3")["barrier"] >= 0
    run("align", a, b, "--out", tmp_path / "aligned", "--refine-data", "digits", "--refine-steps", "2")
    run("merge", a, b, "--out", tmp_path / "merged")
    for written in ("aligned", "merged"):
        assert {v.dtype for v in load_checkpoint(tmp_path / written).state.values()} == {dtype}


def test_diverged_or_too_large_training_writes_nothing(tmp_path, capsys):
    """A learning rate whose optimiser step overflows float32 (was an internal error), or whose model
    gives a NaN test loss from finite weights (was saved with exit 0), and a model too large for memory:
    exit 1 in one line, nothing written."""
    out = tmp_path / "model"

    def fails_after_starting(*argv):  # train says what it trains first, then the error (its last line)
        assert main(["train", "--data", "digits", "--out", str(out), *argv]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and "Traceback" not in captured.err and not out.exists()
        return _error_lines(captured.err)[-1]

    for lr, why in (("1e300", "an optimiser step overflowed float32"), ("1e30", "the test loss is nan")):
        line = fails_after_starting("--epochs", "1", "--max-train-examples", "64", "--lr", lr)
        assert "training diverged" in line and why in line and "--lr" in line, line
    line = fails_after_starting("--mlp-dim", "99999999999")
    assert line.startswith("fedbasin train: out of memory (") and "GiB" in line, line
    _usage_fails(capsys, tmp_path, ["train", "--data", "digits", "--out", out, "--seed", str(2**64)],
                 "--seed", "below 2**63")
    _fails(capsys, tmp_path, EXIT_USAGE, ["train", "--data", "digits", "--out", out, "--block-size", "8"],
           "--block-size applies to text data only")


def test_weight_count_must_match_the_models(models, tmp_path, capsys):
    _fails(capsys, tmp_path, EXIT_USAGE, ["merge", models["a"], models["b"], "--out", tmp_path / "m",
                                          "--weights", "1,2,3"], "--weights has 3 values for 2 models")


@pytest.mark.parametrize("item", ["batch-size=-1", "local-epochs=abc", "max-train-examples=-5", "lr=nan", "model.dim=63",
                                  "proxy-size=5"])
def test_simulate_refuses_bad_run_config_before_touching_disk(tmp_path, capsys, item):
    out = tmp_path / "run"
    before = _tree(tmp_path)
    assert main(["simulate", "--run-config", item, "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and item.split("=")[0] in err[0], err
    assert _tree(tmp_path) == before


# ---- inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["align", "merge", "barrier"])
@pytest.mark.parametrize("deeper_side", ["reference", "other"])
def test_depth_mismatch_is_refused_at_load(models, tmp_path, capsys, command, deeper_side):
    first, second = (models["deep"], models["a"]) if deeper_side == "reference" else (models["a"], models["deep"])
    argv = [command, first, second] + (["--data", "digits"] if command == "barrier" else ["--out", tmp_path / "o"])
    kind = "missing tensor(s)" if deeper_side == "reference" else "extra tensor(s)"
    _fails(capsys, tmp_path, EXIT_INPUT, argv, second, kind, "blocks.1.")


def test_other_family_is_refused(models, tmp_path, capsys):
    gpt = trained_like("gpt", dict(vocab_size=20, block_size=8, dim=16, depth=1, heads=2, mlp_dim=32), seed=0,
                       dtype=torch.float32)
    save_checkpoint(tmp_path / "ckpts" / "gpt", "gpt", gpt.config, gpt.state_dict())
    _fails(capsys, tmp_path, EXIT_INPUT, ["merge", models["a"], tmp_path / "ckpts" / "gpt", "--out", tmp_path / "o"],
           "gpt", "fedbasin gpt model but the reference is a fedbasin vit model")


def test_activation_mismatch_is_refused(models, tmp_path, capsys):
    _fails(capsys, tmp_path, EXIT_INPUT, ["merge", models["a"], models["b"], models["relu"], "--out", tmp_path / "o"],
           models["relu"], "activation='relu'")


@pytest.mark.parametrize("command", ["align", "merge", "barrier"])
def test_nan_model_is_refused(models, tmp_path, capsys, command):
    argv = [command, models["a"], models["nan"]] + (
        ["--data", "digits"] if command == "barrier" else ["--out", tmp_path / "o"])
    _fails(capsys, tmp_path, EXIT_INPUT, argv, models["nan"], "blocks.0.mlp.up.weight", "NaN")


def _edited_copy(models, name: str, config: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of model ``a`` named ``name`` with config fields and tensors replaced."""
    source, copy = Path(models["a"]), Path(models["a"]).parent / name
    copy.mkdir()
    values = json.loads((source / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**values, **(config or {})}))
    state = safetensors.torch.load_file(source / "model.safetensors")
    safetensors.torch.save_file({**state, **(tensors or {})}, copy / "model.safetensors")
    return copy


@pytest.mark.parametrize("name, config, tensor, words", [
    ("integer", None, torch.zeros(32, dtype=torch.int64), ("blocks.0.mlp.up.bias", "dtype int64", "floating point")),
    ("negative", {"dim": -16}, None, ("config.json", "invalid vit config", "dim is -16; expected a positive integer")),
    ("no heads", {"heads": 0}, None, ("config.json", "heads is 0; expected a positive integer")),  # was ZeroDivisionError
    ("typed", {"depth": "one"}, None, ("config.json", "depth is 'one'; expected int")),
])
def test_a_malformed_config_or_tensor_is_refused_at_load(models, tmp_path, capsys, name, config, tensor, words):
    """An integer tensor, a negative size or a field of the wrong type: a one-line input error naming the file
    and the field, not an internal error raised later by the model."""
    bad = _edited_copy(models, name, config, None if tensor is None else {"blocks.0.mlp.up.bias": tensor})
    _fails(capsys, tmp_path, EXIT_INPUT, ["merge", models["a"], bad, "--out", tmp_path / "o"], str(bad), *words)


def test_weights_file_with_extra_layer_is_refused(models, tmp_path, capsys):
    """config.json says depth 1 but the weights hold two blocks: an error, not a dropped layer."""
    (Path(models["a"]).parent / "lying").mkdir()
    lying = Path(models["a"]).parent / "lying"
    (lying / "config.json").write_text((Path(models["a"]) / "config.json").read_text())
    (lying / "model.safetensors").write_bytes((Path(models["deep"]) / "model.safetensors").read_bytes())
    _fails(capsys, tmp_path, EXIT_INPUT, ["merge", models["a"], lying, "--out", tmp_path / "o"],
           str(lying), "unexpected tensor(s)", "blocks.1.")


def test_missing_checkpoint(models, tmp_path, capsys):
    _fails(capsys, tmp_path, EXIT_INPUT, ["align", models["a"], tmp_path / "nowhere", "--out", tmp_path / "o"],
           "nowhere", "does not exist")


def test_text_file_missing_is_an_error_never_a_download(models, tmp_path, capsys, monkeypatch):
    import datasets

    def no_download(*args, **kwargs):
        raise AssertionError("load_dataset must not be called")

    monkeypatch.setattr(datasets, "load_dataset", no_download)
    missing = tmp_path / "missing.txt"
    _fails(capsys, tmp_path, EXIT_INPUT, ["barrier", models["a"], models["b"], "--data", f"text:{missing}"],
           str(missing), "does not exist")


def test_a_text_file_that_is_not_utf8_is_refused_in_one_line(models, tmp_path, capsys):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    _fails(capsys, tmp_path, EXIT_INPUT, ["barrier", models["a"], models["b"], "--data", f"text:{binary}"],
           str(binary), "is not UTF-8 text")


def test_unknown_data_source(models, tmp_path, capsys):
    _fails(capsys, tmp_path, EXIT_INPUT, ["barrier", models["a"], models["b"], "--data", "imagenet"],
           "unknown data source 'imagenet'")


# ---- outputs --------------------------------------------------------------------------------


def _spy_on_work(monkeypatch):
    """Record whether the alignment started: outputs must be refused before it."""
    calls = []
    import fedbasin.alignment

    real = fedbasin.alignment.weight_match
    monkeypatch.setattr(fedbasin.alignment, "weight_match", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_out_is_an_existing_file(models, tmp_path, capsys, monkeypatch):
    calls = _spy_on_work(monkeypatch)
    target = tmp_path / "results.txt"
    target.write_text("precious")
    _fails(capsys, tmp_path, EXIT_OUTPUT, ["align", models["a"], models["b"], "--out", target],
           str(target), "not a directory")
    assert target.read_text() == "precious" and not calls


def test_an_empty_out_is_refused_before_the_work(models, tmp_path, capsys, monkeypatch):
    calls = _spy_on_work(monkeypatch)
    _fails(capsys, tmp_path, EXIT_USAGE, ["align", models["a"], models["b"], "--out", ""], "--out is empty")
    assert not calls


def test_out_is_a_non_checkpoint_directory(models, tmp_path, capsys, monkeypatch):
    calls = _spy_on_work(monkeypatch)
    target = tmp_path / "photos"
    target.mkdir()
    (target / "holiday.jpg").write_text("precious")
    _fails(capsys, tmp_path, EXIT_OUTPUT, ["align", models["a"], models["b"], "--out", target],
           str(target), "not a checkpoint")
    assert not calls


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can write into: mode 0555 for a normal user, a read-only tmpfs as root."""
    path = tmp_path / "locked"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                             capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip("root without permission to mount a read-only tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("command", ["align", "merge"])
def test_out_in_a_read_only_directory(models, read_only_dir, tmp_path, capsys, monkeypatch, command):
    calls = _spy_on_work(monkeypatch)
    target = read_only_dir / "new" / "merged"
    _fails(capsys, tmp_path, EXIT_OUTPUT, [command, models["a"], models["b"], "--out", target],
           str(target), "cannot write in")
    assert not calls


def test_plot_in_a_read_only_directory(models, read_only_dir, tmp_path, capsys):
    target = read_only_dir / "curve.png"
    _fails(capsys, tmp_path, EXIT_OUTPUT, ["barrier", models["a"], models["b"], "--data", "digits",
                                           "--plot", target], "--plot", str(target))


def test_a_plot_format_matplotlib_cannot_write_is_refused_before_any_work(models, tmp_path, capsys):
    """Exit 4 in one line (was an internal error once the barrier had been computed)."""
    _fails(capsys, tmp_path, EXIT_OUTPUT, ["barrier", models["a"], models["b"], "--data", "digits",
                                           "--plot", tmp_path / "curve.xyz"], "--plot", "curve.xyz", "png")


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize("raised", ["OSError", "SafetensorError"])
def test_disk_full_at_write_time_leaves_nothing(models, tmp_path, capsys, monkeypatch, existing, raised):
    """ENOSPC while writing the weights: one line, exit 4, no partial or temporary files, and an
    existing checkpoint at --out (and created parent directories) untouched/removed. safetensors
    itself reports a full disk as ``SafetensorError("... (os error 28)")`` (seen on a full tmpfs)."""
    target = tmp_path / "deep" / "er" / "merged"
    if existing:
        _save_vit(target, 7)

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # a partial file, then the disk is full
        if raised == "SafetensorError":
            raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device "
                                              "(os error 28)")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    _fails(capsys, tmp_path, EXIT_OUTPUT, ["merge", models["a"], models["b"], "--out", target,
                                          *(["--overwrite"] if existing else [])],
           str(target), "No space left on device")


def test_the_interrupt_line_starts_its_own_line_after_a_live_bar(models, tmp_path, capsys, monkeypatch):
    """A Ctrl-C while a bar is drawn: the bar is cleared first, so "interrupted" is a line of its own
    (not appended to the half-drawn bar)."""
    import fedbasin.alignment
    from fedbasin.alignment.progress import progress_bar

    def interrupted(*args, **kwargs):
        bar = progress_bar(10, True, "matching", "it")
        bar.update(3)
        raise KeyboardInterrupt

    monkeypatch.setattr(fedbasin.alignment, "weight_match", interrupted)
    assert main(["align", models["a"], models["b"], "--out", str(tmp_path / "o")]) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "matching" in err
    last = re.split(r"[\r\n]", err.rstrip("\n"))[-1]
    assert last.startswith("fedbasin align: interrupted"), repr(err)


def test_interrupt_during_write_leaves_nothing(models, tmp_path, capsys, monkeypatch):
    def interrupted(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    _fails(capsys, tmp_path, EXIT_INTERRUPTED, ["align", models["a"], models["b"], "--out", tmp_path / "o"],
           "interrupted")


def test_a_bug_is_one_line_with_exit_70(models, tmp_path, capsys, monkeypatch):
    import fedbasin.alignment

    monkeypatch.delenv("FEDBASIN_DEBUG", raising=False)
    monkeypatch.setattr(fedbasin.alignment, "weight_match", lambda *a, **k: 1 / 0)
    _fails(capsys, tmp_path, EXIT_INTERNAL, ["align", models["a"], models["b"], "--out", tmp_path / "o"],
           "internal error: ZeroDivisionError", "FEDBASIN_DEBUG=1")


# ---- the installed entry point --------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, code, culprit",
    [(["merge", "{a}", "{b}", "--out", "{tmp}/m", "--weights", "nan,1"], EXIT_USAGE, "--weights"),
     (["align", "{a}", "{nan}", "--out", "{tmp}/m"], EXIT_INPUT, "blocks.0.mlp.up.weight")],
)
def test_entry_point_prints_one_line(models, tmp_path, argv, code, culprit):
    argv = [a.format(tmp=tmp_path, **models) for a in argv]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "fedbasin.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == code, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and culprit in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "m").exists()


def test_exit_codes_are_documented():
    readme = (ROOT / "README.md").read_text()
    for name in ("EXIT_USAGE", "EXIT_INPUT", "EXIT_OUTPUT", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_FAILED"):
        assert f"| {getattr(cli, name)} |" in readme, name


def _readme_exit_codes() -> list[int]:
    """The codes of README.md's exit-code table ("the exit code says what went wrong")."""
    text = (ROOT / "README.md").read_text()
    rows = text[text.index("the exit code says what went wrong"):].splitlines()[1:]
    codes = []
    for line in rows:
        if match := re.match(r"\| (\d+) \|", line):
            codes.append(int(match[1]))
        elif codes and not line.startswith("|"):
            break
    return codes


def _raising(error):
    def fail(*args, **kwargs):
        raise error
    return fail


def _terminated(*args, **kwargs):
    from fedbasin import simulate

    raise simulate.Terminated("signal 15")


# code -> (argv, culprit in the one stderr line, what to break first); {a}, {b}, {tmp} are filled in.
# Elsewhere, too: 130 during a write (test_interrupt_during_write_leaves_nothing), 143 and 130 of a
# real simulation (tests/test_processes.py), 1 for an unusable final model (tests/test_outputs.py).
EXIT_TABLE_CASES = {
    0: (["merge", "{a}", "{b}", "--out", "{tmp}/merged", "--iterations", "2"], None, None),
    1: (["align", "{a}", "{b}", "--out", "{tmp}/aligned"], "out of GPU memory",
        ("fedbasin.alignment", "weight_match", _raising(torch.OutOfMemoryError("CUDA out of memory")))),
    2: (["merge", "{a}", "{b}", "--out", "{tmp}/merged", "--weights", "-1,1"], "weight 0 is -1", None),
    3: (["merge", "{a}", "{tmp}/missing", "--out", "{tmp}/merged"], "missing", None),
    4: (["merge", "{a}", "{b}", "--out", "{b}"], "is the input", None),
    70: (["align", "{a}", "{b}", "--out", "{tmp}/aligned"], "internal error: ZeroDivisionError",
         ("fedbasin.alignment", "weight_match", _raising(ZeroDivisionError("division by zero")))),
    130: (["align", "{a}", "{b}", "--out", "{tmp}/aligned"], "interrupted",
          ("fedbasin.alignment", "weight_match", _raising(KeyboardInterrupt()))),
    143: (["simulate", "--out", "{tmp}/run"], "stopped by SIGTERM",
          ("fedbasin.simulate", "simulate", _terminated)),
}


def test_every_exit_code_of_the_readme_table_has_a_trigger():
    assert sorted(EXIT_TABLE_CASES) == sorted(_readme_exit_codes())


@pytest.mark.parametrize("code", _readme_exit_codes())
def test_the_readme_exit_code_table(models, tmp_path, capsys, monkeypatch, code):
    """Walk README.md's table: each code from the CLI, with one line on stderr naming the cause (a
    code added to the table without a case here fails above and here)."""
    assert code in EXIT_TABLE_CASES, f"README.md lists exit code {code}: add a case to EXIT_TABLE_CASES"
    argv, culprit, broken = EXIT_TABLE_CASES[code]
    monkeypatch.delenv("FEDBASIN_DEBUG", raising=False)
    if broken is not None:
        module, name, replacement = broken
        monkeypatch.setattr(__import__(module, fromlist=[name]), name, replacement)
    argv = [a.format(tmp=tmp_path, **models) for a in argv]
    try:
        got = main(argv)
    except SystemExit as exit_info:  # argparse's own errors
        got = exit_info.code
    captured = capsys.readouterr()
    assert got == code, captured.err
    assert "Traceback" not in captured.err
    if code == 0:
        assert json.loads(captured.out)["command"] == argv[0]
        return
    lines = _error_lines(captured.err)
    assert len(lines) == 1 and lines[0].startswith(f"fedbasin {argv[0]}: ") and culprit in lines[0], captured.err


# ---- outputs never replace inputs; probes find what root cannot write ----------------------


@pytest.mark.parametrize("argv, culprit", [
    (["merge", "{a}", "{b}", "--out", "{a}"], "is the input"),
    (["align", "{a}", "{b}", "--out", "{b}"], "is the input"),
    (["align", "{a}", "{b}", "--out", "{a}/inner"], "is inside the input"),
    (["merge", "{a}", "{b}", "--out", "{ckpts}"], "holds the input"),
    (["barrier", "{a}", "{b}", "--data", "digits", "--plot", "{a}/config.json"], "is inside the input"),
    (["train", "--data", "text:{ckpts}/corpus.txt", "--out", "{ckpts}/corpus.txt", "--overwrite"], "is the input"),
])
def test_an_output_never_replaces_an_input(models, tmp_path, capsys, monkeypatch, argv, culprit):
    calls = _spy_on_work(monkeypatch)
    ckpts = tmp_path / "ckpts"
    (ckpts / "corpus.txt").write_text("some text " * 50)
    argv = [a.format(ckpts=ckpts, **models) for a in argv]
    option = "--plot" if "--plot" in argv else "--out"
    _fails(capsys, tmp_path, EXIT_OUTPUT, argv, f"{option} {argv[argv.index(option) + 1]}", culprit)
    assert not calls


@pytest.fixture
def immutable(tmp_path):
    """``make(path)``: nobody may write into ``path`` any more: ``chattr +i`` (root ignores
    permission bits), mode 0555 for a normal user."""
    made = []

    def make(path: Path) -> Path:
        if os.geteuid() != 0:
            path.chmod(0o555)
        elif subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode != 0:
            pytest.skip("chattr +i is not available here")
        made.append(path)
        return path

    yield make
    for path in made:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        else:
            path.chmod(0o755)


@pytest.mark.parametrize("existing", ["checkpoint", "empty"])
def test_an_immutable_out_dir_is_refused_before_any_work(models, tmp_path, capsys, monkeypatch, immutable,
                                                        existing):
    calls = _spy_on_work(monkeypatch)
    target = _save_vit(tmp_path / "old", 7) if existing == "checkpoint" else tmp_path / "old"
    target.mkdir(exist_ok=True)
    immutable(target)
    _fails(capsys, tmp_path, EXIT_OUTPUT, ["align", models["a"], models["b"], "--out", target, "--overwrite"],
           f"--out {target}", "cannot write in")
    assert not calls


def test_an_immutable_plot_file_is_refused_before_any_work(models, tmp_path, capsys, immutable):
    target = tmp_path / "curve.png"
    target.write_bytes(b"an earlier plot")
    immutable(target)
    _fails(capsys, tmp_path, EXIT_OUTPUT, ["barrier", models["a"], models["b"], "--data", "digits",
                                           "--plot", target], f"--plot {target}", "cannot replace it")


def test_simulate_refuses_an_unusable_out_dir_with_exit_4(tmp_path, capsys, monkeypatch, immutable):
    from fedbasin import simulate

    started = []
    monkeypatch.setattr(simulate, "LocalSuperLink", lambda *a, **k: started.append(1) / 0)
    target = tmp_path / "results.txt"
    target.write_text("precious")
    _fails(capsys, tmp_path, EXIT_OUTPUT, ["simulate", "--out", target], f"out-dir {target}", "not a directory")
    (tmp_path / "locked").mkdir()
    locked = immutable(tmp_path / "locked")
    _fails(capsys, tmp_path, EXIT_OUTPUT, ["simulate", "--out", locked], f"out-dir {locked}", "not writable")
    assert not started


def test_simulate_missing_data_is_bad_input(tmp_path, capsys):
    _fails(capsys, tmp_path, EXIT_INPUT, ["simulate", "--out", tmp_path / "run", "--run-config",
                                          f"data='text:{tmp_path / 'nowhere.txt'}'"], "nowhere.txt")


def test_simulate_unreadable_data_is_bad_input_naming_the_key(tmp_path, capsys):
    """A data file that exists but cannot be read as text is an input error (3) naming the run-config key
    (was a usage error without the key)."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9 \xff\xfe")
    _fails(capsys, tmp_path, EXIT_INPUT, ["simulate", "--out", tmp_path / "run", "--run-config",
                                          f"data='text:{latin}'"], "run-config data=", "not UTF-8")


def test_simulate_refuses_a_run_config_key_given_twice(tmp_path, capsys):
    """flwr would keep the last of two values without a word."""
    _fails(capsys, tmp_path, EXIT_USAGE, ["simulate", "--out", tmp_path / "run", "--run-config", "seed=1 seed=2"],
           "run-config seed given twice")


@pytest.mark.parametrize("command", ["align", "merge", "train"])
def test_an_existing_checkpoint_is_replaced_only_with_overwrite(models, tmp_path, capsys, monkeypatch, command):
    """Without --overwrite an existing checkpoint at --out is refused (exit 4) before any work, and
    every file in it stays as it was."""
    calls = _spy_on_work(monkeypatch)
    out = _save_vit(tmp_path / "trained", 9)
    (out / "train.json").write_text('{"seed": 9}')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    argv = (["train", "--data", "digits"] if command == "train" else [command, models["a"], models["b"]])
    _fails(capsys, tmp_path, EXIT_OUTPUT, [*argv, "--out", out], f"--out {out}", "--overwrite")
    assert not calls and {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_valid_run_still_succeeds(models, tmp_path, capsys):
    """The checks refuse only bad input: an existing checkpoint (not an input) as --out is replaced
    with --overwrite; what described its old weights (train.json, the tokenizer they read) goes with
    them, other files stay."""
    out = _save_vit(tmp_path / "trained", 9)
    (out / "train.json").write_text('{"seed": 9}')
    (out / "tokenizer.json").write_text("{}")
    (out / "README.md").write_text("notes")
    assert main(["merge", models["a"], models["b"], "--out", str(out), "--overwrite", "--weights", "0,1",
                 "--iterations", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"] == [0.0, 1.0]
    assert not (out / "train.json").exists() and not (out / "tokenizer.json").exists()
    assert (out / "README.md").read_text() == "notes"


def test_a_ctrl_c_while_starting_is_one_line(monkeypatch, capsys):
    """The console script (pyproject's entry) reports a Ctrl-C during the imports of its first
    seconds in one line, exit 130, instead of a traceback."""
    import tomllib
    import types

    from fedbasin import console

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fedbasin"] == "fedbasin.console:entry"

    class Importing(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "fedbasin.cli", Importing("fedbasin.cli"))
    assert console.entry() == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert err.strip() == "fedbasin: interrupted; nothing was written"


def test_python_dash_m_fedbasin_is_the_console_script(monkeypatch):
    """``python -m fedbasin`` runs the console script's entry (its one-line Ctrl-C included)."""
    import runpy

    from fedbasin import console

    monkeypatch.setattr(console, "entry", lambda: 7)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("fedbasin", run_name="__main__")
    assert exit_.value.code == 7
