"""``python -m fedbasin``: the ``fedbasin`` console script (:func:`fedbasin.console.entry`)."""

import sys

from fedbasin.console import entry

sys.exit(entry())
