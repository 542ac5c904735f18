"""The ``fedbasin`` console script: :func:`fedbasin.cli.main`, with a Ctrl-C during its first seconds
(importing torch, building the parser) reported like any other interrupt, in one line."""

from __future__ import annotations

import sys

from fedbasin.commandline import EXIT_INTERRUPTED


def entry() -> int:
    try:
        from fedbasin.cli import main

        return main()
    except KeyboardInterrupt:
        print("fedbasin: interrupted; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
