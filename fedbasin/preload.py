"""Every module the two Flower apps share, imported in one place before either app's own modules.

Flower's simulation loads the ServerApp (in a thread) and the ClientApp (in the main thread) in
one process at the same time. Two threads importing one package's modules in different orders
can deadlock, and CPython then fails the import with ``_DeadlockError``: a package's
``__init__`` holds the package's lock while it imports a submodule, and another thread holds that
submodule's lock while it waits for the package (seen: ``fedbasin.alignment`` against
``fedbasin.alignment.adapters``, one simulation in about ten). ``fedbasin.server`` and
``fedbasin.client`` import this module first: the first thread to get here imports every module
both apps need while the other waits on this module's lock alone, holding only the locks of its
own app's package, which nothing here imports. After it, the two apps import disjoint sets of
modules (the server's strategy, plots and checkpoints; the client's app), so their locks never
meet (``tests/test_layering.py`` checks both halves). Only what both need is here: a ClientApp
process does not pay for the server's modules.
"""

from __future__ import annotations

import flwr.app  # noqa: F401
import torch  # noqa: F401

import fedbasin.alignment
import fedbasin.causal_lm
import fedbasin.config
import fedbasin.data
import fedbasin.heap
import fedbasin.models
import fedbasin.training
import fedbasin.weights  # noqa: F401
