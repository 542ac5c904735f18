"""Write a CIFAR-10 parquet directory whose training split holds only the images a model trained with
``fedbasin train --data cifar10:SRC --max-train-examples N`` never saw: the rows after the first N of the
training split's fixed shuffle (seed 0, as ``fedbasin.data.load_task`` draws it). The test split is linked.

    python scripts/heldout_cifar10.py ../shared/data/cifar10 OUT_DIR --skip 30000

``--refine-data cifar10:OUT_DIR`` then refines (and distils) on a proxy disjoint from the models' training
data (docs/journal/merging-notes.md §30: it did not help there). Exits 2 with one line on bad input;
refuses an existing OUT_DIR.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, help="CIFAR-10 parquet directory (train.parquet, test.parquet)")
    p.add_argument("out", type=Path, help="new directory to write")
    p.add_argument("--skip", type=int, required=True, help="the models' --max-train-examples N")
    args = p.parse_args(argv)
    import pyarrow.parquet as pq
    import torch

    train, test = args.source / "train.parquet", args.source / "test.parquet"
    if not (train.is_file() and test.is_file()):
        print(f"heldout_cifar10: {args.source}: needs train.parquet and test.parquet", file=sys.stderr)
        return 2
    if args.out.exists():
        print(f"heldout_cifar10: {args.out} exists; give a new directory", file=sys.stderr)
        return 2
    table = pq.read_table(train)
    if not 0 < args.skip < table.num_rows:
        print(f"heldout_cifar10: --skip {args.skip}: must be in 1..{table.num_rows - 1}", file=sys.stderr)
        return 2
    order = torch.randperm(table.num_rows, generator=torch.Generator().manual_seed(0))
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.mkdir(parents=True)
    pq.write_table(table.take(order[args.skip:].tolist()), tmp / "train.parquet")
    os.symlink(test.resolve(), tmp / "test.parquet")
    tmp.rename(args.out)
    print(f"{args.out}: {table.num_rows - args.skip} training images (of {table.num_rows}), test linked")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
