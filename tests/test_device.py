"""Device handling: every step runs on the tensors' device (assignments on the CPU); CUDA cases
skip cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

from .causal_lm import float64_rmsnorm, hf_model  # noqa: F401
from fedbasin.alignment import apply_group, canonicalize, merge, random_group_element, weight_match
from fedbasin.alignment.hf import hf_adapter

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["orthogonal", "permutation"])
def test_matching_runs_on_the_tensors_device(device, mode):
    model = hf_model("llama", num_key_value_heads=2, dtype=torch.float32)
    adapter = hf_adapter(model)
    spec = adapter.spec
    reference = adapter.to_standard(model.state_dict())
    other = adapter.to_standard(hf_model("llama", seed=1, num_key_value_heads=2, dtype=torch.float32).state_dict())
    on = lambda s: {k: v.to(device) for k, v in s.items()}  # noqa: E731
    result = weight_match(spec, on(reference), on(other), mode=mode, iterations=3)
    assert {v.device.type for v in result.state.values()} == {device}
    assert result.transform.residual.device.type == device
    cpu = weight_match(spec, reference, other, mode=mode, iterations=3)
    assert result.objective[-1] == pytest.approx(cpu.objective[-1], rel=1e-4)
    merged = merge(spec, [on(reference), on(other)], iterations=2)
    assert {v.device.type for v in merged.state.values()} == {device}


@pytest.mark.parametrize("device", DEVICES)
def test_group_action_on_device(device):
    model = hf_model("gpt_neox", rotary_pct=0.5)
    adapter = hf_adapter(model)
    spec = adapter.spec
    canonical = canonicalize(spec, {k: v.to(device) for k, v in adapter.to_standard(model.state_dict()).items()})
    g = random_group_element(spec, 3, "orthogonal", dtype=torch.float64)
    moved = apply_group(spec, canonical.state, g)
    assert {v.device.type for v in moved.values()} == {device}
    result = weight_match(spec, canonical.state, moved, iterations=40, tol=1e-12)
    assert max(float((result.state[k] - canonical.state[k]).abs().max()) for k in moved) < 1e-6
