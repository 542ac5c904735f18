"""Flower ClientApp: local training/evaluation on the node's partition."""

from fedbasin import preload  # noqa: F401 - first: the modules both apps share (fedbasin.preload)

from .client_app import app

__all__ = ["app"]
