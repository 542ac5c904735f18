"""The distillation levers of issue 7 item 6: the supervised term on the proxy labels
(``distill-label-weight``), augmented transfer views (``distill-augment``), the teacher that
averages probabilities instead of logits (``distill-teacher``), and the one-shot
driver's cache of trained clients that lets server-side options be compared on the same clients."""

from __future__ import annotations

import types

import pytest
import torch

from fedbasin.alignment import average_states
from fedbasin.alignment.proxy import proxy_streams
from fedbasin.config import resolve_run_config
from fedbasin.data import Split, load_task
from fedbasin.models import build_model
from fedbasin.server.distill import (
    LogitEnsemble,
    distillation_loss,
    ensemble_distill,
    random_crop_flip,
    random_mixup,
    transfer_batches,
)
from fedbasin.server.server_app import distill_augment, make_distiller
from fedbasin.training import cross_entropy
from tests.helpers import DIGITS_VIT, trained_digits_vit
from tests.test_distill import selection_loss as mean_loss


def distill(start, teachers, transfer, **options):
    """40 steps over the fixed transfer batches, scored (keep-best) on those batches themselves."""
    return ensemble_distill(build_model("vit", DIGITS_VIT), start, teachers, cross_entropy, iter(transfer * 4),
                            transfer, steps=40, lr=3e-3, eval_every=40, **options)


@pytest.fixture(scope="module")
def setting():
    task = load_task("digits", seed=0, proxy_size=300)
    teachers = [trained_digits_vit(seed) for seed in range(3)]
    data = proxy_streams(task.proxy, 16, seed=0)
    transfer = [next(data.batches) for _ in range(10)]  # 160 labelled proxy images, fixed order
    return teachers, transfer


def test_the_label_term_enters_the_objective_and_lowers_the_proxy_cross_entropy(setting):
    """w = 0: the proxy labels play no part (from the collapsed average of three clients,
    scrambled labels give the identical student); w = 1: the teachers play no part (other
    teachers give the identical student). From a trained client, on the labelled transfer images
    (also the keep-best split here, so no run ends above its start), the mixed objective lowers the
    cross-entropy more than pure distillation and the supervised one lowers it most."""
    teachers, transfer = setting
    average = average_states(teachers, [1.0] * 3)
    scrambled = [(x, torch.roll(y, 1)) for x, y in transfer]
    pure = distill(average, teachers, transfer, label_weight=0.0)
    assert pure.best_step == 40
    assert all(torch.equal(pure.state[k], distill(average, teachers, scrambled).state[k]) for k in average)
    client = trained_digits_vit(3)
    runs = {w: distill(client, teachers, transfer, label_weight=w) for w in (0.0, 0.5, 1.0)}
    other_teachers = distill(client, teachers[:1], transfer, label_weight=1.0)
    assert all(torch.equal(runs[1.0].state[k], other_teachers.state[k]) for k in client)
    ce = {w: mean_loss(r.state, transfer) for w, r in runs.items()}
    # measured: 0.733 (w = 0), 0.681 (w = 0.5), 0.674 (w = 1); with the scalar ATen kernels
    # (ATEN_CPU_CAPABILITY=default) 0.726, 0.677, 0.665
    assert ce[0.0] <= mean_loss(client, transfer) + 1e-6
    assert ce[1.0] < ce[0.5] < ce[0.0] - 0.02, ce
    with pytest.raises(ValueError, match=r"label_weight must be a number in \[0, 1\], got 1.5"):
        distill(client, teachers, transfer, label_weight=1.5)


def test_random_crop_flip_returns_shifted_and_mirrored_windows_of_each_image():
    x = torch.randn(64, 3, 8, 8)
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(random_crop_flip(pad=0, flip=False)(x, generator), x)
    views = random_crop_flip(pad=2, flip=True)(x, generator)
    assert views.shape == x.shape
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    mirrored = 0
    for i in range(len(x)):
        windows = [padded[i, :, dy:dy + 8, dx:dx + 8] for dy in range(5) for dx in range(5)]
        plain = any(torch.equal(views[i], w) for w in windows)
        flipped = any(torch.equal(views[i], w.flip(-1)) for w in windows)
        assert plain or flipped
        mirrored += flipped and not plain
    assert 16 < mirrored < 48  # about half are mirrored
    again = random_crop_flip(pad=2, flip=True)(x, torch.Generator().manual_seed(0))
    assert torch.equal(again, random_crop_flip(pad=2, flip=True)(x, torch.Generator().manual_seed(0)))
    assert not torch.equal(again, x)
    with pytest.raises(ValueError, match=r"needs image batches \(N, C, H, W\), got shape \(4, 64\)"):
        random_crop_flip()(torch.zeros(4, 64), generator)


def test_augmented_distillation_trains_on_views_and_the_run_config_refuses_non_images(setting):
    teachers, transfer = setting
    start = average_states(teachers, [1.0] * 3)
    seen = []

    def recording(x, generator):
        seen.append(x.shape)
        return random_crop_flip(pad=1)(x, generator)

    plain = distill(start, teachers, transfer)
    augmented = distill(start, teachers, transfer, augment=recording)
    assert len(seen) == 40 and not torch.equal(plain.state["head.weight"], augmented.state["head.weight"])
    config = resolve_run_config({"proxy-size": 50, "distill-steps": 5, "distill-augment": "crop-flip"})
    digits = load_task("digits", seed=0, proxy_size=50)
    assert distill_augment(digits, config) is not None
    assert distill_augment(digits, {**config, "distill-augment": "none"}) is None
    # the ServerApp's distiller honours the run config: augmented views change the student
    students = [make_distiller(build_model("vit", DIGITS_VIT), digits, {**config, "distill-augment": augment})(
        start, teachers).state["head.weight"] for augment in ("none", "crop", "none")]
    assert torch.equal(students[0], students[2]) and not torch.equal(students[0], students[1])
    text = types.SimpleNamespace(name="text", data="text", train=Split(torch.zeros(4, 64, dtype=torch.long), torch.zeros(4, 64)))
    with pytest.raises(ValueError, match=r"distill-augment='crop-flip' needs image data .* shape \(64,\)"):
        distill_augment(text, config)
    with pytest.raises(ValueError, match="distill-label-weight=1.5 must be at most 1.0"):
        resolve_run_config({"distill-label-weight": 1.5})
    with pytest.raises(ValueError, match="distill-augment='rotate'; expected one of"):
        resolve_run_config({"distill-augment": "rotate"})


def test_one_shot_reuses_cached_clients_only_when_every_client_setting_matches(tmp_path):
    from fedbasin.benchmarks import oneshot

    base = {**oneshot.ONESHOT_DEFAULTS, "local-epochs": 2, "max-train-examples": 300, "align-iterations": 2,
            "proxy-size": 60, "refine-steps": 0, "distill-steps": 0}
    first = oneshot.one_shot(resolve_run_config(base), 2, progress=False, cache=tmp_path)
    assert not first["clients_from_cache"] and len(list(tmp_path.glob("clients-*.pt"))) == 1
    server_side = resolve_run_config({**base, "distill-steps": 5, "distill-label-weight": 0.5})
    again = oneshot.one_shot(server_side, 2, progress=False, cache=tmp_path)
    assert again["clients_from_cache"] and again["client_accuracy"] == first["client_accuracy"]
    assert again["fedavg"] == first["fedavg"] and again["aligned_distilled"] != "—"
    other = oneshot.one_shot(resolve_run_config({**base, "local-epochs": 3}), 2, progress=False, cache=tmp_path)
    assert not other["clients_from_cache"] and len(list(tmp_path.glob("clients-*.pt"))) == 2
    fresh = oneshot.one_shot(resolve_run_config(base), 2, progress=False)  # no cache: trained again, identically
    assert fresh["client_accuracy"] == first["client_accuracy"]
    for path in tmp_path.glob("clients-*.pt"):
        path.write_bytes(b"damaged")  # an unreadable cache is retrained and replaced, never trusted
    damaged = oneshot.one_shot(resolve_run_config(base), 2, progress=False, cache=tmp_path)
    assert not damaged["clients_from_cache"] and damaged["client_accuracy"] == first["client_accuracy"]
    assert oneshot.one_shot(resolve_run_config(base), 2, progress=False, cache=tmp_path)["clients_from_cache"]


def test_reproduce_cifar10_section_tables_every_distillation_variant_per_partition(tmp_path):
    """The section reads one results file per variant (computed only when missing) and lays
    the rows out partition by partition, variant by variant."""
    import argparse
    import json

    from fedbasin.benchmarks import reproduce

    for i, (name, _, _) in enumerate(reproduce.ONESHOT_CIFAR10_VARIANTS):
        rows = [{"partitioner": p, "best_client": 0.3, "fedavg": 0.1, "aligned_orthogonal": 0.2,
                 "aligned_distilled": f"{0.31 + i / 100:.4f}", "fedavg_distilled": "0.3000", "ensemble": 0.33,
                 "aligned_distilled_summary": {"seconds": 60.0 + i}} for p in ("iid", "dirichlet(0.5)")]
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": rows}))
    table = reproduce.section_oneshot_cifar10(argparse.Namespace(cifar="unused", rerun=False), tmp_path)
    lines = table.splitlines()[2:]
    variants = len(reproduce.ONESHOT_CIFAR10_VARIANTS)
    assert len(lines) == 2 * variants
    assert all(line.startswith("| iid |") for line in lines[:variants])
    assert lines[variants].startswith("| dirichlet(0.5) | KL, 500 steps | 0.3000 | 0.1000 | 0.2000 | 0.3100 |")
    assert lines[-1].endswith(f"| {0.31 + (variants - 1) / 100:.4f} | 0.3000 | 0.3300 | {59 + variants} |")


def test_further_rounds_continue_only_the_named_merges_and_bad_names_are_refused_before_training(tmp_path, capsys):
    """``--further-from distilled``: the further rounds start from the distilled aligned merge
    (round 1 is that merge's own accuracy) next to FedAvg from a shared init, and no other arm
    is trained; a name that is unknown or whose merge is not computed is one line, exit 2."""
    from fedbasin.benchmarks import oneshot

    config = resolve_run_config({**oneshot.ONESHOT_DEFAULTS, "local-epochs": 4, "max-train-examples": 300,
                                 "align-iterations": 2, "proxy-size": 60, "distill-steps": 10,
                                 "refine-steps": 0})
    row = oneshot.one_shot(config, 2, progress=False, rounds=1, further_epochs=2, further_from=("distilled",))
    further = row["further"]
    assert list(further) == ["aligned (orth) + distilled", "FedAvg, shared init"]
    assert further["aligned (orth) + distilled"]["epochs"] == [4, 2]
    assert further["FedAvg, shared init"]["epochs"] == [3, 3]
    assert further["aligned (orth) + distilled"]["accuracy"][0] == pytest.approx(float(row["aligned_distilled"]),
                                                                                 abs=5e-5)
    assert len(oneshot.further_markdown([row]).splitlines()) == 2 + 2
    for argv, message in (
        (["--further-rounds", "1", "--further-from", "distilled"], "--further-from distilled: that merge needs "
         "run-config distill-steps > 0"),
        (["--further-rounds", "1", "--further-from", "learned"], "--further-from learned: that merge needs "
         "run-config refine-steps > 0, or auto with a budget and a proxy split"),  # auto, but no proxy split
        (["--further-rounds", "1", "--further-from", "fedavg,best"], "--further-from 'best': expected one of fedavg"),
        (["--further-from", "fedavg"], "--further-from needs --further-rounds >= 1"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            oneshot.main([*argv, "--run-config", "local-epochs=20", "--out", str(tmp_path / "out.json")])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err.strip().splitlines()[-1] and "Traceback" not in err
    with pytest.raises(ValueError, match="--further-from learned: that merge needs run-config refine-steps > 0"):
        oneshot.one_shot(config, 2, progress=False, rounds=1, further_from=("learned",))
    assert not (tmp_path / "out.json").exists()


def test_reproduce_cifar10_seeds_section_tables_each_seed_the_mean_and_the_probability_teacher(tmp_path):
    """Seed 0 from the oneshot-cifar10 section's file of the same setting, seeds 1-2 one file per
    partition, the probability-teacher runs one file per seed and partition (all read, not
    recomputed, when present): a line per partition and seed, mean ± sd per partition, and the
    teachers side by side with their own mean ± sd."""
    import argparse
    import json

    from fedbasin.benchmarks import reproduce

    def row(label, seed, distilled):
        return {"data": "cifar10:x", "partitioner": label, "best_client": 0.30 + seed / 100, "fedavg": 0.1,
                "aligned_orthogonal": 0.2, "aligned_distilled": f"{distilled:.4f}", "fedavg_distilled": "0.3000",
                "ensemble": 0.33, "ensemble_probabilities": 0.36}

    section = tmp_path / "oneshot-cifar10-seeds"
    (tmp_path / "oneshot-cifar10").mkdir()
    section.mkdir()
    (tmp_path / "oneshot-cifar10" / f"{reproduce.ONESHOT_CIFAR10_VARIANTS[-1][0]}.json").write_text(
        json.dumps({"rows": [row("iid", 0, 0.31), row("dirichlet(0.5)", 0, 0.31)]}))
    for seed in reproduce.ONESHOT_SEEDS:
        for partition, label in (("iid", "iid"), ("dirichlet", "dirichlet(0.5)")):
            if seed:
                (section / f"seed{seed}_{partition}.json").write_text(
                    json.dumps({"rows": [row(label, seed, 0.31 + seed / 50)]}))
            if seed in reproduce.ONESHOT_CIFAR10_PROBABILITY_SEEDS:
                (section / f"prob_seed{seed}_{partition}.json").write_text(
                    json.dumps({"rows": [row(label, seed, 0.35 + seed / 100)]}))
    text = reproduce.section_oneshot_cifar10_seeds(argparse.Namespace(cifar="unused", rerun=False), section)
    lines = text.splitlines()
    assert lines[2] == "| iid | 0 | 0.3000 | 0.1000 | 0.2000 | 0.3100 | 0.3000 | 0.3300 |"
    assert lines[7] == "| dirichlet(0.5) | 2 | 0.3200 | 0.1000 | 0.2000 | 0.3500 | 0.3000 | 0.3300 |"
    assert ("| iid | 0.310 ± 0.010 | 0.100 ± 0.000 | 0.200 ± 0.000 | 0.330 ± 0.020 | 0.300 ± 0.000 "
            "| 0.330 ± 0.000 |") in lines
    assert reproduce.ONESHOT_CIFAR10_PROBABILITY_SEEDS == (0, 1, 2)
    teachers = lines.index("| partition | seed | best client | aligned + distilled (logit teacher) | aligned + "
                           "distilled (probability teacher) | FedAvg + distilled (probability teacher) | logit "
                           "ensemble | probability ensemble |")
    assert lines[teachers + 2:teachers + 8] == [
        "| iid | 0 | 0.3000 | 0.3100 | 0.3500 | 0.3000 | 0.3300 | 0.3600 |",
        "| iid | 1 | 0.3100 | 0.3300 | 0.3600 | 0.3000 | 0.3300 | 0.3600 |",
        "| iid | 2 | 0.3200 | 0.3500 | 0.3700 | 0.3000 | 0.3300 | 0.3600 |",
        "| dirichlet(0.5) | 0 | 0.3000 | 0.3100 | 0.3500 | 0.3000 | 0.3300 | 0.3600 |",
        "| dirichlet(0.5) | 1 | 0.3100 | 0.3300 | 0.3600 | 0.3000 | 0.3300 | 0.3600 |",
        "| dirichlet(0.5) | 2 | 0.3200 | 0.3500 | 0.3700 | 0.3000 | 0.3300 | 0.3600 |"]
    assert lines[-4:] == ["| partition | best client | aligned + distilled | FedAvg + distilled | probability ensemble |",
                          "|---|---|---|---|---|",
                          "| iid | 0.310 ± 0.010 | 0.360 ± 0.010 | 0.300 ± 0.000 | 0.360 ± 0.000 |",
                          "| dirichlet(0.5) | 0.310 ± 0.010 | 0.360 ± 0.010 | 0.300 ± 0.000 | 0.360 ± 0.000 |"]


class Fixed(torch.nn.Module):
    """A "model" that returns the same logits for every input."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.tensor(logits)

    def forward(self, x):
        return self.logits.expand(len(x), -1)


def test_the_probability_teacher_is_the_log_mean_probability_and_one_confident_member_cannot_outvote_three():
    """Member 0 is sure of class 0 (logit 10); members 1-3 mildly prefer class 1 (logit 2). Mean
    logits (2.5 vs 1.5) follow member 0; mean probabilities (0.33 vs 0.59) follow the majority."""
    members = [Fixed([10.0, 0.0, 0.0])] + [Fixed([0.0, 2.0, 0.0]) for _ in range(3)]
    x = torch.zeros(2, 1)
    assert LogitEnsemble(members)(x).argmax(-1).tolist() == [0, 0]
    votes = LogitEnsemble(members, combine="probabilities")(x)
    expected = torch.stack([m(x).softmax(-1) for m in members]).mean(0)
    torch.testing.assert_close(votes.exp(), expected, rtol=1e-6, atol=1e-7)
    assert votes.argmax(-1).tolist() == [1, 1]
    with pytest.raises(ValueError, match="ensemble combine='median'; expected one of logits, probabilities"):
        LogitEnsemble(members, combine="median")
    with pytest.raises(ValueError, match="distill-teacher='median'; expected one of"):
        resolve_run_config({"distill-teacher": "median"})


def test_distillation_follows_the_chosen_teacher_and_the_run_config_reaches_it(setting):
    """One of three digits teachers made over-confident (its logits × 10, same predictions):
    the student distilled from the probability ensemble ends closer to that ensemble than the
    student distilled from the logit ensemble does, and vice versa; the ServerApp's distiller
    passes ``distill-teacher`` through."""
    teachers, transfer = setting
    loud = {k: v * 10 if k.startswith("head.") else v for k, v in teachers[0].items()}
    teachers = [loud, *teachers[1:]]
    start = average_states(teachers, [1.0] * 3)
    model = build_model("vit", DIGITS_VIT)
    members = []
    for state in teachers:
        member = build_model("vit", DIGITS_VIT)
        member.load_state_dict(state)
        members.append(member.eval())
    x = torch.cat([batch for batch, _ in transfer])
    with torch.no_grad():
        targets = {combine: LogitEnsemble(members, combine)(x) for combine in ("logits", "probabilities")}
    students = {}
    for combine in targets:  # 100 steps over the 160 transfer images, kept (keep-best) at step 100
        result = ensemble_distill(model, start, teachers, cross_entropy, iter(transfer * 10), transfer, steps=100,
                                  lr=3e-3, eval_every=100, teacher=combine)
        assert result.best_step == 100
        students[combine] = result.state

    def gap(student, combine):
        model.load_state_dict(students[student])
        with torch.no_grad():
            return float(distillation_loss(model.eval()(x), targets[combine], 1.0))

    # seed 0 measured: KL to the probability ensemble 0.681 vs 0.710, to the logit ensemble 1.033 vs 1.250
    assert gap("probabilities", "probabilities") < gap("logits", "probabilities") - 0.01
    assert gap("logits", "logits") < gap("probabilities", "logits") - 0.1
    digits = load_task("digits", seed=0, proxy_size=300)
    config = resolve_run_config({"proxy-size": 300, "distill-steps": 20})
    by_config = [make_distiller(build_model("vit", DIGITS_VIT), digits, {**config, "distill-teacher": combine})(
        start, teachers).state["head.weight"] for combine in ("logits", "probabilities")]
    assert not torch.equal(*by_config)


def test_reproduce_cifar10_long_distillation_section_reads_every_seed_and_partition(tmp_path):
    """The longer-distillation section reads one results file per seed and partition (computed
    only when missing), on the run config it names, and tables them with their mean ± sd."""
    import argparse
    import json

    from fedbasin.benchmarks import reproduce

    assert "distill-steps=3000" in reproduce.ONESHOT_CIFAR10_LONG
    section = tmp_path / "oneshot-cifar10-long"
    section.mkdir()
    for seed in reproduce.ONESHOT_SEEDS:
        for partition, label in (("iid", "iid"), ("dirichlet", "dirichlet(0.5)")):
            row = {"partitioner": label, "best_client": 0.30 + seed / 100, "fedavg": 0.1, "aligned_orthogonal": 0.2,
                   "aligned_distilled": f"{0.36 + seed / 100:.4f}", "fedavg_distilled": "0.3500",
                   "ensemble_probabilities": 0.37, "aligned_distilled_summary": {"seconds": 290.4}}
            (section / f"seed{seed}_{partition}.json").write_text(json.dumps({"rows": [row]}))
    lines = reproduce.section_oneshot_cifar10_long(argparse.Namespace(cifar="unused", rerun=False),
                                                   section).splitlines()
    assert lines[2] == "| iid | 0 | 0.3000 | 0.1000 | 0.2000 | 0.3600 | 0.3500 | 0.3700 | 290 |"
    assert lines[7] == "| dirichlet(0.5) | 2 | 0.3200 | 0.1000 | 0.2000 | 0.3800 | 0.3500 | 0.3700 | 290 |"
    assert lines[-1] == ("| dirichlet(0.5) | 0.310 ± 0.010 | 0.100 ± 0.000 | 0.200 ± 0.000 | 0.370 ± 0.010 "
                         "| 0.350 ± 0.000 | 0.370 ± 0.000 |")


def test_mixup_views_are_convex_mixes_of_two_images_of_the_batch_and_refuse_token_ids():
    x = torch.randn(6, 1, 8, 8)
    views = random_mixup()(x, torch.Generator().manual_seed(3))
    replay = torch.Generator().manual_seed(3)  # the same draws: λ_i, then the partner permutation
    weight, partner = torch.rand(6, generator=replay), torch.randperm(6, generator=replay)
    for i in range(6):
        expected = weight[i] * x[i] + (1 - weight[i]) * x[partner[i]]
        assert torch.allclose(views[i], expected, atol=1e-6)
    assert 0 < float(weight.min()) and float(weight.max()) < 1 and not torch.equal(views, x)
    assert torch.equal(views, random_mixup()(x, torch.Generator().manual_seed(3)))  # seeded: the same views
    with pytest.raises(ValueError, match="mixes continuous inputs"):
        random_mixup()(torch.zeros(4, 64, dtype=torch.long), torch.Generator())


def test_mixup_mixes_the_labels_as_the_inputs_and_the_label_term_is_their_cross_entropy():
    x, y = torch.randn(6, 1, 8, 8), torch.tensor([0, 1, 2, 2, 3, 4])
    views, mixed = random_mixup()(x, torch.Generator().manual_seed(5), y)
    replay = torch.Generator().manual_seed(5)
    weight, partner = torch.rand(6, generator=replay), torch.randperm(6, generator=replay)
    logits = torch.randn(6, 10)
    expected = -(weight * torch.log_softmax(logits, -1)[torch.arange(6), y]
                 + (1 - weight) * torch.log_softmax(logits, -1)[torch.arange(6), y[partner]]).mean()
    assert torch.allclose(cross_entropy(logits, mixed), expected, atol=1e-6)
    assert torch.equal(views, random_mixup()(x, torch.Generator().manual_seed(5)))  # the same views either way
    # the transfer batches carry the mixed labels; other views keep theirs
    (batch,) = transfer_batches([(x, y)], 1, random_mixup(), seed=5)
    assert torch.equal(batch[0], views) and torch.equal(batch[1], mixed)
    (batch,) = transfer_batches([(x, y)], 1, random_crop_flip(pad=1), seed=5)
    assert torch.equal(batch[1], y)


def test_augment_auto_is_mixup_for_images_and_nothing_for_text(setting):
    teachers, _ = setting
    start = average_states(teachers, [1.0] * 3)
    digits = load_task("digits", seed=0, proxy_size=50)
    config = resolve_run_config({"proxy-size": 50, "distill-steps": 5})
    assert config["distill-augment"] == "auto"
    x = digits.train.inputs[:8]
    auto = distill_augment(digits, config)(x, torch.Generator().manual_seed(0))
    assert torch.equal(auto, random_mixup()(x, torch.Generator().manual_seed(0)))
    crop_mix = distill_augment(digits, {**config, "distill-augment": "crop-flip-mixup"})(x, torch.Generator())
    assert crop_mix.shape == x.shape
    text = types.SimpleNamespace(name="text", data="text", train=Split(torch.zeros(4, 64, dtype=torch.long),
                                                                         torch.zeros(4, 64)))
    assert distill_augment(text, config) is None  # auto never refuses
    # the ServerApp's distiller trains on the mixed views (with their mixed labels): another student
    students = [make_distiller(build_model("vit", DIGITS_VIT), digits,
                               {**config, "distill-augment": augment, "distill-label-weight": 0.5})(
        start, teachers).state["head.weight"] for augment in ("none", "auto")]
    assert torch.isfinite(students[1]).all() and not torch.equal(students[0], students[1])


def test_learning_rate_and_temperature_auto_follow_the_model_kind(setting):
    """``distill-lr`` / ``distill-temperature`` = auto: an image classifier's student is bitwise the one
    of the pinned image values (the rate its 5 steps size, 0.0005; temperature 3) and differs from the
    language-model values' (0.001, 1), which are what a subword or character LM resolves to; a pinned value
    overrides auto for either kind."""
    from fedbasin.server.server_app import distill_options

    teachers, _ = setting
    start = average_states(teachers, [1.0] * 3)
    digits = load_task("digits", seed=0, proxy_size=50)
    config = resolve_run_config({"proxy-size": 50, "distill-steps": 5})
    assert (config["distill-lr"], config["distill-temperature"]) == ("auto", "auto")

    def student(**pinned):
        return make_distiller(build_model("vit", DIGITS_VIT), digits, {**config, **pinned})(start, teachers).state

    auto, image, language = student(), student(**{"distill-lr": 0.0005, "distill-temperature": 3.0}), student(
        **{"distill-lr": 0.001, "distill-temperature": 1.0})
    assert all(torch.equal(auto[k], image[k]) for k in auto)
    assert not torch.equal(auto["head.weight"], language["head.weight"])
    text = types.SimpleNamespace(data="text")
    for vocabulary in (50257, 65):  # a subword and a character LM
        lm = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=vocabulary))
        options = distill_options(text, config, lm)
        assert (options.lr, options.temperature, options.label_weight, options.augment) == (0.001, 1.0, 0.0, "none")
        assert distill_options(text, {**config, "distill-temperature": 2.0}, lm).temperature == 2.0
    assert distill_options(digits, config).temperature == 3.0


def test_an_image_classifiers_distillation_rate_is_sized_by_the_steps_it_takes(setting):
    """The image rate (auto): 0.0005 up to 250 steps, 0.002 from 1,500, geometric in between (0.001 at their
    geometric mean). ``ensemble_distill`` given the rate trains bitwise as with the number it gives for the
    run's steps and records it; a run sized by its budget takes the rate of the steps it was sized to."""
    import math

    from fedbasin.options import IMAGE, IMAGE_DISTILL_RATE, DistillOptions, resolve_distill

    rate = resolve_distill(DistillOptions(), IMAGE).lr
    assert rate is IMAGE_DISTILL_RATE
    assert rate(1) == rate(250) == 0.0005 and rate(1500) == rate(10**6) == 0.002
    assert rate(round(math.sqrt(250 * 1500))) == pytest.approx(0.001, rel=1e-3)
    assert all(rate(t) < rate(t + 50) for t in range(250, 1500, 50))
    teachers, transfer = setting
    start = average_states(teachers, [1.0] * 3)
    sized, pinned = (ensemble_distill(build_model("vit", DIGITS_VIT), start, teachers, cross_entropy,
                                      iter(transfer * 4), transfer, steps=40, lr=lr, eval_every=40)
                     for lr in (rate, rate(40)))
    assert sized.lr == pinned.lr == 0.0005 and sized.best_step > 0 and sized.summary()["lr"] == 0.0005
    assert all(torch.equal(sized.state[k], pinned.state[k]) for k in sized.state)
    planned = []  # the steps the rate was asked for: the budget's plan, however many steps the clock then allowed
    budgeted = ensemble_distill(build_model("vit", DIGITS_VIT), start, teachers, cross_entropy, iter(transfer * 400),
                                transfer, steps=None, budget=1.0, lr=lambda steps: planned.append(steps) or 1e-3 / steps)
    assert len(planned) == 1 and planned[0] > 0 and budgeted.lr == 1e-3 / planned[0]
    assert 0 < budgeted.steps <= planned[0]
