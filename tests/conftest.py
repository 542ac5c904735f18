"""pytest option ``--mutate NAME``: run the tests against a deliberately broken feature
(tests/mutants.py). Without the option nothing changes."""

from __future__ import annotations

from tests.mutants import MUTATIONS


def pytest_addoption(parser):
    parser.addoption("--mutate", choices=sorted(MUTATIONS), default=None,
                     help="break one fedbasin feature in this test process (mutation check of the tests)")


def pytest_configure(config):
    # transformers makes its log handler on first use, bound to the sys.stderr of that moment: make it
    # now, so that it never keeps a test's closed capsys stream (a later test's warning then fails
    # with "Logging error" whichever test file happened to run first)
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        pass
    else:
        transformers_logging.get_logger("transformers")
    name = config.getoption("--mutate")
    if name:
        MUTATIONS[name]()


def pytest_report_header(config):
    name = config.getoption("--mutate")
    return f"MUTATION ACTIVE: {name} ({MUTATIONS[name].__doc__.strip()})" if name else None
