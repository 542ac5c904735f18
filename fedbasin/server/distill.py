"""Server-side ensemble distillation of a merged model (FedDF-style).

The teacher is the clients' ensemble, ``t(x) = (1/K) Σ_k f_k(x)`` (mean logits, the
"logit ensemble" of docs/benchmarks.md §4) or, with ``teacher="probabilities"``,
``t(x) = log (1/K) Σ_k softmax(f_k(x))`` (the mean of the clients' probabilities: every client's
vote is bounded by 1, so under label skew one over-confident client cannot outvote the rest);
the student starts from the merged model θ₀ and minimises, on the server's proxy batches (x, y),

    (1 − w) · T² · KL(softmax(t(x)/T) ‖ softmax(f_θ(x)/T)) + w · CE(f_θ(x), y)

with Adam and a cosine learning-rate schedule. ``w`` (``label_weight``, default 0: labels unused)
mixes in the task's loss on the proxy labels the server holds. ``augment`` (e.g.
:func:`random_crop_flip`, :func:`random_mixup`) replaces every transfer batch by a random view of
it, seen by teacher and student alike, so the transfer set is larger than the proxy images. Keep-best on a disjoint *selection*
split: the student is scored every ``eval_every`` steps by ``loss_fn`` against the true labels
and the best state seen (θ₀ included) is returned, so distillation never returns something worse
than its start on that split; an optional *evaluation* split is only reported.

``steps=None`` sizes the run by a time ``budget`` (seconds): before the first step the run times
one step's parts without changing anything (:func:`probe_step`: the teachers' outputs on the first
transfer batch, the student's forward and backward pass and an Adam step estimated from a scratch
one, a keep-best check) and takes as many steps as the budget allows, so the cosine schedule
spans the sized run from its first step: the run is bitwise the one given the recorded
``DistillResult.steps``. Should later steps run slower than timed, a budgeted run stops once the
budget less its last checks (selection, evaluation) is spent, with a last check (``DistillResult.stopped_at_budget``).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fedbasin.alignment.keep_best import all_finite, check_step_options, keep_best_record
from fedbasin.scratch import ScratchTensors
from fedbasin.weights import check_fits, weight_groups

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class DistillResult:
    """state: the kept student (on the CPU); history: (step, selection loss); best_step 0: θ₀ unchanged."""

    state: dict
    history: list[tuple[int, float]] = field(default_factory=list)
    initial_loss: float = math.nan
    best_loss: float = math.nan
    best_step: int = 0
    evaluation_initial_loss: float = math.nan
    evaluation_loss: float = math.nan
    seconds: float = 0.0
    diverged_step: int = 0  # the step whose loss or weights became non-finite (training stopped there); 0: none
    steps: int = 0  # the steps the run was given (sized from the budget when steps=None)
    stopped_at_budget: int = 0  # a budgeted run whose steps ran slower than timed stopped at this step
    lr: float = math.nan  # the student's Adam rate (a rate sized by the steps: the one they chose)

    @property
    def improved(self) -> bool:
        return self.best_step > 0

    def summary(self) -> dict:
        """JSON-ready record, the same keep-best record as learned refinement's (its steps, and where
        the budget stopped it); says plainly when distillation diverged or returned its start unchanged."""
        return {**keep_best_record(self, "distillation", "the merged model", "weights"), "lr": self.lr}


TEACHERS = ("logits", "probabilities")


def combine_logits(logits: torch.Tensor, combine: str) -> torch.Tensor:
    """The ensemble of stacked member logits (K, ..., classes): their mean, or with
    ``combine="probabilities"`` ``log mean_k softmax(logits_k)``."""
    if combine == "logits":
        return logits.mean(0)
    return torch.logsumexp(torch.log_softmax(logits, -1), 0) - math.log(logits.shape[0])


def _check_combine(combine: str) -> None:
    if combine not in TEACHERS:
        raise ValueError(f"ensemble combine={combine!r}; expected one of {', '.join(TEACHERS)}")


class LogitEnsemble(nn.Module):
    """``logits(x) = mean_k model_k(x)``, or with ``combine="probabilities"``
    ``log mean_k softmax(model_k(x))`` (outputs with a ``.logits`` field are unwrapped)."""

    def __init__(self, models: list[nn.Module], combine: str = "logits"):
        super().__init__()
        _check_combine(combine)
        self.members = nn.ModuleList(models)
        self.combine = combine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return combine_logits(torch.stack([_logits(m, x) for m in self.members]), self.combine)


class StateEnsemble(nn.Module):
    """:class:`LogitEnsemble` of K states of one architecture without K module copies: member k
    is ``module`` evaluated in eval mode with ``states[k]`` (``torch.func.functional_call``; the
    tensors are used where they are, converted to the module's dtype and device one member at a
    time when they differ; ``module``'s own weights are not used or changed; its non-persistent
    buffers are). Every state must hold exactly the module's state-dict keys and shapes (as
    ``load_state_dict``)."""

    def __init__(self, module: nn.Module, states: list[dict], combine: str = "logits"):
        super().__init__()
        _check_combine(combine)
        like = module.state_dict(keep_vars=True)
        for i, state in enumerate(states):
            check_fits(like, state, f"teacher {i}")
        self.like = {k: (v.dtype, v.device) for k, v in like.items()}
        self.states = states
        self.combine = combine
        object.__setattr__(self, "module", module)  # not a submodule: its weights are not the ensemble's

    def _member(self, state: dict) -> dict:
        return {k: v if (v.dtype, v.device) == self.like[k] else v.to(*reversed(self.like[k]))
                for k, v in state.items()}

    def members(self, x: torch.Tensor):
        """Each member's logits on ``x``, one at a time (eval mode)."""
        training = self.module.training
        self.module.eval()
        try:
            for state in self.states:
                # not strict: non-persistent buffers (e.g. RoPE's inv_freq) are the module's own, as in a copy
                yield _logits_of(torch.func.functional_call(self.module, self._member(state), (x,), tie_weights=False))
        finally:
            self.module.train(training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ensemble_of(self.members(x), self.combine)


def ensemble_of(member_logits, combine: str) -> torch.Tensor:
    """The ensemble of the members' logits given one at a time: the mean logits summed member by
    member (one logit tensor in flight besides the sum; bitwise :func:`combine_logits`), the mean
    probabilities from the stacked members."""
    if combine != "logits":
        return combine_logits(torch.stack(list(member_logits)), combine)
    total, count = None, 0
    for out in member_logits:
        total, count = (out.clone() if total is None else total.add_(out)), count + 1
    return total / count


class TeacherOutputs(ScratchTensors):
    """One teacher's logits on every transfer batch of a distillation run, in order
    (:func:`cache_teacher_outputs`; ``self[step]``, ``len(self)``): a teacher that costs
    steps × batch × outputs values of disk (an anonymous scratch file, :mod:`fedbasin.scratch`)
    instead of a model in memory, so its weights can go before the run."""


MEMO_BYTES = 2 << 30  # the ensemble's outputs a run without random views keeps per distinct input (EnsembleMemo)


class EnsembleMemo:
    """``ensemble(x)`` with its output for every distinct input row kept (on the CPU, looked up by
    the row's bytes) up to ``budget_bytes``: when the transfer inputs repeat (a proxy of N examples
    drawn epoch after epoch, no random views), a run of E epochs pays the teachers' N forward
    passes once instead of E times. The ensemble is a deterministic function of each input (eval
    mode), so only float rounding differs from evaluating it every step (rows of a batch evaluated
    together with other rows); a run repeats bitwise. Rows past the budget are evaluated each time."""

    def __init__(self, ensemble: Callable[[torch.Tensor], torch.Tensor], budget_bytes: int = MEMO_BYTES):
        self.ensemble, self.left, self.rows = ensemble, budget_bytes, {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        keys = [row.numpy().tobytes() for row in x.cpu()]
        missing = [i for i, key in enumerate(keys) if key not in self.rows]
        fresh = self.ensemble(x[missing]) if missing else None
        for j, i in enumerate(missing):
            row_bytes = fresh[j].numel() * fresh[j].element_size()
            if keys[i] not in self.rows and row_bytes <= self.left:
                self.rows[keys[i]] = fresh[j].to("cpu", copy=True)
                self.left -= row_bytes
        if len(missing) == len(keys):
            return fresh
        computed = dict(zip(missing, fresh)) if missing else {}
        return torch.stack([computed[i] if i in computed else self.rows[key].to(x.device)
                            for i, key in enumerate(keys)])


def memo_teacher_steps(batches, augment, row_bytes: int, budget_bytes: int = MEMO_BYTES) -> int | None:
    """The steps in which an :class:`EnsembleMemo` still runs the teachers when ``batches`` is an
    epoch-by-epoch stream of a known split (``.split``, ``.batch_size``: a
    :class:`~fedbasin.alignment.proxy.TrainingStream`) drawn without random views and every one of
    its outputs (``row_bytes`` each) fits the memo: the first epoch's ⌈N / batch⌉. None otherwise
    (the teachers run every step)."""
    split, batch_size = getattr(batches, "split", None), getattr(batches, "batch_size", None)
    if augment is not None or split is None or not batch_size or len(split) * row_bytes > budget_bytes:
        return None
    return -(-len(split) // batch_size)


def transfer_batches(batches: Iterable[Batch], steps: int | None, augment=None, seed: int = 0):
    """The ``steps`` transfer batches of a distillation run (None: as many as are drawn): ``(x, y)``
    drawn in order from ``batches``, each ``x`` replaced by ``augment(x, generator)`` (an augment
    that ``mixes_labels``, :func:`random_mixup`: ``(x, y)`` by ``augment(x, generator, y)``) with
    one generator seeded ``seed`` — the same views whoever replays the same draws."""
    iterator = iter(batches)
    views = torch.Generator().manual_seed(seed)
    for _ in (itertools.count() if steps is None else range(steps)):
        x, y = next(iterator)
        if augment is None:
            yield x, y
        elif getattr(augment, "mixes_labels", False):  # mixup: the labels of a mixed input mix too
            yield augment(x, views, y)
        else:
            yield augment(x, views), y


def cache_teacher_outputs(model: nn.Module, teachers: list[dict], batches: Iterable[Batch], steps: int,
                          augment=None, seed: int = 0, budget_bytes: int | None = None,
                          scratch_dir: str | None = None) -> list[TeacherOutputs] | None:
    """Every teacher's logits on the transfer batches that :func:`ensemble_distill` with the same
    ``batches``, ``steps``, ``augment`` and ``seed`` will draw, kept on disk in ``scratch_dir``
    (default: the system's temporary directory), or None when they would take more than
    ``budget_bytes`` (default: half the teachers' weights; then keep the weights). The
    distillation from them is bitwise the one from the weights."""
    if not teachers or steps <= 0:
        return None
    ensemble = StateEnsemble(model, teachers)
    device = next(iter(model.parameters())).device
    outputs = [TeacherOutputs(scratch_dir) for _ in teachers]
    with torch.no_grad():
        for step, (x, _) in enumerate(transfer_batches(batches, steps, augment, seed)):
            for out, member in zip(ensemble.members(x.to(device)), outputs):  # members first: it runs to its end
                if step == 0 and not teacher_outputs_fit(teachers, out.numel() * out.element_size(), steps,
                                                         budget_bytes):
                    return None
                member.append(out)
    return outputs


def teacher_outputs_fit(teachers: list[dict], batch_bytes: int, steps: int, budget_bytes: int | None = None) -> bool:
    """Whether :func:`cache_teacher_outputs` keeps ``steps`` batches of ``batch_bytes`` per teacher:
    at most ``budget_bytes`` in all (default: half the teachers' weights)."""
    if budget_bytes is None:
        budget_bytes = sum(v.numel() * v.element_size() for t in teachers for v in t.values()) // 2
    return batch_bytes * steps * len(teachers) <= budget_bytes


def _logits_of(out) -> torch.Tensor:
    """A model's output as plain logits (Hugging Face outputs carry them in ``.logits``)."""
    return out if isinstance(out, torch.Tensor) else out.logits


def _logits(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _logits_of(module(x))


@torch.no_grad()
def mean_loss(forward: Callable[[torch.Tensor], object], loss_fn, split: list[Batch], device) -> float:
    """``Σ_b loss(logits(x_b), y_b)·|b| / Σ_b |b|``: the example-weighted mean loss of ``forward``
    (a model call; Hugging Face outputs are read through ``.logits``) over the batches of ``split``."""
    total = sum(float(loss_fn(_logits_of(forward(x.to(device))), y.to(device))) * len(y) for x, y in split)
    return total / sum(len(y) for _, y in split)


@torch.no_grad()
def merge_against_members(model: nn.Module, merged: dict, members: list[dict], loss_fn,
                          split: list[Batch], progress: bool = False) -> dict:
    """What a merge is worth beside the models it came from, on ``split`` (batches of class or
    token ids): the example-weighted mean loss ``Σ_b loss_b·|b| / Σ_b |b|`` and the argmax accuracy
    over every target of the merge, of each member and of the members' mean-logit ensemble, the
    best member (lowest loss) and the merge minus it (loss > 0 / accuracy < 0: the merge is worse
    than a model already held). ``model``: any module of the architecture, evaluated with each state
    where its own weights are (:class:`StateEnsemble`); ``merged`` and ``members`` in its layout."""
    device = next(iter(model.parameters())).device
    names = ["merge", *range(len(members)), "ensemble"]
    loss, correct = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    examples = targets = 0
    states = StateEnsemble(model, [merged, *members])

    def score(name, logits: torch.Tensor) -> torch.Tensor:
        loss[name] += float(loss_fn(logits, y)) * len(y)
        correct[name] += int((logits.argmax(-1) == y).sum())
        return logits

    for x, y in tqdm(split, desc="merge beside its models", disable=not progress, leave=False):
        # one member's logits in flight besides the ensemble's sum
        x, y = x.to(device), y.to(device)
        outputs = states.members(x)
        score("merge", next(outputs))
        score("ensemble", ensemble_of((score(i, out) for i, out in enumerate(outputs)), "logits"))
        examples, targets = examples + len(y), targets + y.numel()
    scores = {name: {"loss": loss[name] / examples, "accuracy": correct[name] / targets} for name in names}
    best = min(range(len(members)), key=lambda i: scores[i]["loss"])
    return {"examples": examples, "merge": scores["merge"], "models": [scores[i] for i in range(len(members))],
            "ensemble": scores["ensemble"], "best_model": best,
            "merge_minus_best_model": {k: scores["merge"][k] - scores[best][k] for k in ("loss", "accuracy")}}


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T² · KL(softmax(teacher/T) ‖ softmax(student/T))``, mean over every predicted position,
    as ``T² · (Σ p_t log p_t − Σ p_t log p_s) / N``: the teacher's side without gradient and no
    output-sized temporary beyond the teacher's probabilities and the student's log-probabilities
    (a language model's logits are large: server memory)."""
    s = student.reshape(-1, student.shape[-1])
    t = teacher.detach().reshape(-1, teacher.shape[-1])
    if temperature != 1:
        s, t = s / temperature, t / temperature
    with torch.no_grad():
        log_p_t = F.log_softmax(t, -1)
        p_t = log_p_t.exp()
        teacher_term = torch.dot(p_t.reshape(-1), log_p_t.reshape(-1))
        del log_p_t, t
    cross = torch.dot(p_t.reshape(-1), F.log_softmax(s, -1).reshape(-1))
    return (teacher_term - cross) * (temperature**2 / s.shape[0])


def random_crop_flip(pad: int = 4, flip: bool = True) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """``augment(x, generator)`` for image batches ``(N, C, H, W)``: every image is zero-padded by
    ``pad`` pixels, cropped back to ``H × W`` at a random offset and, with ``flip``, mirrored left
    to right with probability 1/2 (labels unchanged)."""
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise ValueError(f"pad must be an integer >= 0, got {pad!r}")

    def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if x.ndim != 4:
            raise ValueError(f"random_crop_flip needs image batches (N, C, H, W), got shape {tuple(x.shape)}")
        n, _, h, w = x.shape
        padded = F.pad(x, (pad, pad, pad, pad))
        dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator).tolist()
        dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator).tolist()
        mirror = (torch.rand(n, generator=generator) < 0.5).tolist() if flip else [False] * n
        views = [padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)]
        return torch.stack([v.flip(-1) if m else v for v, m in zip(views, mirror)])

    return augment


def random_mixup(base: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None
                 ) -> Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """``augment(x, generator[, y])`` that replaces every input ``x_i`` of a batch by
    ``λ_i · x_i + (1 − λ_i) · x_π(i)``, with ``λ_i ~ U(0, 1)`` and ``π`` a random permutation of the
    batch (after ``base``'s views, when given): inputs between the proxy examples, which the teachers
    label, so a few hundred proxy images give an unbounded transfer set. Given the class ids ``y``
    it returns the mixed labels too, ``λ_i · e_{y_i} + (1 − λ_i) · e_{y_π(i)}``, as sparse
    ``(class id, weight)`` pairs of shape (N, 2, 2) (:func:`fedbasin.training.cross_entropy`), so the
    label term of :func:`ensemble_distill` stays a true cross-entropy on a mixed input."""

    def augment(x: torch.Tensor, generator: torch.Generator, y: torch.Tensor | None = None):
        if not x.is_floating_point():
            raise ValueError(f"random_mixup mixes continuous inputs (images), not {x.dtype} (token ids)")
        if base is not None:
            x = base(x, generator)
        weight = torch.rand(x.shape[0], generator=generator).to(x.dtype)
        partner = torch.randperm(x.shape[0], generator=generator)
        per_input = weight.view(-1, *([1] * (x.ndim - 1)))  # λ_i broadcast over each input's dimensions
        mixed = per_input * x + (1 - per_input) * x[partner]
        if y is None:
            return mixed
        other = y[partner]
        same = other == y  # one class: all its weight on the first pair (ids are distinct where weight > 0)
        weights = torch.stack([torch.where(same, 1.0, weight), torch.where(same, 0.0, 1 - weight)], 1)
        return mixed, torch.stack([torch.stack([y.to(x.dtype), other.to(x.dtype)], 1), weights], -1)

    augment.mixes_labels = True
    return augment


def named_augment(choice: str, shape: tuple[int, ...]):
    """The ``distill-augment`` named ``choice`` as an ``augment`` for :func:`ensemble_distill`, for examples of
    ``shape``: None (``none``), random crops (zero padding of H // 8 pixels) with (``crop-flip``) or without
    left-right flips, followed (``…mixup``) or not by :func:`random_mixup` (its labels mixed too). A view
    needs images (C, H, W) at least 8 pixels wide: ``ValueError`` otherwise."""
    if choice == "none":
        return None
    if len(shape) != 3 or shape[-1] < 8:
        raise ValueError(f"distill-augment {choice!r} needs image data (C, H, W) at least 8 pixels wide; the "
                         f"examples have shape {tuple(shape)}")
    crop = choice.removesuffix("mixup").rstrip("-")
    views = random_crop_flip(pad=shape[-2] // 8, flip=crop == "crop-flip") if crop else None
    return random_mixup(views) if choice.endswith("mixup") else views


ADAM_SLICE = 1 << 22  # elements per Adam update (a multiple of every SIMD width): 16 MiB of float32


def _sliced_adam(parameter: torch.Tensor, lr: float) -> tuple[torch.optim.Adam, list[torch.Tensor]]:
    """An Adam over ``parameter`` cut into slices of :data:`ADAM_SLICE` elements (views of its
    storage; the parameter itself when it is smaller or not contiguous), and the slices."""
    if parameter.numel() <= ADAM_SLICE or not parameter.is_contiguous():
        slices = [parameter]
    else:
        flat = parameter.detach().view(-1)
        slices = [flat[i:i + ADAM_SLICE] for i in range(0, flat.numel(), ADAM_SLICE)]
    return torch.optim.Adam(slices, lr=lr), slices


def trainable_state(model: nn.Module, state: dict, in_place: bool) -> tuple[dict, list[str]]:
    """``state`` as the tensors that :func:`torch.func.functional_call` trains in ``model``'s place:
    in the module's dtypes and device, the state's own storage when ``in_place`` and they already
    are (else copies), trainable where the module's parameter is, tied where the module's tensors
    are (one tensor for every key of a tied parameter). Returns it and its distinct keys."""
    check_fits(model.state_dict(keep_vars=True), state, "student")
    live: dict[str, torch.Tensor] = {}
    own_keys = []
    for keys, v in weight_groups(model):
        tensor = state[keys[0]].detach().to(v.device, v.dtype, copy=not in_place)
        tensor.requires_grad_(isinstance(v, nn.Parameter) and v.requires_grad)
        own_keys.append(keys[0])
        live.update(dict.fromkeys(keys, tensor))
    return live, own_keys


EVAL_EVERY = 10  # keep-best checks every this many steps (ensemble_distill's default; the ServerApp's)
PROBE_PASSES = 3  # a probed part is timed as the mean of this many passes after an untimed one (one-off costs)
ADAM_PROBE = 1 << 20  # elements of the scratch Adam step that times Adam's rate per element


@dataclass
class StepCost:
    """Measured seconds of one distillation step's parts (:func:`probe_step`): ``teachers``, their
    outputs on one transfer batch (forward passes, or reading the cached ones); ``student``, its
    forward, loss, backward and Adam step; ``check``, one keep-best check on the selection split;
    ``reserve``, the run's seconds besides its steps still to come (checks outside the steps)."""

    teachers: float
    student: float
    check: float
    reserve: float = 0.0
    row_bytes: int = 0  # the ensemble's output per transfer example (what a memo of it keeps)

    def steps(self, seconds: float, eval_every: int = EVAL_EVERY, teacher_steps: int | None = None) -> int:
        """The steps that fit in ``seconds``: each costs the student and one ``eval_every``-th of
        a check, after ``reserve``, and the teachers in every step, or with ``teacher_steps``
        (:func:`memo_teacher_steps`) in that many first steps only; 0 when not one fits."""
        rest = self.student + self.check / eval_every
        left = seconds - self.reserve
        first = self.teachers + rest
        if teacher_steps is None or left < teacher_steps * first or rest <= 0:
            return max(0, int(left / first)) if first > 0 else 0
        return teacher_steps + int((left - teacher_steps * first) / rest)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(function: Callable[[], object], device: torch.device, passes: int = PROBE_PASSES,
           warm_up: bool = True) -> float:
    """Mean seconds of ``passes`` calls of ``function`` (the device's queue drained around each),
    after an untimed one with ``warm_up`` (it pays the one-off costs)."""
    if warm_up:
        function()
    seconds = 0.0
    for _ in range(passes):
        _synchronize(device)
        started = time.perf_counter()
        function()
        _synchronize(device)
        seconds += time.perf_counter() - started
    return seconds / passes


def adam_seconds(parameters: list[torch.Tensor], device: torch.device) -> float:
    """Seconds of the run's Adam step over ``parameters`` (one Adam and its schedule per slice of
    :data:`ADAM_SLICE` elements), estimated from timed steps over two scratch tensors on
    ``device``, of one and of up to :data:`ADAM_PROBE` elements: a cost per slice and a cost per
    element (at most 16 MiB of scratch, whatever the model)."""
    if not parameters:
        return 0.0
    total = sum(p.numel() for p in parameters)
    slices = sum(max(1, -(-p.numel() // ADAM_SLICE)) for p in parameters)

    def step_seconds(n: int) -> float:
        scratch = torch.zeros(n, device=device, requires_grad=True)
        scratch.grad = torch.zeros_like(scratch)
        optimiser = torch.optim.Adam([scratch], lr=1e-3)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda t: 1.0)

        def step() -> None:
            optimiser.step()
            schedule.step()
        return _timed(step, device)  # the first step makes Adam's moments

    one, n = step_seconds(1), min(total, ADAM_PROBE)
    per_element = max(step_seconds(n) - one, 0.0) / n
    return slices * one + total * per_element


def _student_seconds(model: nn.Module, live: dict, trained: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                     target: torch.Tensor, loss_fn, temperature: float, label_weight: float,
                     device: torch.device) -> float:
    """Seconds of a student step on ``(x, y)`` towards ``target`` that changes nothing: the forward
    pass in train mode, the loss and the backward pass with each gradient dropped as soon as it is
    complete (as the run's Adam steps free it), the torch random state (dropout) restored after
    it, and the run's check for a non-finite step; plus the Adam step, estimated (:func:`adam_seconds`)."""

    def drop(parameter: torch.Tensor) -> None:
        parameter.grad = None

    def step() -> None:
        model.train()
        logits = _logits_of(torch.func.functional_call(model, live, (x,)))  # tied keys share one tensor (live)
        loss = (1 - label_weight) * distillation_loss(logits, target, temperature)
        if label_weight > 0:
            loss = loss + label_weight * loss_fn(logits, y)
        loss.backward()
        all_finite(loss, trained)  # as the run checks every step

    hooks = [p.register_post_accumulate_grad_hook(drop) for p in trained]
    training = model.training
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            seconds = _timed(step, device)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(training)
    return seconds + adam_seconds(trained, device)


def probe_step(model: nn.Module, teachers: list[dict], batch: Batch, selection: list[Batch],
               evaluation: list[Batch] | None, loss_fn, *, temperature: float = 1.0, label_weight: float = 0.0,
               teacher: str = "logits") -> StepCost:
    """The :class:`StepCost` of a distillation of ``teachers`` whose student is ``model`` as it
    is (e.g. holding one teacher's weights: the student's architecture is the teachers'), timed
    on ``batch`` (the run's first transfer batch) and ``selection``; nothing changes. ``reserve``
    holds the run's checks outside its steps: the student's start and end on the selection split
    and, with an ``evaluation`` split, its start and end there (timed as the selection's, per
    example). The ServerApp sizes a run with it before the merge, so that the teachers' outputs
    can be cached for the sized steps (``prepare``)."""
    _check_combine(teacher)
    device = next(iter(model.parameters())).device
    x, y = batch[0].to(device), batch[1].to(device)
    ensemble = StateEnsemble(model, teachers, combine=teacher)
    with torch.no_grad():
        target = ensemble(x)  # (also the warm-up pass)
        teachers_seconds = _timed(lambda: ensemble(x), device, warm_up=False)
    live, own_keys = trainable_state(model, model.state_dict(), in_place=True)
    trained = [live[k] for k in own_keys if live[k].requires_grad]
    student = _student_seconds(model, live, trained, x, y, target, loss_fn, temperature, label_weight, device)
    training = model.training
    model.eval()
    try:
        check = _timed(lambda: mean_loss(model, loss_fn, selection, device), device, passes=1, warm_up=False)
    finally:
        model.train(training)
    per_example = check / sum(len(b[1]) for b in selection)
    evaluating = 0.0 if evaluation is None else per_example * sum(len(b[1]) for b in evaluation)
    return StepCost(teachers_seconds, student, check, reserve=2 * (check + evaluating),
                    row_bytes=target[0].numel() * target[0].element_size())


def ensemble_distill(
    model: nn.Module,
    student: dict,
    teachers: list[dict],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: Iterable[Batch],
    selection: list[Batch],
    evaluation: list[Batch] | None = None,
    steps: int | None = 200,
    lr: float | Callable[[int], float] = 1e-3,
    temperature: float = 1.0,
    eval_every: int = EVAL_EVERY,
    progress: bool = False,
    label_weight: float = 0.0,
    augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None,
    seed: int = 0,
    teacher: str = "logits",
    in_place: bool = False,
    scratch_dir: str | None = None,
    budget: float | None = None,
    memo_bytes: int = MEMO_BYTES,
) -> DistillResult:
    """Distil the mean-logit ensemble of ``teachers`` into ``student`` (see the module doc).

    model: any module of the architecture (evaluated with the student's tensors through
    ``torch.func.functional_call``; its own weights are not used or changed);
    teachers: their states, or their :class:`TeacherOutputs` cached by :func:`cache_teacher_outputs`
    for this run; batches: an endless (or long enough) iterable of proxy ``(inputs, targets)``
    training batches (targets used only when ``label_weight > 0``); selection / evaluation: lists of
    batches disjoint from them; ``seed`` seeds ``augment``'s random views; ``teacher``: how the
    ensemble combines the teachers (:class:`LogitEnsemble`'s ``combine``); ``lr``: Adam's rate, or a
    function of the run's steps giving it (:class:`fedbasin.options.StepsSizedRate`; ``DistillResult.lr``).

    Memory: the student is trained on a copy, or with ``in_place`` on its own tensors (when they
    are in the model's dtypes and device; the caller's ``student`` then holds the result). The
    best state seen when it is not the live one (θ₀ too, when ``in_place``) is kept on disk in
    ``scratch_dir`` (:mod:`fedbasin.scratch`), not in memory; Adam steps each parameter inside the
    backward pass, so one gradient is alive at a time.

    Time: ``steps=None`` takes as many steps as ``budget`` seconds allow (the whole call), sized
    before the first step by :func:`probe_step`'s timings on the first transfer batch (the student
    as it starts; nothing changes, the torch random state included), so the cosine schedule spans
    the sized run and ``DistillResult.steps`` given as ``steps`` repeats it bitwise. A ``budget``
    with ``steps`` given (a run sized beforehand: the ServerApp's, whose teachers' outputs were
    cached for it) only bounds the call. A budgeted run whose steps run slower than timed stops
    once the budget less its last checks is spent, with a last check there (``stopped_at_budget``).
    Without a ``budget`` the run takes exactly ``steps``.

    Teachers given as states, without ``augment``: their ensemble's output on each distinct
    transfer input is kept (:class:`EnsembleMemo`, at most ``memo_bytes``; 0: none), so the
    proxy's epochs after the first read it instead of running the teachers again, and a run sized
    by its budget counts the teachers in the first epoch's steps only (:func:`memo_teacher_steps`).
    """
    if not teachers:
        raise ValueError("ensemble distillation needs at least one teacher")
    if not selection:
        raise ValueError("ensemble distillation: the selection split is empty (keep-best needs data to choose on)")
    sized = steps is None
    if budget is not None and not (isinstance(budget, (int, float)) and math.isfinite(budget)
                                   and (budget > 0 or not sized)):
        raise ValueError(f"budget must be a number of seconds{' > 0' * sized}, got {budget!r}")
    if sized and budget is None:
        raise ValueError("steps=None sizes the run by its budget: give budget (seconds)")
    check_step_options(0 if sized else steps, eval_every, temperature=temperature,
                       **({} if callable(lr) else {"lr": lr}))
    if not (isinstance(label_weight, (int, float)) and 0 <= label_weight <= 1):
        raise ValueError(f"label_weight must be a number in [0, 1], got {label_weight!r}")
    started = time.perf_counter()
    device = next(iter(model.parameters())).device
    cached = all(isinstance(t, TeacherOutputs) for t in teachers)
    if not cached and any(isinstance(t, TeacherOutputs) for t in teachers):
        raise ValueError("teachers must be all states or all cached outputs, not a mix")
    if cached and sized:
        raise ValueError("cached teacher outputs fix the run's steps: give steps (their length), not None")
    if cached and any(len(t) != steps for t in teachers):
        raise ValueError(f"cached teacher outputs cover {sorted({len(t) for t in teachers})} steps, "
                         f"the run takes {steps}")
    _check_combine(teacher)
    # the teachers are evaluated from their own tensors (no K module copies: server memory)
    ensemble = None if cached else StateEnsemble(model, teachers, combine=teacher)
    if ensemble is not None and augment is None and memo_bytes > 0:
        ensemble = EnsembleMemo(ensemble, memo_bytes)
    live, own_keys = trainable_state(model, student, in_place)
    training = model.training

    def student_logits(x: torch.Tensor) -> torch.Tensor:  # the student stays tied where the module is: one
        return _logits_of(torch.func.functional_call(model, live, (x,)))  # tensor per tied group (trainable_state)

    def split_loss(split: list[Batch]) -> float:
        model.eval()
        return mean_loss(student_logits, loss_fn, split, device)

    best_copy = ScratchTensors(scratch_dir)  # the best state seen, while the live one moves on

    def keep_best() -> None:
        best_copy.clear()
        for key in own_keys:
            best_copy.append(live[key])

    check_started = time.perf_counter()
    best = initial = split_loss(selection)
    check_seconds = time.perf_counter() - check_started  # (the loss is read: the device is synchronised)
    result = DistillResult({}, [(0, initial)], initial_loss=initial)
    evaluation_seconds = 0.0
    if evaluation is not None:
        result.evaluation_initial_loss = split_loss(evaluation)
        evaluation_seconds = time.perf_counter() - check_started - check_seconds
    transfer = transfer_batches(batches, None if sized else steps, augment, seed)
    if sized:  # time one step's parts on the first transfer batch (changing nothing), then size the run
        first = next(transfer)
        memo = (lambda row_bytes: memo_teacher_steps(batches, augment, row_bytes, memo_bytes)) \
            if isinstance(ensemble, EnsembleMemo) else (lambda row_bytes: None)
        steps = _sized_steps(model, live, own_keys, ensemble, first, loss_fn, temperature, label_weight, device,
                             StepCost(0.0, 0.0, check_seconds, reserve=check_seconds + evaluation_seconds),
                             eval_every, lambda: budget - (time.perf_counter() - started), memo)
        transfer = itertools.chain([first], itertools.islice(transfer, steps - 1)) if steps else iter(())
    result.steps = steps
    if callable(lr):  # a rate sized by the run's steps: checked once they chose it
        lr = lr(steps)
        check_step_options(steps, eval_every, lr=lr)
    result.lr = lr
    last_checks = check_seconds + evaluation_seconds  # a budgeted run keeps them for its end
    if in_place:
        keep_best()  # θ₀ exists nowhere else
    # Adam per parameter, stepped as soon as that parameter's gradient is complete (inside the
    # backward pass, the gradient freed at once): one Adam's updates over all parameters, with
    # one parameter's gradient alive at a time instead of all of them, and each parameter stepped
    # in slices of ADAM_SLICE elements, so that Adam's temporaries are a slice's, not a large
    # embedding's (server memory; element-wise, so bitwise the same updates)
    optimisers = {id(live[k]): _sliced_adam(live[k], lr) for k in own_keys if live[k].requires_grad}
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: 0.5 * (1 + math.cos(math.pi * t / max(steps, 1))))
                 for o, _ in optimisers.values()]

    def step_now(parameter: torch.Tensor) -> None:
        optimiser, slices = optimisers[id(parameter)]
        if slices[0] is not parameter:  # the gradient, cut as the parameter was
            gradient = parameter.grad.reshape(-1)
            for i, piece in enumerate(slices):
                piece.grad = gradient[i * ADAM_SLICE:(i + 1) * ADAM_SLICE]
        optimiser.step()
        for piece in slices:
            piece.grad = None
        parameter.grad = None

    trained = [live[k] for k in own_keys if live[k].requires_grad]
    hooks = [p.register_post_accumulate_grad_hook(step_now) for p in trained]
    try:
        with tqdm(total=steps, desc="ensemble distillation", unit="step", disable=not progress, leave=False) as bar:
            for step, (x, y) in enumerate(transfer, start=1):
                x = x.to(device)
                model.train()
                logits = student_logits(x)
                with torch.no_grad():  # the teachers after the student: one logit tensor fewer in its forward
                    target = (ensemble_of((t[step - 1].to(device) for t in teachers), teacher) if cached
                              else ensemble(x))
                loss = (1 - label_weight) * distillation_loss(logits, target, temperature)
                if label_weight > 0:
                    loss = loss + label_weight * loss_fn(logits, y.to(device))
                loss.backward()  # every parameter's Adam step runs in here (step_now)
                if not all_finite(loss, trained):  # diverged: the best state seen so far comes back
                    result.diverged_step = step
                    break
                del logits, loss, target
                for schedule in schedules:
                    schedule.step()
                bar.update(1)
                if budget is not None and step < steps and time.perf_counter() - started > budget - last_checks:
                    steps = result.stopped_at_budget = step  # slower steps than timed: the budget holds, a last check
                if step % eval_every == 0 or step == steps:
                    value = split_loss(selection)
                    result.history.append((step, value))
                    if value < best:
                        best, result.best_step = value, step
                        if step < steps:  # at the last step the live state is the best one
                            keep_best()
                    if progress:
                        bar.set_postfix(best=f"{best:.4f}")
                if step == steps:  # (stopped at the budget: the transfer batches go on)
                    break
    finally:
        for hook in hooks:
            hook.remove()
        optimisers.clear()  # Adam's moments go before the best state comes back
        schedules.clear()
        model.train(training)
    result.best_loss = best
    if result.improved or in_place:
        if result.best_step != steps:  # the live state moved past the best one: bring it back
            with torch.no_grad():
                for i, key in enumerate(own_keys):
                    live[key].copy_(best_copy[i])
        state = live
        if evaluation is not None:
            result.evaluation_loss = split_loss(evaluation) if result.improved else result.evaluation_initial_loss
    else:
        state = student  # θ₀: the caller's own tensors, untouched
        result.evaluation_loss = result.evaluation_initial_loss
    best_copy.close()
    # (in the model's dtypes, on the CPU: no copy when they are)
    result.state = {k: state[k].detach().to("cpu", v.dtype) for k, v in model.state_dict().items()}
    result.steps = steps
    result.seconds = time.perf_counter() - started
    return result


def _sized_steps(model, live, own_keys, ensemble, batch, loss_fn, temperature, label_weight, device,
                 checks: StepCost, eval_every, seconds_left: Callable[[], float],
                 teacher_steps: Callable[[int], int | None]) -> int:
    """:func:`ensemble_distill`'s steps with ``steps=None``: :func:`probe_step`'s timings with the
    run's own student (``live``), teachers and first batch, and its checks (``checks``: their
    measured seconds), sized to the seconds left once they are timed (``seconds_left()``), the
    teachers counted in the steps ``teacher_steps(output bytes per example)`` gives (None: all)."""
    x, y = batch[0].to(device), batch[1].to(device)
    teachers = ensemble.ensemble if isinstance(ensemble, EnsembleMemo) else ensemble  # timed without the memo
    with torch.no_grad():
        target = teachers(x)  # (also the warm-up pass)
        checks.teachers = _timed(lambda: teachers(x), device, warm_up=False)
    trained = [live[k] for k in own_keys if live[k].requires_grad]
    checks.student = _student_seconds(model, live, trained, x, y, target, loss_fn, temperature, label_weight, device)
    return checks.steps(seconds_left(), eval_every, teacher_steps(target[0].numel() * target[0].element_size()))
