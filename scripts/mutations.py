"""Mutation check of the test suite: break one feature at a time and see which tests notice.

    python scripts/mutations.py            # every mutation, stop at the first failing test (-x)
    python scripts/mutations.py --all      # list every test that catches each mutation
    python scripts/mutations.py weights gauge

Each mutation runs the relevant test files in a fresh ``pytest --mutate NAME`` process
(tests/conftest.py, tests/mutants.py: the feature is monkeypatched in that process only; no file
changes). First the same files run unmutated and must pass. Prints a Markdown table:
mutation → tests that failed. A mutation that no test catches makes the exit status 1.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.mutants import MUTATIONS  # noqa: E402

# the test files that exercise each feature (a mutation may be caught by any of them)
CORE = ["tests/test_alignment.py", "tests/test_merge_weights.py"]
SUBSETS = {
    "weights": ["tests/test_merge_weights.py", "tests/test_strategy_merge.py", "tests/test_strategy.py",
                "tests/test_hf.py"],
    "universe": ["tests/test_universe.py", "tests/test_strategy.py", "tests/test_alignment.py"],
    "refinement": ["tests/test_refine_selection.py", "tests/test_refine.py", "tests/test_strategy.py"],
    "head_step": CORE + ["tests/test_hf.py"],
    "mlp_step": CORE + ["tests/test_hf.py"],
    "residual_step": CORE + ["tests/test_hf.py"],
    "gauge": CORE + ["tests/test_strategy_merge.py"],
}


def run_pytest(files: list[str], mutation: str | None, first: bool) -> tuple[int, list[str], float]:
    """(exit status, failed test ids, seconds) of one pytest process."""
    command = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *files]
    if first:
        command.insert(3, "-x")
    if mutation:
        command += ["--mutate", mutation]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1")
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    failed = re.findall(r"^FAILED (\S+)", done.stdout, flags=re.M)
    return done.returncode, failed, time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mutations", nargs="*", choices=[[]] + sorted(MUTATIONS), default=[],
                        metavar="MUTATION", help=f"some of {sorted(MUTATIONS)} (default: all)")
    parser.add_argument("--all", action="store_true", help="run every test instead of stopping at the first failure")
    args = parser.parse_args(argv)
    names = args.mutations or list(MUTATIONS)
    files = sorted({f for name in names for f in SUBSETS[name]})
    status, failed, seconds = run_pytest(files, None, first=True)
    print(f"unmutated: {len(files)} files, exit {status}, {seconds:.0f} s", flush=True)
    if status != 0:
        print(f"the unmutated tests fail ({failed}); fix them first", file=sys.stderr)
        return 2
    rows, missed = [], []
    for name in names:
        status, failed, seconds = run_pytest(SUBSETS[name], name, first=not args.all)
        if status == 1 and failed:
            tests: dict[str, int] = {}
            for test in failed:  # parametrised cases grouped under their test function
                name_only = test.removeprefix("tests/").split("[")[0]
                tests[name_only] = tests.get(name_only, 0) + 1
            caught = "<br>".join(f"`{t}`" + (f" ×{n}" if n > 1 else "") for t, n in tests.items())
        else:
            caught = f"**not caught** (pytest exit {status})"
            missed.append(name)
        rows.append(f"| `{name}` | {MUTATIONS[name].__doc__.strip()} | {len(failed)} | {caught} | {seconds:.0f} |")
        print(rows[-1], flush=True)
    print()
    print("| mutation | what is broken | failing tests | caught by | wall s |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
