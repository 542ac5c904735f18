"""Small shared fixtures: tiny fedbasin models, fixed inputs, perturbed 'trained-like' weights."""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from fedbasin.alignment import fedbasin_adapter
from fedbasin.models import build_model, make_config

VIT = dict(image_size=8, patch_size=4, channels=1, num_classes=5, dim=16, depth=2, heads=2, mlp_dim=24)
GPT = dict(vocab_size=23, block_size=12, dim=16, depth=2, heads=2, mlp_dim=24)


def variants():
    """(family, config) for every supported option combination of the fedbasin models."""
    out = []
    for norm, act, bias in itertools.product(("layernorm", "rmsnorm"), ("gelu", "relu", "swiglu"), (True, False)):
        out.append(("vit", dict(VIT, norm=norm, activation=act, bias=bias)))
        for pos in ("learned", "rope"):
            out.append(("gpt", dict(GPT, norm=norm, activation=act, bias=bias, position=pos)))
    out.append(("gpt", dict(GPT, tie_embeddings=True)))
    return out


def variant_id(v) -> str:
    family, c = v
    parts = [family, c["norm"][:3] if "norm" in c else "ln", c.get("activation", "gelu")]
    parts += ["bias" if c.get("bias", True) else "nobias"]
    if family == "gpt":
        parts += [c.get("position", "learned")] + (["tied"] if c.get("tie_embeddings") else [])
    return "-".join(parts)


def trained_like(family: str, config: dict, seed: int, dtype=torch.float64):
    """A model whose weights (gains and biases included) are far from init, like a trained one."""
    model = build_model(family, config, seed=seed).to(dtype)
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.5 * noise)  # non-trivial gains, some negative
            else:
                p.add_(0.1 * noise)
    return model


def spec_of(family: str, config: dict):
    return fedbasin_adapter(family, make_config(family, config)).spec


def inputs(family: str, config: dict, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if family == "vit":
        x = torch.rand(4, config["channels"], config["image_size"], config["image_size"], generator=g, dtype=torch.float64)
        y = torch.randint(0, config["num_classes"], (4,), generator=g)
        return x.to(dtype), y
    ids = torch.randint(0, config["vocab_size"], (4, config["block_size"]), generator=g)
    return ids, ids


def run(family: str, config: dict, state: dict, x, dtype=torch.float64):
    """Outputs of a model of this family/config (tied embeddings untied) carrying ``state``."""
    model = build_model(family, dict(config, **({"tie_embeddings": False} if family == "gpt" else {}))).to(dtype)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(x)


def loss(family: str, config: dict, state: dict, data, dtype=torch.float64) -> float:
    x, y = data
    out = run(family, config, state, x, dtype)
    if family == "gpt":
        return float(F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), y[:, 1:].reshape(-1)))
    return float(F.cross_entropy(out, y))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def max_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two state dicts over ``b``'s keys (in float64)."""
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)


DIGITS_VIT = dict(image_size=8, patch_size=2, channels=1, num_classes=10, dim=16, depth=1, heads=2, mlp_dim=32)


class _Float64Inputs(torch.nn.Module):
    """``module(x.double())``: a float64 module fed the float32 batches of a data split."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.double())


@functools.lru_cache(maxsize=None)
def _trained_digits_vit(seed: int) -> dict:
    from fedbasin.data import load_task
    from fedbasin.training import train

    model = build_model("vit", DIGITS_VIT, seed=seed).double()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same weights at any OMP_NUM_THREADS (see trained_digits_vit)
    try:
        train(_Float64Inputs(model), load_task("digits", seed=0).train, epochs=12, lr=1e-2, seed=seed)
    finally:
        torch.set_num_threads(threads)
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def trained_digits_vit(seed: int) -> dict:
    """A tiny ViT really trained on scikit-learn digits from its own init and batch order (12
    epochs, ~3 s), returned in float32; trained once per test session, a fresh copy per call.
    Trained in float64 on one thread: 12 epochs at lr 1e-2 amplify rounding differences about
    10⁹-fold (a 1e-13 relative change of the initial weights moves the trained ones by 1.3e-4), so
    in float32 the CPU type, BLAS build or thread count decides which pair the tests get (an
    AVX2 machine failed bounds measured on an AVX-512 one); in float64 those differences (~1e-16)
    stay far below anything a test measures, and the figures the tests rely on hold on any machine."""
    return {k: v.clone() for k, v in _trained_digits_vit(seed).items()}


def digits_loss(state: dict, split: str = "test") -> float:
    """Mean cross-entropy of a DIGITS_VIT carrying ``state`` on the digits ``split``."""
    from fedbasin.data import load_task

    model = build_model("vit", DIGITS_VIT)
    model.load_state_dict(state)
    return load_task("digits", seed=0).evaluate(model, split)["loss"]


def expanded(kwargs: dict) -> dict:
    """``learned_refine`` keyword arguments with its option objects (``options=``, ``match=``) spelt out as
    the keywords they stand for (:func:`fedbasin.options.refine_call`, looked up at call time)."""
    from fedbasin import options as schema

    if "options" not in kwargs:
        return dict(kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in ("options", "match")}
    return {**rest, **schema.refine_call(kwargs["options"], kwargs["match"])}


def spy_on_cli_refine(monkeypatch, record) -> None:
    """Make ``fedbasin.alignment.learned_refine`` (which the CLI imports when it refines) call
    ``record(kwargs)`` (the option objects spelt out, :func:`expanded`) before refining. The ServerApp
    binds ``learned_refine`` when it is first imported, so it is imported here first and keeps the real
    one for later tests."""
    import fedbasin.server.server_app  # noqa: F401
    from fedbasin import alignment

    original = alignment.learned_refine

    def spy(*args, **kwargs):
        record(expanded(kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(alignment, "learned_refine", spy)


def cli_error(capsys, argv) -> str:
    """Run the CLI expecting a refusal: a non-zero exit (argparse's own exit included), no
    traceback; returns the last stderr line (the one-line error)."""
    from fedbasin.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code not in (0, None), err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def gqa_attention(generator: torch.Generator):
    """(attention spec, symmetry spec, float64 state) of one attention layer of width 12: 6 query
    heads in 2 key/value groups, 4 of 8 head dims rotating (partial rotary), weights from ``generator``."""
    from fedbasin.alignment.spec import AttentionSpec, Linear, SymmetrySpec

    d = 12
    a = AttentionSpec(*(Linear(f"{n}.weight", f"{n}.bias") for n in "qkvo"), num_heads=6, head_dim=8,
                      rotary="half", num_kv_heads=2, rotary_dims=4)
    spec = SymmetrySpec(d, (("q.weight", 1), ("k.weight", 1), ("v.weight", 1), ("o.weight", 0), ("o.bias", 0)),
                        (), (a,))
    shapes = {"q": (48, d), "k": (16, d), "v": (16, d), "o": (d, 48)}
    state = {f"{n}.{p}": torch.randn(s if p == "weight" else s[:1], generator=generator, dtype=torch.float64)
             for n, s in shapes.items() for p in ("weight", "bias")}
    return a, spec, state


def load_script(name: str):
    """The module of ``scripts/NAME.py`` (scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
