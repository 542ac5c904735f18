"""Keep-best training, shared by learned refinement and distillation.

Both optimise on a training split and score the current result on a disjoint selection split
every ``eval_every`` steps, returning the best one seen with the start included, so the returned
selection loss is never above the start's; a step whose loss or parameters are not finite stops
training there. This module checks the step budget, detects a diverged step, and writes the
JSON record both results report (start and kept selection losses, the kept step, a note when
the start came back unchanged).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def check_step_options(steps, eval_every, **positive) -> None:
    """Refuse a bad optimisation budget: ``steps`` an integer >= 0, ``eval_every`` >= 1, and each
    ``positive`` value a finite number > 0 (shared by refinement and distillation)."""
    for name, value in (("steps", steps), ("eval_every", eval_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name == "eval_every"):
            raise ValueError(f"{name} must be an integer >= {int(name == 'eval_every')}, got {value!r}")
    for name, value in positive.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def keep_best_record(result, what: str, start: str, learned: str) -> dict:
    """The keep-best fields shared by refinement and distillation results: selection loss at the
    start and at the kept step, the kept step, the steps the run was given and where a budget stopped it
    (if it did), the evaluation split's losses when measured, the step where training diverged (if it
    did), and a ``note`` saying so and when ``start`` came back."""
    out = {"selection_loss_start": result.initial_loss, "selection_loss_best": result.best_loss,
           "best_step": result.best_step, "improved": result.improved, "seconds": round(result.seconds, 3),
           "steps": result.steps}
    if result.stopped_at_budget:
        out["stopped_at_budget"] = result.stopped_at_budget
    if not np.isnan(result.evaluation_loss):
        out.update(evaluation_loss_start=result.evaluation_initial_loss, evaluation_loss=result.evaluation_loss)
    notes = []
    if result.diverged_step:
        out["diverged_step"] = result.diverged_step
        notes.append(f"{what} diverged at step {result.diverged_step} (non-finite loss or {learned}; a lower "
                     "learning rate avoids it) and stopped there")
    if not result.improved:
        notes.append(f"{what} could not improve on {start} (best_step 0): it is returned unchanged")
    if notes:
        out["note"] = "; ".join(notes)
    return out


def all_finite(loss: torch.Tensor, parameters) -> bool:
    """Whether the step's loss and every learned parameter after it are finite (one device sync)."""
    flags = [torch.isfinite(loss).all()] + [torch.isfinite(p).all() for p in parameters]
    return bool(torch.stack(flags).all())
