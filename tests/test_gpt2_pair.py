"""`gpt2_pair` trains the recipe's GPT-2 on the device it is given (`--device`), and `glmc_compare`
evaluates its curves there with the CPU's losses; CUDA cases skip without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_device import DEVICES
from tests.test_tokenizer_data import NEEDS_SHARED_TEXT, TOKENIZER, _gpt2, shakespeare_excerpt

pytestmark = NEEDS_SHARED_TEXT


@pytest.fixture
def excerpt(tmp_path):
    return shakespeare_excerpt(tmp_path, 12_000)


@pytest.mark.parametrize("device", DEVICES)
def test_pair_training_on_device(tmp_path, excerpt, device):
    """One epoch on the device: the record names it, the loss fell from log V, and the saved model's
    test loss recomputed on the CPU is the one recorded."""
    from fedbasin.benchmarks.gpt2_pair import main, mean_loss, pair_data
    from fedbasin.checkpoint import build_torch_model, load_checkpoint

    out = tmp_path / "pair"
    assert main(["--seed", "0", "--epochs", "1", "--out", str(out), "--text", str(excerpt), "--tokenizer",
                 str(TOKENIZER), "--block-size", "32", "--batch-size", "8", "--micro-batch", "4", "--lr", "3e-3",
                 "--device", device]) == 0
    record = json.loads((out / "seed0" / "train.json").read_text())
    assert record["device"].split(":")[0] == device
    _, splits = pair_data(str(excerpt), str(TOKENIZER), 32)
    assert record["steps"] == -(-len(splits["train"]) // 8)
    assert record["test_loss"] < 0.9 * torch.log(torch.tensor(50257.0)).item()
    checkpoint = load_checkpoint(out / "seed0")
    assert mean_loss(build_torch_model(checkpoint, checkpoint.state), splits["test"]) == pytest.approx(
        record["test_loss"], rel=1e-4)
    assert not (out / "seed0.state.pt").exists()


@pytest.mark.parametrize("device", DEVICES)
def test_curves_on_device_equal_the_cpus(tmp_path, excerpt, device):
    from fedbasin.benchmarks.glmc_compare import main

    a, b = _gpt2(tmp_path / "a", 0), _gpt2(tmp_path / "b", 1)
    common = [str(a), str(b), "--text", str(excerpt), "--max-blocks", "4", "--points", "3", "--variants",
              "orthogonal/rms/sqrt", "--circuit-variant", ""]
    cpu, there = main([*common, "--device", "cpu"]), main([*common, "--device", device])
    assert there["machine"].startswith("x86_64 CPU" if device == "cpu" else "cuda")
    for name, row in cpu["rows"].items():
        assert there["rows"][name]["losses"] == pytest.approx(row["losses"], rel=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("module", ["gpt2_pair", "glmc_compare"])
def test_an_unusable_device_is_refused_in_one_line(tmp_path, excerpt, capsys, module):
    import importlib

    main = importlib.import_module(f"fedbasin.benchmarks.{module}").main
    a = _gpt2(tmp_path / "a", 0)
    args = (["--out", str(tmp_path / "pair"), "--text", str(excerpt), "--tokenizer", str(TOKENIZER)]
            if module == "gpt2_pair" else [str(a), str(a), "--text", str(excerpt)])
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--device", "cuda"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--device 'cuda': no CUDA GPU is visible here" in message and not (tmp_path / "pair").exists()


def test_llama_recipe_trains_and_the_command_line_reads_it(tmp_path, excerpt, capsys):
    """``--model-type llama``: a LlamaForCausalLM (RoPE, GQA 4/2, SwiGLU, RMSNorm) on the same data,
    saved with its tokenizer, which `fedbasin eval` and `fedbasin align` take as they are. In float32: the
    recipe's bfloat16 autocast (test_pair_training_on_device) is emulated on a CPU without bf16 kernels, 4 s
    per step on an AVX2-only EPYC."""
    from fedbasin import cli
    from fedbasin.benchmarks.gpt2_pair import main
    from fedbasin.checkpoint import load_checkpoint

    out = tmp_path / "pair"
    assert main(["--model-type", "llama", "--seed", "0", "--seed", "1", "--epochs", "1", "--out", str(out), "--text",
                 str(excerpt), "--tokenizer", str(TOKENIZER), "--block-size", "32", "--batch-size", "8",
                 "--micro-batch", "8", "--lr", "3e-3", "--fp32"]) == 0
    capsys.readouterr()
    record = json.loads((out / "seed0" / "train.json").read_text())
    assert record["model_type"] == "llama" and record["autocast"] is None and record["test_loss"] < 0.9 * torch.log(torch.tensor(50257.0)).item()
    checkpoint = load_checkpoint(out / "seed0")
    assert checkpoint.family == "llama" and checkpoint.config.num_key_value_heads == 2
    assert checkpoint.config.intermediate_size == 344 and not checkpoint.config.tie_word_embeddings
    assert cli.main(["eval", str(out / "seed0"), "--data", f"text:{excerpt}", "--max-examples", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(record["test_loss"], rel=0.5)
    # plain align of a trained subword LM: weight matching refined on the weights' own synthetic tokens (a short
    # budget here; 120 s by default)
    assert cli.main(["align", str(out / "seed0"), str(out / "seed1"), "--out", str(tmp_path / "aligned"),
                     "--refine-budget", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["data_free"] == "weight matching refined on --refine-data bigram"
    assert cli.main(["barrier", str(out / "seed0"), str(tmp_path / "aligned"), "--data", f"text:{excerpt}",
                     "--max-examples", "4", "--points", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["barrier"] >= 0


@pytest.mark.parametrize("flag", ["--text", "--tokenizer"])
def test_a_missing_text_or_tokenizer_is_refused_in_one_line_before_any_work(tmp_path, excerpt, capsys, flag):
    from fedbasin.benchmarks.gpt2_pair import main

    given = {"--text": str(excerpt), "--tokenizer": str(TOKENIZER), flag: str(tmp_path / "missing")}
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "pair"), *[x for kv in given.items() for x in kv]])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gpt2_pair.py: error: " + flag) or f"error: {flag}" in err[-1]
    assert "Traceback" not in "\n".join(err) and not (tmp_path / "pair").exists()
