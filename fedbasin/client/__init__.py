"""Flower ClientApp: local training/evaluation on the node's partition."""

from .client_app import app

__all__ = ["app"]
