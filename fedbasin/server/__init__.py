"""Flower ServerApp: model + aligned strategy from the run config, evaluation, checkpoints."""

from fedbasin import preload  # noqa: F401 - first: the modules both apps share (fedbasin.preload)

from .server_app import app, run_server

__all__ = ["app", "run_server"]
