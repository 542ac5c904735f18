"""``inverse(g)``: applying g then g⁻¹ gives the state back, and ``compose(g, g⁻¹)`` acts as the
identity, for every model variant in the orthogonal and invertible groups and under grouped-query
attention with partial rotary maps."""

from __future__ import annotations

import pytest
import torch

from fedbasin.alignment import apply_group, canonicalize, compose, inverse, random_group_element

from .helpers import spec_of, trained_like, variant_id, variants

VARIANTS = variants()


def assert_identity(spec, state, g):
    there = apply_group(spec, state, g)
    assert max(float((there[k] - state[k]).abs().max()) for k in state) > 1e-3  # g moves the state
    back = apply_group(spec, there, inverse(g))
    assert max(float((back[k] - state[k]).abs().max()) for k in state) < 1e-10
    once = apply_group(spec, state, compose(g, inverse(g)))
    assert max(float((once[k] - state[k]).abs().max()) for k in state) < 1e-10


@pytest.mark.parametrize("variant", VARIANTS[::3], ids=variant_id)
@pytest.mark.parametrize("mode", ["orthogonal", "invertible"])
def test_inverse_undoes_the_element(variant, mode):
    family, config = variant
    spec = spec_of(family, config)
    state = canonicalize(spec, trained_like(family, config, seed=4).state_dict()).state
    assert_identity(spec, state, random_group_element(spec, 1, mode=mode, scales=True, state=state))


@pytest.mark.parametrize("mode", ["orthogonal", "invertible"])
def test_inverse_under_grouped_query_attention(mode):
    from .helpers import gqa_attention

    _, spec, state = gqa_attention(torch.Generator().manual_seed(0))
    assert_identity(spec, state, random_group_element(spec, 3, mode=mode, scales=True))


def test_cli_align_with_dual_refinement_writes_the_same_path_from_the_unmoved_reference(tmp_path, capsys, monkeypatch):
    """``--refine-dual``: ``merge`` writes the midpoint of the two moved endpoints; ``align`` writes the
    candidate mapped back into the reference's basis (g_ref⁻¹·g_cand·B), which keeps the candidate's
    function, and whose midpoint with the unmoved reference computes the merge's function."""
    import json

    from fedbasin.checkpoint import build_torch_model, load_checkpoint, save_checkpoint
    from fedbasin.cli import main

    from .helpers import DIGITS_VIT, cli_error, rel_err, spy_on_cli_refine, trained_digits_vit

    seen = []
    spy_on_cli_refine(monkeypatch, lambda k: seen.append(k.get("dual")))
    for seed in (0, 1):
        save_checkpoint(tmp_path / f"m{seed}", "vit", DIGITS_VIT, trained_digits_vit(seed))
    m0, m1 = str(tmp_path / "m0"), str(tmp_path / "m1")
    options = ["--refine-data", "digits", "--refine-steps", "20", "--refine-examples", "300", "--refine-eval-every", "5",
               "--refine-group", "invertible", "--refine-lr", "0.01", "--refine-dual"]
    assert main(["align", m0, m1, "--out", str(tmp_path / "aligned"), *options]) == 0
    summary = json.loads(capsys.readouterr().out)["refinement"]
    assert summary["dual"] is True and summary["best_step"] > 0
    assert main(["merge", m0, m1, "--out", str(tmp_path / "merged"), *options, "--distill-steps", "0"]) == 0
    capsys.readouterr()
    assert seen == [True, True]
    x = torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(0))

    def outputs(state_or_path):
        checkpoint = load_checkpoint(str(tmp_path / "m0"))
        state = load_checkpoint(state_or_path).state if isinstance(state_or_path, str) else state_or_path
        with torch.no_grad():
            return build_torch_model(checkpoint, state)(x)

    reference, aligned = load_checkpoint(m0).state, load_checkpoint(str(tmp_path / "aligned")).state
    assert rel_err(outputs(aligned), outputs(m1)) < 1e-5
    midpoint = {k: (reference[k] + aligned[k]) / 2 for k in reference}
    assert rel_err(outputs(midpoint), outputs(str(tmp_path / "merged"))) < 1e-5
    assert rel_err(outputs(midpoint), outputs({k: (reference[k] + load_checkpoint(m1).state[k]) / 2
                                               for k in reference})) > 1e-2  # not the plain average
    assert cli_error(capsys, ["align", m0, m1, "--out", str(tmp_path / "x"), "--refine-dual"]).endswith(
        "--refine-dual has no effect without --refine-data")
    assert cli_error(capsys, ["merge", m0, m1, "--out", str(tmp_path / "x"), *options, "--weights", "0,1"]).endswith(
        "--refine-dual moves the reference along the path: its --weights entry must be > 0")
