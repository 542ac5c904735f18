"""Mutation check of the test suite: break one feature at a time and see which tests notice.

    python scripts/mutations.py            # every mutation
    python scripts/mutations.py weights gauge

Each mutation runs the relevant test files in a fresh ``pytest --mutate NAME`` process
(tests/conftest.py, tests/mutants.py: the feature is monkeypatched in that process only; no file
changes). First the same files run unmutated and must pass. Prints a Markdown table: mutation →
tests whose assertions failed, and tests that crashed instead. A mutation is caught only by a
failed assertion; one that no assertion catches (not caught, or only crashes: a broken mutant)
makes the exit status 1.
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
    "auto_kind": ["tests/test_options.py"],
    "budget": ["tests/test_options.py"],
    "distill_budget": ["tests/test_distill_budget.py"],
    "distill_rate": ["tests/test_distill_levers.py", "tests/test_merge_distill.py"],
    "mixup_labels": ["tests/test_distill_levers.py"],
    "translator": ["tests/test_options.py", "tests/test_head_lr.py"],
    "phi": ["tests/test_families_cli.py", "tests/test_phi.py"],
    "shared_norm": ["tests/test_phi.py"],
    "token_biases": ["tests/test_causal_lm_cli.py"],
    "new_config": ["tests/test_families_cli.py", "tests/test_train_eval.py"],
}


ASSERTION = re.compile(r"(assert |AssertionError|Failed: )")  # a value checked, pytest.fail, DID NOT RAISE


def run_pytest(files: list[str], mutation: str | None) -> tuple[int, dict[str, str], float]:
    """(exit status, {failed test id: first line of its error}, seconds) of one pytest process; every
    test runs under a mutation, the unmutated run stops at its first failure."""
    command = [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *files]
    command += ["--mutate", mutation] if mutation else ["-x"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", COLUMNS="4000")  # untruncated summary lines
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    failed = dict(re.findall(r"^FAILED (\S+)(?: - (.*))?$", done.stdout, flags=re.M))
    return done.returncode, failed, time.perf_counter() - t0


def split_failures(failed: dict[str, str]) -> tuple[list[str], list[str]]:
    """(tests that failed an assertion, ``test: error`` of those that crashed with another error).
    Only an assertion on values catches a mutant; a crash means the mutant no longer fits the code
    it replaces (a broken mutant) or the tests never look at the values."""
    asserted = [t for t, error in failed.items() if ASSERTION.match(error or "")]
    crashed = [f"{t}: {(error or '?').split(':')[0]}" for t, error in failed.items() if t not in asserted]
    return asserted, crashed


def grouped(tests: list[str]) -> str:
    """Test ids with their parametrised cases grouped under the test function."""
    counts: dict[str, int] = {}
    for test in tests:
        name = test.removeprefix("tests/").split("[")[0]
        counts[name] = counts.get(name, 0) + 1
    return "<br>".join(f"`{t}`" + (f" ×{n}" if n > 1 else "") for t, n in counts.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mutations", nargs="*", choices=[[]] + sorted(MUTATIONS), default=[],
                        metavar="MUTATION", help=f"some of {sorted(MUTATIONS)} (default: all)")
    args = parser.parse_args(argv)
    names = args.mutations or list(MUTATIONS)
    files = sorted({f for name in names for f in SUBSETS[name]})
    status, failed, seconds = run_pytest(files, None)
    print(f"unmutated: {len(files)} files, exit {status}, {seconds:.0f} s", flush=True)
    if status != 0:
        print(f"the unmutated tests fail ({failed}); fix them first", file=sys.stderr)
        return 2
    rows, missed = [], []
    for name in names:
        status, failed, seconds = run_pytest(SUBSETS[name], name)
        asserted, crashed = split_failures(failed)
        if asserted:
            caught = grouped(asserted)
        elif crashed:
            caught = f"**broken mutant**: every failure is a crash ({'; '.join(crashed[:3])})"
            missed.append(name)
        else:
            caught = f"**not caught** (pytest exit {status})"
            missed.append(name)
        rows.append(f"| `{name}` | {MUTATIONS[name].__doc__.strip()} | {len(asserted)} | {len(crashed)} | {caught} "
                    f"| {seconds:.0f} |")
        print(rows[-1], flush=True)
    print()
    print("| mutation | what is broken | failed assertions | crashes | caught by | wall s |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
