"""Flower ServerApp: model + aligned strategy from the run config, evaluation, checkpoints."""

from .server_app import app, run_server

__all__ = ["app", "run_server"]
