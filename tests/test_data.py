"""Data sources, partitioning and the shared train/evaluate loop (offline, local files only)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from fedbasin.data import Split, load_task
from fedbasin.models import build_model
from fedbasin.training import evaluate, train

SHARED_CIFAR = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10"


def test_digits_task():
    task = load_task("digits", proxy_size=40)
    assert task.family == "vit"
    assert task.model_overrides == {
        "image_size": 8,
        "patch_size": 2,
        "channels": 1,
        "num_classes": 10,
    }
    assert len(task.train) + len(task.test) + len(task.proxy) == 1797
    assert task.train.inputs.shape[1:] == (1, 8, 8) and task.train.inputs.dtype == torch.float32
    assert 0.0 <= float(task.train.inputs.min()) and float(task.train.inputs.max()) <= 1.0
    assert load_task("digits", proxy_size=40) is task  # cached per process


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_partitions_are_disjoint_and_cover_the_training_split(scheme):
    task = load_task("digits")
    parts = [task.partition(4, i, scheme, alpha=0.3) for i in range(4)]
    rows = torch.cat([p.inputs.flatten(1) for p in parts])
    assert len(rows) == len(task.train)
    assert len(torch.unique(rows, dim=0)) == len(torch.unique(task.train.inputs.flatten(1), dim=0))
    counts = torch.stack([p.targets.bincount(minlength=10) for p in parts]).float()
    shares = counts / counts.sum(0)
    if scheme == "iid":
        assert shares.max() < 0.45 and max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
    else:  # Dir(0.3): some class is concentrated on one partition
        assert shares.max() > 0.5
    with pytest.raises(ValueError, match="partition-id 4 is outside"):
        task.partition(4, 4)


def _digit_indices(split) -> list[int]:
    """Row numbers in scikit-learn's digits of a split's images (the 1,797 images are distinct)."""
    from sklearn.datasets import load_digits

    images = (torch.tensor(load_digits().images, dtype=torch.float32) / 16.0).flatten(1)
    row = {tuple(r): i for i, r in enumerate(images.tolist())}
    return sorted(row[tuple(r)] for r in split.inputs.flatten(1).tolist())


DIGITS_TEST_SHA256 = "b33a921fd4c0b19c424d7e5c119aba4359068943ae853ede12ebff793c319210"


def test_digits_test_split_is_pinned_and_independent_of_the_seed():
    test = _digit_indices(load_task("digits").test)
    assert len(test) == 359 and test[:8] == [10, 14, 21, 22, 26, 27, 33, 34]
    assert hashlib.sha256(str(test).encode()).hexdigest() == DIGITS_TEST_SHA256
    for seed in range(4):
        task = load_task("digits", seed=seed, proxy_size=50)
        assert _digit_indices(task.test) == test
        seen = _digit_indices(task.train) + _digit_indices(task.proxy)
        assert not set(seen) & set(test) and len(seen) + len(test) == 1797


def write_cifar_like(path: Path, n: int, seed: int, by_class: bool = False) -> None:
    """A parquet file with the hub's CIFAR-10 features (``img``: Image, ``label``: ClassLabel);
    ``by_class``: rows stored ordered by label (as in the shared copy)."""
    from datasets import ClassLabel, Dataset, Features, Image

    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(n)]
    features = Features({"img": Image(), "label": ClassLabel(num_classes=10)})
    labels = [i * 10 // n if by_class else i % 10 for i in range(n)]
    Dataset.from_dict({"img": images, "label": labels}, features=features).to_parquet(str(path))


def test_cifar10_from_local_parquet(tmp_path):
    write_cifar_like(tmp_path / "train.parquet", 40, 0)
    write_cifar_like(tmp_path / "test.parquet", 20, 1)
    task = load_task(f"cifar10:{tmp_path}")
    assert (len(task.train), len(task.test)) == (40, 20)
    assert task.train.inputs.shape[1:] == (3, 32, 32) and task.train.inputs.dtype == torch.uint8
    assert task.model_overrides["num_classes"] == 10 and task.model_overrides["image_size"] == 32
    x, _ = next(task.test.batches(8))
    assert x.dtype == torch.float32 and x.shape == (8, 3, 32, 32) and abs(float(x.mean())) < 1.0

    single = load_task(f"cifar10:{tmp_path / 'train.parquet'}", test_fraction=0.25)
    assert (len(single.train), len(single.test)) == (30, 10)
    for seed in (1, 2):  # the held-out quarter does not move with the run's seed
        other = load_task(f"cifar10:{tmp_path / 'train.parquet'}", test_fraction=0.25, seed=seed)
        assert torch.equal(other.test.inputs, single.test.inputs)
        pixels = {bytes(x.numpy()) for x in single.test.inputs}
        assert not pixels & {bytes(x.numpy()) for x in other.train.inputs}
    with pytest.raises(FileNotFoundError, match="neither a directory nor a parquet file"):
        load_task(f"cifar10:{tmp_path / 'nothing'}")


def test_cifar10_decodes_the_same_pixels_as_datasets_and_names_bad_rows(tmp_path):
    """The parquet images are decoded by PIL to exactly the pixels ``datasets`` gives; a parquet
    without the hub's columns, or a row that is not a 32x32 image, is refused naming the file and row."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import load_dataset

    write_cifar_like(tmp_path / "train.parquet", 300, 0)
    write_cifar_like(tmp_path / "test.parquet", 20, 1)
    task = load_task(f"cifar10:{tmp_path}", seed=5)
    stored = load_dataset("parquet", data_files=str(tmp_path / "train.parquet"))["train"].with_format("numpy")[:]
    order = torch.randperm(300, generator=torch.Generator().manual_seed(5))
    assert torch.equal(task.train.inputs, torch.from_numpy(stored["img"]).permute(0, 3, 1, 2)[order])
    assert torch.equal(task.train.targets, torch.from_numpy(stored["label"]).long()[order])

    bad = tmp_path / "bad"
    bad.mkdir()
    table = pq.read_table(tmp_path / "test.parquet")
    pq.write_table(table.drop(["img"]), bad / "train.parquet")
    pq.write_table(table, bad / "test.parquet")
    with pytest.raises(ValueError, match=r"train\.parquet: not a CIFAR-10 parquet file with columns 'img' and 'label'"):
        load_task(f"cifar10:{bad}")
    cells = table.column("img").to_pylist()
    cells[3] = {"bytes": b"not an image", "path": None}
    pq.write_table(table.set_column(0, "img", pa.array(cells, table.schema.field("img").type)), bad / "train.parquet")
    with pytest.raises(ValueError, match=r"train\.parquet: row 3: the image does not decode"):
        load_task(f"cifar10:{bad}")


def test_cifar10_test_split_stored_by_class_is_mixed(tmp_path):
    """Evaluation subsets are test-split prefixes: each must sample every class, with the split's
    examples unchanged."""
    write_cifar_like(tmp_path / "train.parquet", 40, 0)
    write_cifar_like(tmp_path / "test.parquet", 200, 1, by_class=True)
    test = load_task(f"cifar10:{tmp_path}").test
    assert (test.targets[:50].bincount(minlength=10) > 0).all()
    assert test.targets.bincount(minlength=10).tolist() == [20] * 10
    assert torch.equal(load_task(f"cifar10:{tmp_path}", seed=3).test.inputs, test.inputs)  # fixed order


@pytest.mark.skipif(not (SHARED_CIFAR / "test.parquet").is_file(), reason="no local CIFAR-10 copy")
def test_shared_cifar10_copy_is_shuffled_before_partitioning():
    task = load_task(f"cifar10:{SHARED_CIFAR / 'test.parquet'}", max_train_examples=2000)
    assert len(task.train) == 2000  # rows are stored ordered by class; a slice must still mix them
    assert (task.partition(4, 0).targets.bincount(minlength=10) > 0).all()
    # the barrier table scores the first 2,000 test images: all ten classes, none below 150
    test = load_task(f"cifar10:{SHARED_CIFAR}").test
    assert test.targets[:2000].bincount(minlength=10).min() >= 150


def test_text_task_char_level(tmp_path):
    text = "to be or not to be, that is the question\n" * 20
    (tmp_path / "t.txt").write_text(text)
    task = load_task(f"text:{tmp_path / 't.txt'}", block_size=8)
    assert task.family == "gpt"
    assert task.model_overrides == {"vocab_size": len(set(text)), "block_size": 8}
    assert task.train.inputs.shape[1] == 8 and torch.equal(
        task.train.inputs[:, 1:], task.train.targets[:, :-1]
    )
    assert task.tokenizer.decode(task.tokenizer.encode("not to be")) == "not to be"
    tail = task.tokenizer.encode(text)[int(0.9 * len(text)) :]  # the test split is the last 10%
    assert torch.equal(task.test.inputs[0], tail[:8])
    assert torch.equal(load_task(f"text:{tmp_path / 't.txt'}", block_size=8, seed=3).test.inputs, task.test.inputs)
    assert len(task.partition(2, 1)) > 0
    with pytest.raises(ValueError, match="needs class labels"):
        task.partition(2, 0, "dirichlet")


def test_unknown_sources_are_named():
    with pytest.raises(ValueError, match="unknown data source 'mnist'"):
        load_task("mnist")


def test_train_and_evaluate_on_digits():
    torch.manual_seed(0)
    task = load_task("digits")
    model = build_model("vit", dict(task.model_overrides, dim=32, mlp_dim=64))
    before = task.evaluate(model)
    result = train(model, task.train, epochs=3, lr=3e-3, batch_size=32, seed=0)
    after = evaluate(model, task.test)
    assert result["steps"] == 3 * -(-len(task.train) // 32)
    assert after["loss"] < before["loss"] and after["accuracy"] > before["accuracy"]

    tokens = Split(torch.randint(0, 5, (6, 4)), torch.randint(0, 5, (6, 4)))
    gpt = build_model(
        "gpt", {"vocab_size": 5, "block_size": 4, "dim": 16, "depth": 1, "heads": 2, "mlp_dim": 16}
    )
    assert set(evaluate(gpt, tokens)) == {"loss", "accuracy"}


def test_evaluate_bounds_each_forward_pass_by_its_logits():
    """A large vocabulary is evaluated in passes of at most ``output_budget`` logit values (the first
    example alone sizes them), with the figures of one whole pass."""
    torch.manual_seed(0)
    tokens = Split(torch.randint(0, 50, (23, 8)), torch.randint(0, 50, (23, 8)))
    gpt = build_model("gpt", {"vocab_size": 50, "block_size": 8, "dim": 16, "depth": 1, "heads": 2, "mlp_dim": 16})
    passes = []
    gpt.register_forward_hook(lambda module, args, out: passes.append(out.numel()))
    whole = evaluate(gpt, tokens, batch_size=10)
    assert passes == [8 * 50, 9 * 8 * 50, 10 * 8 * 50, 3 * 8 * 50]  # 1 + 9, 10, 3: budget larger than a batch
    passes.clear()
    bounded = evaluate(gpt, tokens, batch_size=10, output_budget=3 * 8 * 50)
    assert max(passes) == 3 * 8 * 50 and sum(passes) == 23 * 8 * 50
    assert bounded == pytest.approx(whole, rel=1e-6)
