"""Tensor splits and the :class:`Task` bundle (data + what the data implies for the model)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from fedbasin.training import cross_entropy, evaluate

PARTITIONERS = ("iid", "dirichlet")


@dataclass(frozen=True)
class Split:
    """``inputs`` (N, ...) and ``targets`` (N,) class ids or (N, T) next-token ids.

    ``transform`` maps a batch of stored inputs to model inputs (e.g. uint8 images to normalised
    floats); it runs per batch, on the batch's device, so large image sets stay compact.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self):
        if len(self.inputs) != len(self.targets):
            raise ValueError(f"{len(self.inputs)} inputs but {len(self.targets)} targets")

    def __len__(self) -> int:
        return len(self.targets)

    def subset(self, index: torch.Tensor) -> Split:
        return Split(self.inputs[index], self.targets[index], self.transform)

    def split(self, fraction: float, seed: int = 0) -> tuple[Split, Split]:
        """Random ``(1 - fraction, fraction)`` split (at least one example on each side)."""
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        n_second = min(max(1, round(fraction * len(self))), len(self) - 1)
        return self.subset(order[n_second:]), self.subset(order[:n_second])

    def token_ids(self) -> torch.Tensor:
        """Every token of a next-token split once (flat): the blocks' inputs and each block's last target."""
        return torch.cat([self.inputs.reshape(-1), self.targets[:, -1]])

    def batches(
        self,
        batch_size: int,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(inputs, targets)`` batches on ``device``; shuffled when a ``generator`` is given."""
        n = len(self)
        order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
        for start in range(0, n, batch_size):
            index = order[start : start + batch_size]
            x, y = self.inputs[index].to(device), self.targets[index].to(device)
            yield (self.transform(x) if self.transform else x), y


@dataclass
class Task:
    """A dataset ready for federated training of one model family.

    family: ``"vit"`` or ``"gpt"``. model_overrides: config fields implied by the data (image
    size/channels/classes, or vocabulary size/block size). train/test/proxy: splits; ``proxy`` is
    a small slice of the training data held by the server (None when not requested).
    """

    name: str
    family: str
    model_overrides: dict
    train: Split
    test: Split
    proxy: Split | None = None
    tokenizer: object | None = None
    _partitions: dict = field(default_factory=dict, repr=False)

    @property
    def data(self) -> str:
        """What the examples are, in a model family's terms (``Family.data``): ``"images"`` for the
        ``vit`` family's data, ``"text"`` (token blocks) for ``gpt``'s."""
        return "images" if self.family == "vit" else "text"

    def partition(
        self,
        num_partitions: int,
        partition_id: int,
        scheme: str = "iid",
        alpha: float = 0.5,
        seed: int = 0,
    ) -> Split:
        """Partition ``partition_id`` of ``num_partitions`` of the training split.

        ``iid``: flwr-datasets ``IidPartitioner`` (equal contiguous shards of the already shuffled
        data). ``dirichlet``: ``DirichletPartitioner`` by label, per-class shares ~ Dir(alpha)
        (classification data only).
        """
        if not 0 <= partition_id < num_partitions:
            raise ValueError(f"partition-id {partition_id} is outside [0, {num_partitions})")
        key = (num_partitions, scheme, alpha, seed)
        if key not in self._partitions:
            self._partitions[key] = self._partitioner(num_partitions, scheme, alpha, seed)
        index = self._partitions[key].load_partition(partition_id)["index"]
        return self.train.subset(torch.as_tensor(index, dtype=torch.long))

    def _partitioner(self, num_partitions: int, scheme: str, alpha: float, seed: int):
        from datasets import Dataset
        from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

        columns = {"index": list(range(len(self.train)))}
        if scheme == "iid":
            partitioner = IidPartitioner(num_partitions)
        elif scheme == "dirichlet":
            if self.train.targets.ndim != 1:
                raise ValueError(
                    f"dirichlet partitioning needs class labels; {self.name} has token targets"
                )
            columns["label"] = self.train.targets.tolist()
            partitioner = DirichletPartitioner(
                num_partitions, partition_by="label", alpha=alpha, self_balancing=True, seed=seed
            )
        else:
            raise ValueError(f"unknown partitioner {scheme!r}; expected one of {PARTITIONERS}")
        partitioner.dataset = Dataset.from_dict(columns)
        return partitioner

    def split(self, name: str) -> Split:
        split = getattr(self, name, None) if name in ("train", "test", "proxy") else None
        if split is None:
            raise ValueError(f"{self.name} has no {name!r} split")
        return split

    loss_fn = staticmethod(cross_entropy)

    def evaluate(
        self, model: nn.Module, split: str | Split = "test", device="cpu", batch_size: int = 512
    ) -> dict:
        """``{"loss", "accuracy"}`` of ``model`` on a split (by name or a :class:`Split`)."""
        data = self.split(split) if isinstance(split, str) else split
        return evaluate(model, data, device=device, batch_size=batch_size)
