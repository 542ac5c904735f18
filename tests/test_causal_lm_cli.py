"""`fedbasin eval | barrier | align --refine-data` on every registered Hugging Face causal-LM family
(Llama with grouped-query attention, Mistral, Qwen2, GPT-NeoX, Phi), each a tiny random model saved with
the GPT-2 tokenizer, on an excerpt of Tiny Shakespeare: the context length and the data kind come
from the family registry, so nothing in the CLI is GPT-2 only."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from fedbasin.alignment.families import family  # noqa: E402
from fedbasin.alignment.hf import hf_config_class, hf_model_class  # noqa: E402
from fedbasin.checkpoint import build_torch_model, load_checkpoint, save_checkpoint  # noqa: E402
from fedbasin.cli import TOKENIZER_FILES, main  # noqa: E402
from tests.helpers import cli_error  # noqa: E402
from tests.test_tokenizer_data import NEEDS_SHARED_TEXT, TOKENIZER, shakespeare_excerpt  # noqa: E402

pytestmark = NEEDS_SHARED_TEXT

VOCAB, CONTEXT = 50257, 16
SHAPE = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=24,
             max_position_embeddings=CONTEXT, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
FAMILIES = {
    "llama": dict(num_key_value_heads=2),  # grouped-query attention: 2 query heads per key/value head
    "mistral": dict(num_key_value_heads=2),
    "qwen2": dict(num_key_value_heads=2),  # q/k/v biases
    "gpt_neox": dict(num_attention_heads=2),  # head dim 8, a quarter of it rotary (NeoX default)
    "phi": dict(num_attention_heads=2),  # one LayerNorm per parallel block, half of each head rotary
}


def _save(path, model_type: str, seed: int, **overrides):
    config = hf_config_class(model_type)(**{**SHAPE, **FAMILIES.get(model_type, {}), **overrides})
    torch.manual_seed(seed)
    model = hf_model_class(model_type)(config)
    with torch.no_grad():  # spread the weights like a trained model's
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_checkpoint(path, model_type, config, model.state_dict(), kind="hf")
    for item in TOKENIZER.iterdir():
        shutil.copy(item, path / item.name)
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    return shakespeare_excerpt(tmp_path_factory.mktemp("text"), 12_000)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return request.param, _save(root / "m0", request.param, 1), _save(root / "m1", request.param, 2)


def _run(capsys, argv) -> dict:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_the_family_declares_its_context_length_and_data(pair):
    model_type, m0, _ = pair
    checkpoint = load_checkpoint(m0)
    assert family(model_type).data == "text"
    assert family(model_type).context_length(checkpoint.config) == CONTEXT


def test_eval(pair, text_file, capsys):
    model_type, m0, _ = pair
    summary = _run(capsys, ["eval", m0, "--data", f"text:{text_file}", "--max-examples", 8])
    assert summary["family"] == model_type and summary["examples"] == 8
    assert math.isfinite(summary["loss"]) and 0 <= summary["accuracy"] <= 1


def test_barrier(pair, text_file, capsys):
    _, m0, m1 = pair
    plain = _run(capsys, ["barrier", m0, m1, "--data", f"text:{text_file}", "--points", 3, "--max-examples", 8])
    aligned = _run(capsys, ["barrier", m0, m1, "--data", f"text:{text_file}", "--points", 3, "--max-examples", 8,
                            "--align", "--iterations", 2])
    for curve in (plain, aligned, aligned["vanilla"]):
        assert len(curve["losses"]) == 3 and all(math.isfinite(x) for x in curve["losses"])
    assert aligned["losses"][-1] == pytest.approx(plain["losses"][-1])  # λ = 1: model A either way


def _refine(capsys, command, m0, m1, out, text_file, steps, extra=()) -> dict:
    """``fedbasin COMMAND m0 m1 --out OUT --refine-data text:FILE`` on 40 blocks; its refinement summary."""
    return _run(capsys, [command, m0, m1, "--out", out, "--refine-data", f"text:{text_file}", "--refine-steps", steps,
                         "--refine-examples", 40, "--refine-batch-size", 8, "--iterations", 2,
                         "--refine-evaluation-fraction", 0.2, *extra])["refinement"]


def test_align_refines_on_text(pair, text_file, capsys, tmp_path):
    _, m0, m1 = pair
    out = tmp_path / "aligned"
    summary = _refine(capsys, "align", m0, m1, out, text_file, steps=4)
    assert summary["tokenizer"] == str(m0) and summary["proxy_examples"] == 40
    ids = torch.randint(0, VOCAB, (2, CONTEXT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = build_torch_model(load_checkpoint(out))(ids).logits
        want = build_torch_model(load_checkpoint(m1))(ids).logits
    assert float((got - want).abs().max()) < 1e-4


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_tied_embeddings_refine_and_merge_on_text(model_type, text_file, capsys, tmp_path):
    """A tied token table and head (stock GPT-2): the aligned model is untied, and the refinement's forward
    passes must treat the two as separate tensors (functional_call refused them as tied before)."""
    m0, m1 = (_save(tmp_path / f"m{seed}", model_type, seed, tie_word_embeddings=True) for seed in (1, 2))
    out = tmp_path / "aligned"
    assert _refine(capsys, "align", m0, m1, out, text_file, steps=2)["steps"] == 2
    ids = torch.randint(0, VOCAB, (2, CONTEXT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = build_torch_model(load_checkpoint(out))(ids).logits
        want = build_torch_model(load_checkpoint(m1))(ids).logits
    assert float((got - want).abs().max()) < 1e-4
    _refine(capsys, "merge", m0, m1, tmp_path / "merged", text_file, steps=2, extra=("--distill-steps", 2))
    assert (tmp_path / "merged" / "model.safetensors").is_file()


def test_merge_refines_and_distils_on_text(pair, text_file, capsys, tmp_path):
    """Every causal-LM family: the refined merge, then the models' ensemble distilled into it with the language
    models' settings (no views, no labels, temperature 1)."""
    _, m0, m1 = pair
    out = tmp_path / "merged"
    summary = _refine(capsys, "merge", m0, m1, out, text_file, steps=2, extra=["--distill-steps", 3])
    assert math.isfinite(summary["evaluation_loss"]) and (out / "model.safetensors").is_file()
    distilled = summary["distillation"]
    assert (distilled["steps"], distilled["teachers"], distilled["augment"]) == (3, 2, "none")
    assert (distilled["temperature"], distilled["label_weight"]) == (1.0, 0.0)
    assert math.isfinite(distilled["selection_loss_best"])
    assert distilled["selection_loss_best"] <= distilled["selection_loss_start"]
    # the merge carries the reference's tokenizer: it is evaluated on the same tokens without --tokenizer
    tokenizer_files = {f.name for f in Path(m0).iterdir() if f.name in TOKENIZER_FILES}
    assert tokenizer_files and tokenizer_files <= {f.name for f in out.iterdir()}
    assert math.isfinite(_run(capsys, ["eval", out, "--data", f"text:{text_file}"])["loss"])


def test_a_subword_lm_merge_distils_by_default_over_the_refinements_vocabulary(text_file, calls, capsys, tmp_path):
    """``fedbasin merge --refine-data text:FILE`` of subword LMs distils by default, at Adam 0.0001, checking its
    start and its end only (the Flower server's LM distillation: 0.001, every 10 steps). Its softmax covers the
    token rows the refinement trained on (the text's tokens), not the 50,257 of the vocabulary: only those rows of
    the embedding and the head move; every other row is the refined merge's, bit for bit."""
    m0, m1 = _save(tmp_path / "m0", "llama", 1), _save(tmp_path / "m1", "llama", 2)
    _refine(capsys, "merge", m0, m1, tmp_path / "off", text_file, steps=2, extra=["--distill-steps", 0])
    assert not calls
    summary = _refine(capsys, "merge", m0, m1, tmp_path / "on", text_file, steps=2)
    distilled = summary["distillation"]
    (call,) = calls  # (run for 4 steps instead of its budget)
    assert (call["steps"], call["budget"], call["lr"], call["eval_every"]) == (None, 120.0, 1e-4, sys.maxsize)
    assert distilled["keep_best_checks"] == "start and end" and call["teachers"] == 2
    assert distilled["improved"] and 0 < distilled["vocabulary"] < VOCAB // 10
    off, on = (load_checkpoint(tmp_path / name).state for name in ("off", "on"))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        moved = (off[key] != on[key]).any(dim=1)
        assert 0 < int(moved.sum()) <= distilled["vocabulary"], key
    assert any(not torch.equal(off[k], on[k]) for k in off if k not in ("model.embed_tokens.weight", "lm_head.weight"))
    # the written merge beside its models on the text's test split, over the refinement's vocabulary and the test
    # tokens (every target scored)
    against = summary["against_models"]
    assert (against["split"], len(against["models"])) == ("test", 2)
    assert distilled["vocabulary"] <= against["vocabulary"] < VOCAB // 5


def test_a_subword_lm_merge_is_scored_on_the_test_text_over_its_seen_tokens(text_file, capsys, tmp_path):
    """``against_models`` of a subword LM merge: each model's loss on the text's test blocks, its softmax over the
    tokens of the training and test text (the refinement's vocabulary and every test target), computed here
    from the full model's logits at those tokens."""
    from fedbasin.data import load_task
    from fedbasin.training import cross_entropy

    m0, m1 = _save(tmp_path / "m0", "llama", 1), _save(tmp_path / "m1", "llama", 2)
    summary = _refine(capsys, "merge", m0, m1, tmp_path / "m", text_file, steps=2, extra=["--distill-steps", 0])
    against = summary["against_models"]
    task = load_task(f"text:{text_file}", tokenizer=str(m0), block_size=CONTEXT)
    ids = torch.unique(torch.cat([task.train.token_ids(), task.test.token_ids()]))
    lookup = torch.full((VOCAB,), -1, dtype=torch.long)
    lookup[ids] = torch.arange(len(ids))
    assert against["vocabulary"] == len(ids) and against["examples"] == len(task.test)
    for path, found in zip((m0, m1), against["models"]):
        with torch.no_grad():
            logits = build_torch_model(load_checkpoint(path))(task.test.inputs).logits[..., ids]
        assert found["loss"] == pytest.approx(float(cross_entropy(logits, lookup[task.test.targets])), rel=1e-4)


def test_images_are_refused_in_one_line_naming_the_family(pair, capsys):
    model_type, m0, _ = pair
    message = cli_error(capsys, ["eval", m0, "--data", "digits"])
    assert f"is a {model_type} model but --data digits holds images; {model_type} models read text" in message
