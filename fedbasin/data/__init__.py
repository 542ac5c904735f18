"""Datasets for federated runs: one entry point, :func:`load_task`, used by every driver."""

from .sources import CharTokenizer, load_task
from .task import PARTITIONERS, Split, Task

__all__ = ["PARTITIONERS", "CharTokenizer", "Split", "Task", "load_task"]
