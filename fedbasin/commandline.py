"""Conventions every fedbasin command shares: the exit codes of the README's table ("Command
line") and the ``--help`` formatter. Imported by ``fedbasin.cli`` and by the commands that run on
their own (``fedbasin.simulate``), so neither imports the other for them."""

from __future__ import annotations

import argparse

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran but failed (reported by the command itself)
EXIT_USAGE = 2  # invalid option value or combination
EXIT_INPUT = 3  # an input checkpoint or data set is missing, unreadable, mismatched or not finite
EXIT_OUTPUT = 4  # an output path is unusable (not writable, read-only, not a checkpoint, disk full)
EXIT_INTERNAL = 70  # a bug: please report it (FEDBASIN_DEBUG=1 shows the traceback)
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGINT; nothing partial is left behind
EXIT_TERMINATED = 143  # SIGTERM (fedbasin simulate): 128 + 15, as a shell reports it


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" where an option has a real default (not None, False, "" or [])."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default in ("", []) \
                or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
