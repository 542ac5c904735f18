"""Flower strategies (Message API) that align client models before averaging."""

from .aligned_fedavg import AlignedFedAvg, ReplyError

__all__ = ["AlignedFedAvg", "ReplyError"]
