"""Datasets for federated runs: one entry point, :func:`load_task`, used by every driver."""

from .sources import (
    CharTokenizer,
    HFTokenizer,
    chain_blocks,
    frequency_blocks,
    load_task,
    token_blocks,
    unigram_blocks,
)
from .task import PARTITIONERS, Split, Task

__all__ = ["PARTITIONERS", "CharTokenizer", "HFTokenizer", "Split", "Task", "chain_blocks", "frequency_blocks", "load_task",
           "token_blocks", "unigram_blocks"]
