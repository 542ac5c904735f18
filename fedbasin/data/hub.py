"""Hugging Face hub access that fails fast offline.

Unreachable, the hub libraries retry each request with back-off (a data set: ~28 s and a dozen log
lines; a tokenizer: ~49 s) before the one-line error. :func:`hub_access` probes the endpoint once per
process (a TCP connection, :data:`PROBE_SECONDS`); when it cannot be reached, the calls inside run in
the libraries' offline mode: a copy in the local cache still loads, anything else fails at once. No
probe where the libraries are offline already, where ``HF_HUB_OFFLINE=0`` asks for the network, or
where a proxy carries the traffic (the probe could not tell).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import urllib.request
from urllib.parse import urlparse

PROBE_SECONDS = 3.0
_FALSE_VALUES = {"0", "OFF", "NO", "FALSE"}
_lock = threading.Lock()
_offline_users = 0  # hub_access blocks now running in offline mode
_saved: list = []  # the flags' values before the first of them


def _endpoint():
    from huggingface_hub import constants

    return urlparse(constants.ENDPOINT)


@functools.cache
def hub_reachable() -> bool:
    """Whether a TCP connection to the hub's endpoint (``HF_ENDPOINT``, default huggingface.co) opens."""
    url = _endpoint()
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=PROBE_SECONDS):
            return True
    except OSError:
        return False


def _probe_wanted() -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in _FALSE_VALUES:
        return False  # offline already, or the network asked for
    url = _endpoint()
    proxies = urllib.request.getproxies()
    if (proxies.get(url.scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(url.hostname or ""):
        return False  # a proxy carries it: a direct connection says nothing
    return True


def _offline_flags() -> list:
    from huggingface_hub import constants

    flags = [(constants, "HF_HUB_OFFLINE")]
    try:
        import datasets.config

        flags.append((datasets.config, "HF_HUB_OFFLINE"))
    except ImportError:
        pass
    return flags


@contextlib.contextmanager
def hub_access():
    """Run hub calls as they are where the hub answers, else in offline mode (huggingface_hub's and
    datasets' flags, restored when the last such block ends)."""
    global _offline_users
    if not _probe_wanted() or hub_reachable():
        yield
        return
    with _lock:
        if _offline_users == 0:
            _saved[:] = [(module, name, getattr(module, name)) for module, name in _offline_flags()]
            for module, name, _ in _saved:
                setattr(module, name, True)
        _offline_users += 1
    try:
        yield
    finally:
        with _lock:
            _offline_users -= 1
            if _offline_users == 0:
                for module, name, value in _saved:
                    setattr(module, name, value)
