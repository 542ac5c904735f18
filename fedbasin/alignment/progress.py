"""Progress bars of the long-running alignment steps (matching, merging, refinement).

One helper, so every step draws the same kind of bar: tqdm on stderr when asked for, otherwise a
silent bar whose ``update`` and ``close`` cost nothing.
"""

from __future__ import annotations


def progress_bar(total: int, enabled: bool, desc: str, unit: str):
    """A tqdm bar on stderr; a silent no-op bar when ``enabled`` is False."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=not enabled)


def close_open_bars() -> None:
    """Clear every live bar, so that a message printed next (an error, "interrupted") starts its own
    line instead of being appended to a half-drawn bar."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
