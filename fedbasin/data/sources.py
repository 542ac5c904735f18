"""Data sources behind :func:`load_task`: scikit-learn digits, CIFAR-10 (hub or parquet), text.

Source strings::

    digits               scikit-learn's bundled 8x8 digits (offline), 20% held out for test
    cifar10              Hugging Face hub dataset ``uoft-cs/cifar10`` (train/test)
    cifar10:PATH         a directory with train.parquet and test.parquet, or one parquet file
                         (then 20% is held out), with the hub's columns ``img`` and ``label``
    text:PATH            a local UTF-8 text file (a missing file is an error, never a download);
                         the last 10% held out for test; tokens from the Hugging Face tokenizer
                         in ``load_task(..., tokenizer=DIR)`` (e.g. the one saved beside an HF
                         model), else character-level tokens
    text:hub:ID          a Hugging Face hub dataset with a ``text`` column (train split)

Test splits are fixed per source: a source's own test split (CIFAR-10: in an order shuffled with
:data:`TEST_SPLIT_SEED`, so that a prefix samples every class), the text's last 10%, or a random
20% drawn with :data:`TEST_SPLIT_SEED` whatever the run's ``seed`` — so models trained with
different seeds are always scored on examples none of them has seen.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from .hub import hub_access
from .task import Split, Task

CIFAR10_HUB_ID = "uoft-cs/cifar10"
#: seed of the held-out test split of sources without one of their own (never the run's seed)
TEST_SPLIT_SEED = 0
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_SHAPE = (32, 32, 3)  # one decoded image: height, width, RGB


#: the character vocabulary of a character-level model, saved beside its weights
CHARACTERS_FILE = "characters.json"
#: the files of a Hugging Face tokenizer saved beside a checkpoint (fast, slow BPE, SentencePiece): any of these
#: in a checkpoint's directory makes text data read with that tokenizer
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
#: every file that says how text becomes the ids a checkpoint's weights read: copied to an aligned or merged
#: output, replaced with the weights (never left beside weights that read other ids)
TOKENIZER_FILES = (*TOKENIZER_MARKERS, "merges.txt", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
                   "chat_template.jinja", CHARACTERS_FILE)


class CharTokenizer:
    """Character-level tokenizer: token id = index of the character in the sorted vocabulary (the
    characters of ``text``). Saved as :data:`CHARACTERS_FILE` beside a model, so that another text
    is read with the model's ids (or refused), not with ids of its own character set."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def save(self, directory: str | Path) -> None:
        (Path(directory) / CHARACTERS_FILE).write_text(json.dumps({"characters": "".join(self.chars)}))

    @staticmethod
    def saved_characters(directory: str | Path) -> str | None:
        """The characters saved in ``directory`` (None: no :data:`CHARACTERS_FILE`); ValueError if unreadable."""
        file = Path(directory) / CHARACTERS_FILE
        if not file.is_file():
            return None
        try:
            characters = json.loads(file.read_text(encoding="utf-8"))["characters"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{file} is not a character vocabulary ({type(error).__name__}: {error})") from None
        if not isinstance(characters, str) or list(characters) != sorted(set(characters)):
            raise ValueError(f"{file}: 'characters' must be a string of distinct characters in sorted order "
                             "(a token id is a character's rank)")
        return characters

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - self.index.keys())
        if unknown:
            raise ValueError(f"characters outside the {len(self.chars)}-character vocabulary: {unknown[:10]}")
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class HFTokenizer:
    """A Hugging Face tokenizer behind the :class:`CharTokenizer` interface (ids as tensors).

    ``vocab_size`` counts added tokens too (``len(tokenizer)``): the ids the model must embed."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        where = Path(path).expanduser()
        if not where.is_dir() and is_hub_id(str(path)):
            try:  # a hub id such as "gpt2" or "org/name" (needs the network)
                with hub_access():
                    self.tokenizer = AutoTokenizer.from_pretrained(str(path))
            except Exception as error:  # noqa: BLE001 - offline, unknown id, gated repository
                raise RuntimeError(f"tokenizer {path!r} is not a local directory and could not be loaded "
                                   f"from the Hugging Face hub ({type(error).__name__})") from None
        elif not where.is_dir():
            raise FileNotFoundError(f"tokenizer directory {where} does not exist")
        else:
            try:
                self.tokenizer = _saved_tokenizer_class(where).from_pretrained(str(where))
            except Exception as error:  # transformers raises OSError/ValueError/TypeError variously
                raise ValueError(f"{where} holds no loadable Hugging Face tokenizer ({error})") from None
        self.tokenizer.model_max_length = int(1e30)  # long texts are cut into blocks later
        self.path = where

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


def _saved_tokenizer_class(where: Path):
    """The class ``tokenizer_config.json`` names (``tokenizer_class``), else ``AutoTokenizer``. A tokenizer
    saved beside a model's ``config.json`` (a checkpoint directory) must load as itself: ``AutoTokenizer``
    may pick the model type's tokenizer instead (a GPT-2 tokenizer beside a Qwen2 model loads as
    Qwen2Tokenizer and cuts the text differently)."""
    import json

    import transformers

    try:
        named = json.loads((where / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    chosen = getattr(transformers, named, None) if isinstance(named, str) else None
    return chosen if hasattr(chosen, "from_pretrained") else transformers.AutoTokenizer


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a hub id (``gpt2``, ``org/name``) rather than a local path."""
    return not name.startswith(("/", ".", "~")) and name.count("/") <= 1 and bool(name.strip())


def token_blocks(ids: torch.Tensor, block_size: int) -> Split:
    """Consecutive non-overlapping windows: inputs ``ids[s:s+B]``, targets ``ids[s+1:s+B+1]``."""
    n = (len(ids) - 1) // block_size
    if n < 1:
        raise ValueError(f"text of {len(ids)} tokens is too short for block-size {block_size}")
    starts = torch.arange(n) * block_size
    blocks = ids[starts[:, None] + torch.arange(block_size + 1)[None, :]]
    return Split(blocks[:, :-1].contiguous(), blocks[:, 1:].contiguous())


def unigram_blocks(token_ids: torch.Tensor, vocab_size: int, count: int, block_size: int, seed: int = 0) -> Split:
    """``count`` synthetic blocks of tokens drawn independently, token t with probability
    n_t / Σ n (n_t its count in ``token_ids``): :func:`frequency_blocks` of the counts. They carry
    the counts only, no text: inputs for data-free alignment, whose targets are the models' own
    predictions (``learned_refine(model_labels=True)``)."""
    ids = torch.as_tensor(token_ids).reshape(-1).long()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"unigram blocks need token ids in [0, {vocab_size}), got {ids.numel()} ids")
    return frequency_blocks(torch.bincount(ids, minlength=vocab_size).double(), count, block_size, seed)


def frequency_blocks(frequencies: torch.Tensor, count: int, block_size: int, seed: int = 0) -> Split:
    """``count`` blocks of tokens drawn independently, token t with probability f_t / Σ f: inputs
    ``s[:B]``, targets ``s[1:B+1]`` of each drawn row ``s`` (``frequencies`` (vocab,), ≥ 0, not all 0)."""
    p = _probabilities(frequencies, "token frequencies")
    drawn = torch.multinomial(p, count * (block_size + 1), replacement=True,
                              generator=torch.Generator().manual_seed(seed)).reshape(count, block_size + 1)
    return Split(drawn[:, :-1].contiguous(), drawn[:, 1:].contiguous())


def _probabilities(weights: torch.Tensor, what: str) -> torch.Tensor:
    """``weights / Σ weights`` (float64), refused unless one finite value >= 0 per token, not all 0."""
    w = torch.as_tensor(weights, dtype=torch.float64)
    if w.ndim != 1 or not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or not bool(w.sum() > 0):
        raise ValueError(f"{what} must be one finite value >= 0 per token, not all 0")
    return w / w.sum()


def chain_blocks(tokens: torch.Tensor, first: torch.Tensor, transitions: torch.Tensor, count: int, block_size: int,
                 seed: int = 0) -> Split:
    """``count`` blocks drawn as a Markov chain over ``tokens`` (n ids): s_0 = tokens[i] with probability
    first_i / Σ first, then s_{j+1} = tokens[k] with probability transitions[i, k] (row i of s_j's index,
    normalised). Inputs ``s[:B]``, targets ``s[1:B+1]`` of each drawn row ``s``."""
    tokens = torch.as_tensor(tokens).reshape(-1).long()
    n = tokens.numel()
    f, p = torch.as_tensor(first), torch.as_tensor(transitions)
    if n == 0 or f.shape != (n,) or p.shape != (n, n):
        raise ValueError(f"a chain over {n} tokens needs {n} first weights and {n}x{n} transitions, got "
                         f"{tuple(f.shape)} and {tuple(p.shape)}")
    if not (bool(torch.isfinite(p).all()) and bool((p >= 0).all()) and bool((p.sum(1) > 0).all())):
        raise ValueError("chain transitions must be finite, >= 0, and every row must sum to > 0")
    first = _probabilities(f, "chain first weights")
    generator = torch.Generator().manual_seed(seed)
    state = torch.multinomial(first, count, replacement=True, generator=generator)  # indices into tokens
    cdf = p.float().cumsum(1)  # each row's cumulative weights: a draw is a search of u ~ U(0, row total)
    drawn = [state]
    for _ in range(block_size):
        rows = cdf[state]
        state = torch.searchsorted(rows, torch.rand(count, 1, generator=generator) * rows[:, -1:])[:, 0].clamp(max=n - 1)
        drawn.append(state)
    chain = tokens[torch.stack(drawn, 1)]
    return Split(chain[:, :-1].contiguous(), chain[:, 1:].contiguous())


@functools.lru_cache(maxsize=4)
def load_task(
    source: str = "digits",
    *,
    seed: int = 0,
    proxy_size: int = 0,
    max_train_examples: int = 0,
    block_size: int = 64,
    test_fraction: float = 0.2,
    tokenizer: str | None = None,
    proxy_at_most: bool = False,
    characters: str | None = None,
) -> Task:
    """Load a data source (see the module docstring) as a :class:`Task`.

    The training split is shuffled with ``seed``, cut to ``max_train_examples`` (0: all), and its
    first ``proxy_size`` examples become the server's ``proxy`` split (``proxy_at_most``: at most that many,
    one training example always left). ``test_fraction`` applies
    to sources without a test split of their own (digits, a single parquet file); that split is
    drawn with :data:`TEST_SPLIT_SEED`, so the test split never depends on ``seed``. ``tokenizer``:
    a Hugging Face tokenizer directory for text sources (others refuse it); ``characters``: the
    character vocabulary of a character-level model (else the text's own characters). Results are
    cached per process: treat the returned task as read-only.
    """
    kind, _, arg = source.partition(":")
    if (tokenizer is not None or characters is not None) and kind != "text":
        raise ValueError(f"a tokenizer applies to text sources only, not {source!r}")
    if kind == "digits" and not arg:
        task = _digits(test_fraction)
    elif kind == "cifar10":
        task = _cifar10(arg, test_fraction)
    elif kind == "text" and arg:
        task = _text(arg, block_size, tokenizer, characters)
    else:
        raise ValueError(
            f"unknown data source {source!r}; expected digits, cifar10, cifar10:PATH or text:PATH"
        )
    return _finish(task, seed, proxy_size, max_train_examples, proxy_at_most)


def _finish(task: Task, seed: int, proxy_size: int, max_train_examples: int, proxy_at_most: bool = False) -> Task:
    """Shuffle the training split, cut it, and split off the proxy examples."""
    order = torch.randperm(len(task.train), generator=torch.Generator().manual_seed(seed))
    if max_train_examples:
        order = order[:max_train_examples]
    if proxy_at_most:
        proxy_size = min(proxy_size, len(order) - 1)
    if proxy_size >= len(order):
        raise ValueError(f"proxy-size {proxy_size} leaves no training data ({len(order)} examples)")
    task.proxy = task.train.subset(order[:proxy_size]) if proxy_size else None
    task.train = task.train.subset(order[proxy_size:])
    return task


def _digits(test_fraction: float) -> Task:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (
        torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    )  # (N, 1, 8, 8) in [0, 1]
    data = Split(images, torch.tensor(digits.target, dtype=torch.long))
    train, test = data.split(test_fraction, TEST_SPLIT_SEED)
    overrides = {"image_size": 8, "patch_size": 2, "channels": 1, "num_classes": 10}
    return Task("digits", "vit", overrides, train, test)


def _normalize_cifar(x: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, 32, 32) → per-channel standardised floats."""
    mean = torch.tensor(CIFAR10_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, device=x.device).view(1, 3, 1, 1)
    return (x.float() / 255.0 - mean) / std


def _cifar10(path: str, test_fraction: float) -> Task:
    if not path:
        from datasets import load_dataset

        try:
            with hub_access():
                splits = load_dataset(CIFAR10_HUB_ID)
        except Exception as error:  # offline machines land here
            raise RuntimeError(
                f"could not load {CIFAR10_HUB_ID!r} from the Hugging Face hub ({error}); "
                "offline, use 'cifar10:PATH' with a local copy in parquet"
            ) from error
        tables = {name: (CIFAR10_HUB_ID, split.with_format("arrow")[:]) for name, split in splits.items()}
    else:
        import pyarrow.parquet as pq

        where = Path(path).expanduser()
        if where.is_dir():
            files = {name: where / f"{name}.parquet" for name in ("train", "test")}
            missing = [str(f) for f in files.values() if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"cifar10 directory {where} lacks {missing}")
        elif where.is_file():
            files = {"train": where}
        else:
            raise FileNotFoundError(
                f"cifar10 source {where} is neither a directory nor a parquet file"
            )
        tables = {}
        for name, file in files.items():
            try:
                tables[name] = (file, pq.read_table(file, columns=["img", "label"]))
            except Exception as error:  # pyarrow's errors: not parquet, or a column missing
                raise ValueError(f"{file}: not a CIFAR-10 parquet file with columns 'img' and 'label' "
                                 f"({str(error).splitlines()[0]})") from None

    train = _image_split(*tables["train"])
    if "test" in tables:
        # copies may store rows ordered by class: a fixed shuffle makes every prefix (an evaluation
        # subset) a sample of all classes; the split's examples are unchanged
        test = _image_split(*tables["test"])
        test = test.subset(torch.randperm(len(test), generator=torch.Generator().manual_seed(TEST_SPLIT_SEED)))
    else:
        train, test = train.split(test_fraction, TEST_SPLIT_SEED)
    overrides = {"image_size": 32, "patch_size": 4, "channels": 3, "num_classes": 10}
    return Task("cifar10", "vit", overrides, train, test)


def _image_split(source, table) -> Split:
    """The hub's CIFAR-10 columns (``img``: {bytes, path} of an encoded image, ``label``) as uint8 images
    (N, 3, 32, 32) with their labels, decoded by PIL straight from the arrow column (the same pixels as
    ``datasets``' decoding, without its per-example formatting). ``source`` names the data in errors."""
    import io

    from PIL import Image

    images, labels = table.column("img").to_pylist(), table.column("label").to_numpy()
    pixels = np.empty((len(images), *CIFAR10_SHAPE), np.uint8)
    for row, cell in enumerate(images):
        cell = cell or {}
        try:
            data = cell.get("bytes")
            with Image.open(io.BytesIO(data) if data is not None else cell.get("path")) as image:
                decoded = np.asarray(image.convert("RGB"))
        except Exception as error:  # PIL's errors: not an image, a missing path
            raise ValueError(f"{source}: row {row}: the image does not decode ({type(error).__name__})") from None
        if decoded.shape != CIFAR10_SHAPE:
            raise ValueError(f"{source}: row {row}: a {decoded.shape[1]}x{decoded.shape[0]} image, "
                             "CIFAR-10 images are 32x32")
        pixels[row] = decoded
    return Split(torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(np.array(labels)).long(),
                 _normalize_cifar)


def _text(path: str, block_size: int, tokenizer_dir: str | None = None, characters: str | None = None) -> Task:
    hub_id = path.removeprefix("hub:") if path.startswith("hub:") else None
    where = Path(path).expanduser()
    if hub_id:
        from datasets import load_dataset

        try:
            with hub_access():
                text = "\n".join(load_dataset(hub_id, split="train")["text"])
        except Exception as error:
            raise RuntimeError(f"could not load {hub_id!r} from the Hugging Face hub ({error})") from error
        where = Path(hub_id)
    elif where.is_file():
        try:
            text = where.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"text file {where} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    elif where.exists():
        raise ValueError(f"text source {where} is not a file")
    else:
        raise FileNotFoundError(f"text file {where} does not exist (for a hub dataset use text:hub:ID)")
    if tokenizer_dir:
        tokenizer = HFTokenizer(tokenizer_dir)
    else:  # the model's own characters where it saved them, else the text's
        tokenizer = CharTokenizer(text if characters is None else characters)
    ids = tokenizer.encode(text)
    cut = int(0.9 * len(ids))
    overrides = {"vocab_size": tokenizer.vocab_size, "block_size": block_size}
    return Task(
        f"text:{where.name}",
        "gpt",
        overrides,
        token_blocks(ids[:cut], block_size),
        token_blocks(ids[cut:], block_size),
        tokenizer=tokenizer,
    )
