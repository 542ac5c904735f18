"""Device handling: every step runs on the tensors' device (assignments on the CPU); CUDA cases
skip cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

from fedbasin.alignment import apply_group, canonicalize, merge, random_group_element, weight_match
from fedbasin.alignment.hf import hf_adapter

from .causal_lm import float64_rmsnorm, hf_model  # noqa: F401  (a fixture)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.fixture(params=DEVICES)
def device_param(request, monkeypatch) -> str:
    """The device; on CUDA, convolutions in full float32 (cuDNN's default TF32 rounds the ViT's
    patch embedding to ~1e-3, more than the CPU comparisons below allow)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["orthogonal", "permutation"])
def test_matching_runs_on_the_tensors_device(device, mode):
    model = hf_model("llama", num_key_value_heads=2, dtype=torch.float32)
    adapter = hf_adapter(model)
    spec = adapter.spec
    reference = adapter.to_standard(model.state_dict())
    other = adapter.to_standard(hf_model("llama", seed=1, num_key_value_heads=2, dtype=torch.float32).state_dict())
    on = lambda s: {k: v.to(device) for k, v in s.items()}
    result = weight_match(spec, on(reference), on(other), mode=mode, iterations=3)
    assert {v.device.type for v in result.state.values()} == {device}
    assert result.transform.residual.device.type == device
    cpu = weight_match(spec, reference, other, mode=mode, iterations=3)
    assert result.objective[-1] == pytest.approx(cpu.objective[-1], rel=1e-4)
    merged = merge(spec, [on(reference), on(other)], iterations=2)
    assert {v.device.type for v in merged.state.values()} == {device}


@pytest.mark.parametrize("device", DEVICES)
def test_group_action_on_device(device):
    model = hf_model("gpt_neox", rotary_pct=0.5)
    adapter = hf_adapter(model)
    spec = adapter.spec
    canonical = canonicalize(spec, {k: v.to(device) for k, v in adapter.to_standard(model.state_dict()).items()})
    g = random_group_element(spec, 3, "orthogonal", dtype=torch.float64)
    moved = apply_group(spec, canonical.state, g)
    assert {v.device.type for v in moved.values()} == {device}
    result = weight_match(spec, canonical.state, moved, iterations=40, tol=1e-12)
    assert max(float((result.state[k] - canonical.state[k]).abs().max()) for k in moved) < 1e-6


# ------------------------------------------------------------------------------------------------
# every other path that takes a device: streamed alignment, the CLI, training, the server's round


def test_streamed_alignment_on_device(tmp_path, device_param):
    """Streamed alignment with ``device``: a planted symmetry of a GQA Llama (float64 files) is
    undone, written to disk from the device."""
    from fedbasin.checkpoint import stream_align

    ref = hf_model("llama", num_key_value_heads=2, num_hidden_layers=2)
    adapter = hf_adapter(ref)
    canonical = canonicalize(adapter.spec, adapter.to_standard(ref.state_dict()))
    g = random_group_element(adapter.spec, 5, "orthogonal", dtype=torch.float64)
    moved = type(ref)(ref.config).double()
    moved.load_state_dict(adapter.from_standard(apply_group(adapter.spec, canonical.state, g)))
    ref.save_pretrained(tmp_path / "ref")
    moved.save_pretrained(tmp_path / "cand")
    result = stream_align(tmp_path / "ref", tmp_path / "cand", tmp_path / "out", iterations=60, tol=1e-12,
                          device=device_param)
    assert result.objective[-1] > 1 - 1e-9
    out = type(ref).from_pretrained(tmp_path / "out", dtype=torch.float64)
    for key, value in ref.state_dict().items():
        assert float((out.state_dict()[key] - value).abs().max()) < 1e-5, key  # the work is float32


def test_cli_align_merge_and_barrier_on_device(tmp_path, capsys, device_param):
    """``--device``: align and merge write what the Python API computes on the CPU, and barrier
    reports the CPU's losses."""
    import json

    from fedbasin.checkpoint import load_checkpoint, save_checkpoint
    from fedbasin.cli import main
    from tests.helpers import DIGITS_VIT, trained_digits_vit

    for seed in (0, 1):
        save_checkpoint(tmp_path / f"m{seed}", "vit", DIGITS_VIT, trained_digits_vit(seed))
    a, b = (load_checkpoint(tmp_path / f"m{seed}") for seed in (0, 1))

    def run(*argv, device=device_param):
        assert main([*map(str, argv), "--device", device]) == 0
        return json.loads(capsys.readouterr().out)

    def close(path, expected):
        written = load_checkpoint(path).state
        assert all(v.device.type == "cpu" for v in written.values())
        assert max(float((written[k] - v).abs().max()) for k, v in expected.items()) < 1e-4

    run("align", tmp_path / "m0", tmp_path / "m1", "--out", tmp_path / "aligned", "--iterations", "5")
    close(tmp_path / "aligned", weight_match(a.spec, a.state, b.state, iterations=5).state)
    run("merge", tmp_path / "m0", tmp_path / "m1", "--out", tmp_path / "merged", "--iterations", "5")
    close(tmp_path / "merged", merge(a.spec, [a.state, b.state], iterations=5).state)
    argv = ("barrier", tmp_path / "m0", tmp_path / "m1", "--data", "digits", "--align", "--points", "3",
            "--iterations", "5")
    on_device, on_cpu = run(*argv), run(*argv, device="cpu")
    assert on_device["losses"] == pytest.approx(on_cpu["losses"], rel=1e-4)
    assert on_device["vanilla"]["losses"] == pytest.approx(on_cpu["vanilla"]["losses"], rel=1e-4)


def test_cli_refined_and_distilled_merge_on_device(tmp_path, capsys, device_param):
    """``merge --refine-data``: refinement, then distillation of the models' ensemble (mixup views) run on the
    device and write a CPU checkpoint whose selection loss is no worse than the refined merge's."""
    import json

    from fedbasin.checkpoint import load_checkpoint, save_checkpoint
    from fedbasin.cli import main
    from tests.helpers import DIGITS_VIT, trained_digits_vit

    for seed in (0, 1):
        save_checkpoint(tmp_path / f"m{seed}", "vit", DIGITS_VIT, trained_digits_vit(seed))
    assert main(["merge", str(tmp_path / "m0"), str(tmp_path / "m1"), "--out", str(tmp_path / "merged"),
                 "--refine-data", "digits", "--refine-steps", "4", "--refine-examples", "300", "--distill-steps", "6",
                 "--device", device_param]) == 0
    distilled = json.loads(capsys.readouterr().out)["refinement"]["distillation"]
    assert distilled["steps"] == 6 and distilled["selection_loss_best"] <= distilled["selection_loss_start"]
    assert all(v.device.type == "cpu" for v in load_checkpoint(tmp_path / "merged").state.values())


def test_training_and_evaluation_on_device(device_param):
    """``train`` and ``evaluate`` run on ``device``; the trained model's test metrics there equal
    the CPU's for the same weights."""
    from fedbasin.data import load_task
    from fedbasin.models import build_model
    from fedbasin.training import evaluate, train
    from tests.helpers import DIGITS_VIT

    task = load_task("digits", seed=0)
    torch.manual_seed(0)
    model = build_model("vit", DIGITS_VIT)
    stats = train(model, task.train, epochs=2, lr=3e-3, batch_size=64, device=device_param)
    assert next(model.parameters()).device.type == device_param
    assert stats["train_loss"] < 2.3  # log 10 = 2.30: it learned something
    here = evaluate(model, task.test, device=device_param)
    there = evaluate(model, task.test, device="cpu")
    assert here["loss"] == pytest.approx(there["loss"], rel=1e-4)
    assert here["accuracy"] == pytest.approx(there["accuracy"], abs=2 / len(task.test))


@pytest.fixture
def serverapp_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 7), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)


def server_round(device: str, refine_steps: int, distill_steps: int, **options):
    """The ServerApp's strategy (weightless module, cohort screening, clipping, learned
    refinement, in-place distillation on the run config's ``device``) over one round of three
    independently trained digits ViTs; returns (arrays, metrics)."""
    from fedbasin.alignment import fedbasin_adapter
    from fedbasin.config import resolve_run_config
    from fedbasin.data import load_task
    from fedbasin.models import build_model
    from fedbasin.server.server_app import make_distiller, make_refiner
    from fedbasin.strategies import AlignedFedAvg
    from fedbasin.training import resolve_device
    from fedbasin.weights import release_weights
    from tests.helpers import DIGITS_VIT, trained_digits_vit
    from tests.test_distill import one_shot_round

    config = resolve_run_config({"proxy-size": 300, "refine-steps": refine_steps, "distill-steps": distill_steps,
                                 "distill-lr": 0.003, "device": device, "model.dim": 16, "model.depth": 1,
                                 "model.heads": 2, "model.mlp-dim": 32})
    task = load_task("digits", seed=0, proxy_size=300)
    model = build_model("vit", DIGITS_VIT)
    adapter = fedbasin_adapter("vit", model.config)
    release_weights(model)
    extra = {}
    if refine_steps:
        extra["refine"] = make_refiner(adapter.spec, model, task, config)
    if distill_steps:
        extra["distill"] = make_distiller(model, task, config, adapter, in_place=True)
    strategy = AlignedFedAvg(adapter.spec, independent_init=True, min_train_nodes=3, min_available_nodes=3,
                             device=resolve_device(device), **extra, **options)
    return one_shot_round(strategy, [trained_digits_vit(seed) for seed in range(3)])


def test_server_round_on_device(serverapp_identity, device_param):
    """The round's matching, screening, clipping and merge on ``device`` give the CPU's global
    model; with refinement and distillation there too, the round ends with a finite float32
    model whose distillation lowered its selection loss."""
    options = {"clip_ratio": 1.5, "outlier_threshold": 3.5}
    plain, metrics = server_round(device_param, 0, 0, **options)
    reference, _ = server_round("cpu", 0, 0, **options)
    assert metrics["round_failed"] == 0 and metrics["num_excluded"] == 0
    for key, value in reference.to_torch_state_dict().items():
        got = plain.to_torch_state_dict()[key]
        assert got.dtype == torch.float32 and float((got - value).abs().max()) < 1e-4, key
    arrays, metrics = server_round(device_param, 6, 20, **options)
    assert metrics["round_failed"] == 0, metrics
    state = arrays.to_torch_state_dict()
    assert all(v.dtype == torch.float32 and bool(v.isfinite().all()) for v in state.values())
    assert metrics["distill_selection_loss"] < metrics["distill_selection_loss_start"]
    assert "refine_heldout_loss" in metrics


def test_a_device_that_is_not_usable_here_is_refused_in_one_line(capsys):
    """``--device``, the run config's ``device`` and the strategy's refuse what cannot run here,
    before any work, in one line."""
    from fedbasin.config import RunConfigError, resolve_run_config
    from fedbasin.training import resolve_device
    from tests.helpers import cli_error

    assert cli_error(capsys, ["eval", "nowhere", "--data", "digits", "--device", "gpu"]) == (
        "fedbasin eval: --device 'gpu': expected auto, cpu, cuda or cuda:N")
    with pytest.raises(RunConfigError, match="run-config device 'tpu': expected auto, cpu, cuda or cuda:N"):
        resolve_run_config({"device": "tpu"})
    from fedbasin.strategies import AlignedFedAvg
    from tests.helpers import VIT, spec_of

    with pytest.raises(ValueError, match="device must be a torch device such as cpu, cuda or cuda:N, got 'gpu'"):
        AlignedFedAvg(spec_of("vit", VIT), device="gpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"device 'cuda:{count}': " + ("only" if count else "no CUDA GPU")):
        resolve_device(f"cuda:{count}")
    if not count:
        assert "no CUDA GPU is visible here" in cli_error(
            capsys, ["align", "a", "b", "--out", "c", "--device", "cuda"])


def test_learned_refinement_of_a_language_model_on_device(device_param):
    """Learned refinement of a GPT pair on ``device`` — activation start, restricted vocabulary with
    sampled outside tokens — returns states there whose training losses follow the CPU's."""
    from fedbasin.alignment import learned_refine
    from fedbasin.models import build_model
    from fedbasin.training import cross_entropy
    from tests.helpers import GPT, spec_of, trained_like

    spec = spec_of("gpt", GPT)
    a, b = (trained_like("gpt", GPT, seed=s, dtype=torch.float32).state_dict() for s in (1, 2))
    g = torch.Generator().manual_seed(0)
    data = [(x, x) for x in (torch.randint(0, 12, (4, GPT["block_size"]), generator=g) for _ in range(6))]

    def refine(device):
        on = {k: v.to(device) for k, v in a.items()}, {k: v.to(device) for k, v in b.items()}
        return learned_refine(spec, build_model("gpt", GPT), on[0], [on[1]], cross_entropy, iter(data * 3),
                              data[:2], steps=8, eval_every=2, start="activations",
                              vocabulary=torch.arange(12), vocabulary_samples=4)

    here, cpu = refine(device_param), refine("cpu")
    assert {v.device.type for v in here.states[0].values()} == {device_param}
    assert [loss for _, loss in here.history] == pytest.approx([loss for _, loss in cpu.history], rel=1e-3)


def test_running_out_of_device_memory_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """A GPU too small for the models: exit 1, one line with the way out, no output directory."""
    import fedbasin.alignment
    from fedbasin.checkpoint import save_checkpoint
    from fedbasin.cli import main
    from tests.helpers import DIGITS_VIT, trained_digits_vit

    save_checkpoint(tmp_path / "m", "vit", DIGITS_VIT, trained_digits_vit(0))

    def too_large(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.1 GiB total)")

    monkeypatch.setattr(fedbasin.alignment, "weight_match", too_large)
    assert main(["align", str(tmp_path / "m"), str(tmp_path / "m"), "--out", str(tmp_path / "out"),
                 "--device", "auto"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [("fedbasin align: out of GPU memory (CUDA out of memory. Tried to allocate 20.00 GiB "
                      "(GPU 0; 79.1 GiB total)); nothing was written; try --device cpu")]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_norm_gains_on_device(device):
    """The tiny-gain rule (norm bias folded into the readers' biases, γ = 1 in the gauge) runs where
    the tensors are and gives the CPU's merge of noisy copies of a model with gains 1e-3 and 0."""
    from tests.helpers import VIT, spec_of
    from tests.test_tiny_gains import noisy, tiny_gain_model

    spec = spec_of("vit", VIT)
    models = noisy(tiny_gain_model(torch.float64), 3, 0.006, seed=0)
    cpu = merge(spec, models, iterations=3)
    on = merge(spec, [{k: v.to(device) for k, v in m.items()} for m in models], iterations=3)
    assert {v.device.type for v in on.state.values()} == {device}
    assert max(float((on.state[k].cpu() - cpu.state[k]).abs().max()) for k in cpu.state) < 1e-6
    assert all(bool(torch.isfinite(v).all()) for v in on.state.values())


@pytest.mark.parametrize("device", DEVICES)
def test_token_rows_from_the_weights_on_device(device):
    """The data-free default ``token_rows="auto"`` on states held on ``device``: the rows are judged on
    the CPU (a statistic of the weights), the match runs on the device and recovers the planted
    symmetry as on the CPU."""
    from .test_token_rows_auto import _error, _planted_pair

    spec, ref, cand, _ = _planted_pair()
    on = lambda s: {k: v.to(device) for k, v in s.items()}
    here = weight_match(spec, on(ref), on(cand), token_rows="auto", iterations=20, tol=0.0)
    cpu = weight_match(spec, ref, cand, token_rows="auto", iterations=20, tol=0.0)
    assert {v.device.type for v in here.state.values()} == {device}
    assert here.token_rows == cpu.token_rows
    assert _error({k: v.cpu() for k, v in here.state.items()}, ref) < 1e-3
    merged = merge(spec, [on(ref), on(cand)], token_rows="auto", iterations=20, tol=0.0)
    assert {v.device.type for v in merged.state.values()} == {device}
    assert merged.token_rows[1] == cpu.token_rows
