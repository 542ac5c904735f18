"""pytest option ``--mutate NAME``: run the tests against a deliberately broken feature
(tests/mutants.py). Without the option nothing changes."""

from __future__ import annotations

from tests.mutants import MUTATIONS


def pytest_addoption(parser):
    parser.addoption("--mutate", choices=sorted(MUTATIONS), default=None,
                     help="break one fedbasin feature in this test process (mutation check of the tests)")


def pytest_configure(config):
    name = config.getoption("--mutate")
    if name:
        MUTATIONS[name]()


def pytest_report_header(config):
    name = config.getoption("--mutate")
    return f"MUTATION ACTIVE: {name} ({MUTATIONS[name].__doc__.strip()})" if name else None
