"""PNG plots (matplotlib, Agg backend): interpolation curves and training curves."""

from __future__ import annotations

import os
from pathlib import Path

from fedbasin.atomic import atomic_write


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike) -> None:
    """Write ``fig`` to ``path`` atomically (temporary file + rename)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=120, bbox_inches="tight"))


#: fixed look per curve name, so vanilla / aligned / learned read the same in every figure
CURVE_STYLE = {
    "vanilla": dict(color="tab:gray", linestyle="--"),
    "permutation": dict(color="tab:orange"),
    "orthogonal": dict(color="tab:blue"),
    "aligned": dict(color="tab:blue"),
    "learned": dict(color="tab:green"),
}


def distinct_names(paths: list[str | os.PathLike]) -> list[str]:
    """Shortest path suffixes (``name``, ``parent/name``, ...) that tell the paths apart."""
    parts = [Path(p).resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]  # the same path twice


def plot_curves(curves: dict, path: str | os.PathLike, title: str = "", ylabel: str = "loss") -> None:
    """One labelled line per named :class:`~fedbasin.alignment.Curve` (loss against λ)."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, curve in curves.items():
        ax.plot(curve.lambdas, curve.losses, marker="o", ms=3, label=f"{name} (barrier {curve.barrier:.3f})",
                **CURVE_STYLE.get(name, {}))
    ax.set_xlabel("λ  (λ·A + (1−λ)·B)")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path)
    plt.close(fig)
