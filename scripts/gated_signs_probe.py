"""Exploratory probe (docs/journal/merging-notes.md §32): does matching gated units as signed permutations help?

A SwiGLU unit ``down_j · act(gate_j·x) (up_j·x)`` is unchanged when up_j (and its bias) and down_j change sign
together, so gated MLPs have a sign flip per unit on top of the permutation. With
``fedbasin.alignment.matching.SIGNED_GATED_UNITS`` the weight matching scores unit pairs ``G + |U|`` (G: the gate's
terms, U: the up and down ones) and flips where ``U < 0``. This runs ``fedbasin align A B`` with the given options
with the flag off and on, one after the other in this process, then ``fedbasin barrier`` of each on the first
``--eval-examples`` test blocks, and prints one JSON line per setting: barrier, seconds, refinement steps.

    python scripts/gated_signs_probe.py A B --data text:FILE [--eval-examples 100] [--out DIR] [-- ALIGN OPTIONS]

Uses fedbasin internals (not a supported API).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--data", required=True, help="text:FILE (the barrier's data)")
    p.add_argument("--eval-examples", type=int, default=100, help="first N test blocks scored")
    p.add_argument("--out", default="runs/gated-signs", help="folder for the aligned checkpoints (new subfolders)")
    args = p.parse_args(argv)

    import fedbasin.alignment.matching as matching
    from fedbasin.cli import main as cli

    def run(command: list[str]) -> dict:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli(command)
        if code:
            raise SystemExit(f"fedbasin {' '.join(command)} exited {code}")
        return json.loads(out.getvalue())

    for signed in (False, True):
        matching.SIGNED_GATED_UNITS = signed
        aligned = Path(args.out) / f"{'signed' if signed else 'unsigned'}-{time.strftime('%Y%m%d-%H%M%S')}"
        start = time.perf_counter()
        summary = run(["align", args.a, args.b, "--out", str(aligned), *extra])
        seconds = time.perf_counter() - start
        barrier = run(["barrier", args.a, str(aligned), "--data", args.data, "--max-examples", str(args.eval_examples)])
        print(json.dumps({"signed": signed, "options": extra, "barrier": barrier["barrier"],
                          "align_seconds": round(seconds, 1),
                          "refine_steps": (summary.get("refinement") or {}).get("steps")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
