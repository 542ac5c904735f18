"""Per-family check: planted symmetry recovery time and a barrier-free midpoint, on small random
Hugging Face models (float64, no downloads).

    python -m fedbasin.benchmarks.bench_families

For each family: a random model θ (seed 0, every weight perturbed, norm gains ~1), a random
group element g (seed 11), candidate g·θ (same function). Reported: weight-matching time to
recover θ (50 iterations max, tol 1e-12), the largest weight difference after alignment, and the
relative logit change at the midpoint ½(θ + candidate) without and with alignment (0 = no
barrier: the aligned midpoint computes θ's function).
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

FAMILIES = {
    "gpt2": dict(n_layer=4, n_embd=64, n_head=4, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0),
    "vit": dict(image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=4,
                num_attention_heads=4, intermediate_size=128, num_labels=5),
    "llama": dict(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=32),
    "mistral": dict(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=4, intermediate_size=128, max_position_embeddings=32),
    "qwen2": dict(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=128, max_position_embeddings=32, tie_word_embeddings=True),
    "gpt_neox": dict(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=32, rotary_pct=0.25),
}


def _float64_norms():
    """HF RMSNorm computes in float32 internally; in float64 runs compute it in float64 (the
    symmetry is exact in real arithmetic, this keeps float32 rounding out of the check)."""
    import importlib

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for name, cls in (("llama", "LlamaRMSNorm"), ("mistral", "MistralRMSNorm"), ("qwen2", "Qwen2RMSNorm")):
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        getattr(module, cls).forward = forward


def run_family(model_type: str, config: dict) -> dict:
    from fedbasin.alignment import apply_group, canonicalize, random_group_element, weight_match
    from fedbasin.alignment.hf import hf_adapter, hf_config_class, hf_config_updates, hf_model_class

    cfg = hf_config_class(model_type)(**config)
    torch.manual_seed(0)
    model = hf_model_class(model_type)(cfg).double().eval()
    g = torch.Generator().manual_seed(1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            is_gain = ("norm" in name or "ln" in name) and name.endswith("weight")
            p.copy_(1.0 + 0.3 * noise) if is_gain else p.add_(0.1 * noise)
    adapter = hf_adapter(model)
    spec = adapter.spec
    reference = adapter.to_standard(model.state_dict())
    canonical = canonicalize(spec, reference)
    candidate = apply_group(spec, canonical.state, random_group_element(spec, 11, "orthogonal"))
    t0, cpu0 = time.perf_counter(), time.process_time()
    result = weight_match(spec, reference, candidate, iterations=50, tol=1e-12)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    diff = max(float((result.state[k] - reference[k]).abs().max()) for k in reference)

    if model_type == "vit":
        x = torch.rand(2, 1, 8, 8, generator=g, dtype=torch.float64)
    else:
        x = torch.randint(0, config["vocab_size"], (2, 16), generator=g)

    def outputs(standard_state):
        state = adapter.from_standard(standard_state)
        c = type(cfg).from_dict({**cfg.to_dict(), **hf_config_updates(cfg, state)})
        m = hf_model_class(model_type)(c).double().eval()
        m.load_state_dict(state, strict=True)
        with torch.no_grad():
            return m(x).logits

    want = outputs(reference)
    mid = lambda other: {k: 0.5 * (reference[k] + other[k]) for k in reference}  # noqa: E731
    change = lambda s: float((outputs(s) - want).norm() / want.norm())  # noqa: E731
    return {
        "family": model_type, "parameters": sum(v.numel() for v in model.state_dict().values()),
        "recovery_seconds": round(seconds, 2), "recovery_cpu_seconds": round(cpu, 2),
        "iterations": result.iterations,
        "max_weight_difference": float(f"{diff:.2e}"),
        "midpoint_logit_change_unaligned": float(f"{change(mid(candidate)):.3g}"),
        "midpoint_logit_change_aligned": float(f"{change(mid(result.state)):.2g}"),
    }


def main(argv=None) -> list:
    _float64_norms()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    rows = [run_family(t, c) for t, c in FAMILIES.items()]
    print(json.dumps({"machine": platform.machine(), "threads": torch.get_num_threads(),
                      "load_average_1min": round(os.getloadavg()[0], 2), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
