"""Text proxy data through real Hugging Face tokenizers: the model's own tokenizer is found, data that
cannot fit the model is refused in one line, and `fedbasin align --refine-data` writes a refined
endpoint with the candidate's function."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from fedbasin.checkpoint import build_torch_model, load_checkpoint, save_checkpoint
from fedbasin.cli import main
from fedbasin.data import load_task
from tests.helpers import cli_error

SHARED = Path(os.environ.get("FEDBASIN_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
TOKENIZER = SHARED / "gpt2_tokenizer"
SHAKESPEARE = SHARED / "tinyshakespeare" / "input.txt"
NEEDS_SHARED_TEXT = pytest.mark.skipif(not TOKENIZER.is_dir() or not SHAKESPEARE.is_file(),
                                       reason="needs ../shared/data (gpt2_tokenizer, tinyshakespeare)")
pytestmark = NEEDS_SHARED_TEXT


def shakespeare_excerpt(directory: Path, chars: int) -> Path:
    """The first ``chars`` characters of Tiny Shakespeare as ``directory/excerpt.txt``."""
    path = directory / "excerpt.txt"
    path.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:chars], encoding="utf-8")
    return path


@pytest.fixture
def text_file(tmp_path):
    return shakespeare_excerpt(tmp_path, 30_000)


def _gpt2(path, seed, vocab=50257, with_tokenizer=True):
    """A tiny HF GPT-2 (width 16, 1 layer, context 32) saved with or without the GPT-2 tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=16, n_layer=1, n_head=2, n_inner=32,
                        tie_word_embeddings=False)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():  # spread the weights like a trained model's (init is too uniform to align)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_checkpoint(path, "gpt2", config, model.state_dict(), kind="hf")
    if with_tokenizer:
        for item in TOKENIZER.iterdir():
            shutil.copy(item, path / item.name)
    return path


def test_text_task_uses_the_hf_tokenizer(text_file):
    from transformers import AutoTokenizer

    task = load_task(f"text:{text_file}", tokenizer=str(TOKENIZER), block_size=32)
    reference = AutoTokenizer.from_pretrained(str(TOKENIZER))
    ids = reference(text_file.read_text(encoding="utf-8"))["input_ids"]
    assert task.model_overrides == {"vocab_size": 50257, "block_size": 32}
    first = [i for i, row in enumerate(task.train.inputs.tolist()) if row == ids[:32]]  # the split is shuffled
    assert len(first) == 1 and task.train.targets[first[0]].tolist() == ids[1:33]
    assert task.tokenizer.decode(task.train.inputs[first[0]]) == reference.decode(ids[:32])


def test_align_refines_on_text_with_the_models_own_tokenizer(tmp_path, text_file, capsys):
    ref, cand = _gpt2(tmp_path / "ref", 1), _gpt2(tmp_path / "cand", 2)
    out = tmp_path / "aligned"
    assert main(["align", str(ref), str(cand), "--out", str(out), "--refine-data", f"text:{text_file}",
                 "--refine-steps", "6", "--refine-examples", "60", "--refine-batch-size", "8",
                 "--iterations", "3", "--tol", "0", "--refine-evaluation-fraction", "0.2"]) == 0
    summary = json.loads(capsys.readouterr().out)["refinement"]
    assert summary["tokenizer"] == str(ref)  # found beside the reference's weights
    assert summary["selection_loss_best"] < summary["selection_loss_start"]
    assert math.isfinite(summary["evaluation_loss"])  # reported, a finite loss
    # the written endpoint is the candidate's function (float32)
    ids = torch.randint(0, 50257, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = build_torch_model(load_checkpoint(out))(ids).logits
        want = build_torch_model(load_checkpoint(cand))(ids).logits
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert (out / "model.safetensors").is_file()


def test_data_that_cannot_fit_the_model_is_refused(tmp_path, text_file, capsys):
    small = _gpt2(tmp_path / "small", 1, vocab=1000)
    small_b = _gpt2(tmp_path / "small_b", 2, vocab=1000)
    message = cli_error(capsys, ["align", str(small), str(small_b), "--out", str(tmp_path / "o"), "--refine-data", f"text:{text_file}",
              "--refine-examples", "60"])  # GPT-2 BPE ids into a 1000-token embedding
    assert "50257 tokens" in message and "embeds only 1000" in message and "\n" not in message
    bare = _gpt2(tmp_path / "bare", 1, with_tokenizer=False)
    bare_b = _gpt2(tmp_path / "bare_b", 2, with_tokenizer=False)
    assert re.search("character-level tokens .* pass --tokenizer", cli_error(capsys, ["merge", str(bare), str(bare_b), "--out", str(tmp_path / "o"), "--refine-data", f"text:{text_file}",
              "--refine-examples", "60"]))
    assert re.search("character-level tokens", cli_error(capsys, ["barrier", str(bare), str(bare_b), "--data", f"text:{text_file}"]))
    assert re.search("--tokenizer applies to text data only", cli_error(capsys, ["merge", str(bare), str(bare_b), "--out", str(tmp_path / "o"), "--refine-data", "digits",
              "--tokenizer", str(TOKENIZER)]))
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_barrier_reads_text_with_an_explicit_tokenizer(tmp_path, text_file, capsys):
    a = _gpt2(tmp_path / "a", 1, with_tokenizer=False)
    b = _gpt2(tmp_path / "b", 2, with_tokenizer=False)
    assert main(["barrier", str(a), str(b), "--data", f"text:{text_file}", "--tokenizer", str(TOKENIZER),
                 "--points", "3", "--max-examples", "8"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["examples"] == 8 and len(summary["losses"]) == 3


def test_align_matches_on_the_tokens_seen_in_training(tmp_path, text_file, capsys):
    """--seen-tokens: the alignment is weight matching restricted to the text's training tokens."""
    from fedbasin.alignment import weight_match

    ref, cand = _gpt2(tmp_path / "ref", 1), _gpt2(tmp_path / "cand", 2)
    out = tmp_path / "aligned"
    assert main(["align", str(ref), str(cand), "--out", str(out), "--seen-tokens", f"text:{text_file}",
                 "--iterations", "3", "--head-weight", "1"]) == 0
    a, b = load_checkpoint(ref), load_checkpoint(cand)
    seen = load_task(f"text:{text_file}", tokenizer=str(ref), block_size=32).train
    ids = torch.cat([seen.inputs.reshape(-1), seen.targets[:, -1]])
    counts = torch.bincount(ids, minlength=a.config.vocab_size).double()
    sqrt_weights = counts.sqrt() / counts[counts > 0].sqrt().mean()  # the default: row t counts √n_t times

    def expected(token_rows):
        return weight_match(a.spec, a.adapter.to_standard(a.state), b.adapter.to_standard(b.state), iterations=3,
                            token_rows=token_rows).state

    def written(path):
        got = load_checkpoint(path)
        return got.adapter.to_standard(got.state)

    def distance(x, y):
        return max(float((x[k] - y[k]).abs().max()) for k in y)

    weighted, masked = expected(sqrt_weights), expected(torch.unique(ids))
    assert distance(written(out), weighted) < 1e-6
    assert main(["align", str(ref), str(cand), "--out", str(tmp_path / "seen"), "--seen-tokens", f"text:{text_file}",
                 "--token-weighting", "seen", "--iterations", "3", "--head-weight", "1"]) == 0
    assert distance(written(tmp_path / "seen"), masked) < 1e-6
    assert distance(weighted, masked) > 1e-4  # the weighting changed the result
    plain = weight_match(a.spec, a.adapter.to_standard(a.state), b.adapter.to_standard(b.state), iterations=3).state
    assert distance(written(out), plain) > 1e-4  # the option changed the result


def test_a_tokenizer_saved_beside_another_model_type_loads_as_itself(tmp_path):
    """A checkpoint directory holds the model's config.json and the tokenizer it was trained with; the
    model type must not choose the tokenizer (a GPT-2 tokenizer beside a Qwen2 config loaded as
    Qwen2Tokenizer and cut Tiny Shakespeare into 1,652 tokens instead of 1,690)."""
    from fedbasin.data.sources import HFTokenizer

    original = HFTokenizer(TOKENIZER)
    original.tokenizer.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 4
    saved = HFTokenizer(tmp_path)
    assert type(saved.tokenizer) is type(original.tokenizer)
    assert torch.equal(saved.encode(text), original.encode(text))
