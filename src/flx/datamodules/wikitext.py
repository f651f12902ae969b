r"""WikiText-2 (Merity et al., 2016) for a BERT-style masked language model (HeteroFL's and WHALE-FL's Transformer).

Files: the word-level release (``wikitext-2-v1.zip``), unzipped to ``<root>/wikitext-2/wiki.{train,valid,test}.tokens``:
whitespace-separated tokens, one paragraph per line, headings such as `` = Title = ``, rare words already ``<unk>``.

**Tokens and vocabulary** (as the usual word-level LM, PyTorch's ``word_language_model``): every line, blank ones
included, gives its whitespace-separated words followed by ``<eos>``, and a split is the concatenation of its lines.
The vocabulary is the train file's words **in order of first occurrence** (ids ``0..V-1``; ``<unk>`` is appended if
the train file has none); a valid or test word outside it reads as ``<unk>`` (the release has none). On the real
files ``V`` = 33,278, HeteroFL's ``num_tokens``. ``<mask>`` is the extra input id ``V``: the net reads it and never
predicts it (``num_classes = V``; :class:`~flx.models.scalable_lm.ScalableTransformerLM`'s ``vocab_size = V + 1``).

**Rows.** A split's token stream is cut into consecutive rows of ``seq_len`` tokens (bptt, 64), the last incomplete
row dropped: inputs and targets are int64 ``(N, seq_len)``. Clients hold whole rows (``partition=iid``, the setting of
WHALE-FL's code for WikiText-2); partitions by class label stop with one line, there are no labels.

**Masking** (static: drawn once per split from ``mask_seed``, so every round, client and evaluation sees the same
masked rows). Each position is chosen independently with probability ``mask_rate`` (0.15). ``mask_mode``:

- ``bert`` (default, BERT's 80/10/10): a chosen position reads ``<mask>`` with probability 0.8, a uniformly random
  word (of the ``V``) with 0.1, and its own word with 0.1;
- ``mask_only``: every chosen position reads ``<mask>`` (HeteroFL's code).

The draws are the same in both modes (per split: the choice, then a uniform ``u`` and a random word per position,
from ``numpy.random.default_rng([mask_seed, split])``, split 0 train, 1 valid, 2 test), so the mode changes what a
chosen position reads, never which positions are chosen. ``scored``: ``masked`` (default, BERT) puts the original id
at the chosen positions of the targets and ``-100`` (not scored) elsewhere; ``all`` scores every position against its
original word (HeteroFL's code scores the whole row, whose "accuracy" is over every token).

**Splits.** Training rows from the train file, the validation split from the valid file (``use_valid``; false: no
validation split), the test split from the test file. ``data.val_fraction`` must stay 0 (the validation rows are the
official ones); ``data.server_fraction`` carves a random share of the training rows for the server; a
``data.split_file`` lists pool ids numbered train rows, then valid rows, then test rows.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from flx.datamodules import files
from flx.datamodules.formats import _corrupt
from flx.datamodules.protocol import DataProtocol, carve, carved_rows, select
from flx.datamodules.store import TensorData
from flx.errors import ConfigError, bad_value

EOS, UNK, MASK = "<eos>", "<unk>", "<mask>"
MASK_MODES = ("bert", "mask_only")
SCORED = ("masked", "all")
IGNORE = -100
"""The target of a position that is not scored (:class:`flx.tasks.MaskedLM`)."""


def read_tokens(path: Path) -> list[str]:
    """The words of a ``.tokens`` file, ``<eos>`` after every line (blank lines give a lone ``<eos>``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise _corrupt("wikitext2", path, f"{type(err).__name__}: {err}") from err
    return [word for line in text.splitlines() for word in (*line.split(), EOS)]


def build_vocab(words: list[str]) -> dict[str, int]:
    """Word -> id in order of first occurrence; ``<unk>`` appended when absent."""
    vocab = dict.fromkeys(words)
    vocab.setdefault(UNK)
    return {w: i for i, w in enumerate(vocab)}


def to_rows(words: list[str], vocab: dict[str, int], seq_len: int) -> np.ndarray:
    """The ids of ``words`` (unknown: ``<unk>``) cut into ``(len // seq_len, seq_len)`` rows, the tail dropped."""
    unk = vocab[UNK]
    ids = np.fromiter((vocab.get(w, unk) for w in words), dtype=np.int64, count=len(words))
    n = len(ids) // seq_len
    return ids[: n * seq_len].reshape(n, seq_len)


def mask_rows(
    ids: np.ndarray, vocab_size: int, rate: float, mode: str, rng: np.random.Generator, scored: str = "masked"
) -> tuple[np.ndarray, np.ndarray]:
    """Static BERT masking of ``ids`` ``(N, L)`` (see the module docstring): ``(inputs, targets)``, both ``(N, L)``.

    ``<mask>`` is id ``vocab_size``; random words are drawn from ``0..vocab_size-1``.
    """
    chosen = rng.random(ids.shape) < rate
    u = rng.random(ids.shape)
    random_words = rng.integers(0, vocab_size, ids.shape)
    x = ids.copy()
    if mode == "bert":
        x[chosen & (u < 0.8)] = vocab_size
        swap = chosen & (u >= 0.8) & (u < 0.9)
        x[swap] = random_words[swap]
    else:
        x[chosen] = vocab_size
    y = np.where(chosen, ids, IGNORE) if scored == "masked" else ids.copy()
    return x, y


def _check_options(seq_len: int, mask_rate: float, mask_mode: str, mask_seed: int, scored: str) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise bad_value("data.seq_len", seq_len, "must be an integer >= 1 (tokens per row: bptt)")
    if isinstance(mask_rate, bool) or not isinstance(mask_rate, (int, float)) or not 0 < mask_rate < 1:
        raise bad_value("data.mask_rate", mask_rate, "must be a number in (0, 1)")
    files.choice("data.mask_mode", mask_mode, MASK_MODES)
    if isinstance(mask_seed, bool) or not isinstance(mask_seed, int) or mask_seed < 0:
        raise bad_value("data.mask_seed", mask_seed, "must be an integer >= 0")
    files.choice("data.scored", scored, SCORED)


def wikitext2(
    root: str,
    seq_len: int = 64,
    mask_rate: float = 0.15,
    mask_mode: str = "bert",
    mask_seed: int = 0,
    scored: str = "masked",
    use_valid: bool = True,
    protocol: DataProtocol | None = None,
) -> TensorData:
    """WikiText-2 from ``<root>/wikitext-2/wiki.{train,valid,test}.tokens`` (see the module docstring).

    Args:
        root: the data directory.
        seq_len: tokens per row (bptt).
        mask_rate: the probability that a position is chosen.
        mask_mode: ``bert`` (80/10/10) or ``mask_only``.
        mask_seed: seed of the static masking.
        scored: ``masked`` (targets at the chosen positions only) or ``all``.
        use_valid: the valid file is the validation split (false: no validation split, the file is not read).
        protocol: the data protocol (``FederatedDataModule`` passes it); default: no server split.

    Returns:
        Carved data: int64 inputs and targets ``(N, seq_len)``, ``num_classes = V`` words (``<mask>`` is id ``V``).

    Raises:
        ConfigError: missing or unreadable files, a bad option, a train file shorter than one row, or
            ``data.val_fraction > 0``.
    """
    _check_options(seq_len, mask_rate, mask_mode, mask_seed, scored)
    protocol = protocol or DataProtocol()
    if protocol.val_fraction:
        why = "data=wikitext2 validates on wiki.valid.tokens (data.loader.use_valid=false: no validation); leave it 0"
        raise bad_value("data.val_fraction", protocol.val_fraction, why)
    found = files.wikitext2(root, use_valid)
    train = read_tokens(found["wiki.train.tokens"])
    vocab = build_vocab(train)
    names = ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens")
    splits = []
    for k, name in enumerate(names):
        rows = to_rows(train if k == 0 else read_tokens(found[name]), vocab, seq_len) if name in found else None
        if rows is not None and not len(rows):
            raise ConfigError(f"data=wikitext2: {found[name]} holds fewer than data.seq_len={seq_len} tokens")
        splits.append(
            None if rows is None else mask_rows(rows, len(vocab), mask_rate, mask_mode, _rng(mask_seed, k), scored)
        )
    return _carve(splits, len(vocab), protocol)


def _rng(seed: int, split: int) -> np.random.Generator:
    return np.random.default_rng([seed, split])


def _carve(splits: list, num_words: int, protocol: DataProtocol) -> TensorData:
    """The pool (train rows, valid rows; test rows) with the official splits, or ``data.split_file``'s."""
    (x_tr, y_tr), valid, (x_te, y_te) = splits
    x_va, y_va = valid if valid is not None else (x_tr[:0], y_tr[:0])
    as_t = torch.from_numpy
    pool = TensorData(
        x_train=as_t(np.concatenate([x_tr, x_va])),
        y_train=as_t(np.concatenate([y_tr, y_va])),
        x_test=as_t(x_te),
        y_test=as_t(y_te),
        num_classes=num_words,
        name="wikitext2",
    )
    if protocol.split_file is not None:
        return carve(pool, protocol)
    n_tr, n, m = len(y_tr), len(pool.y_train), len(y_te)
    rows = carved_rows(np.zeros(n_tr, np.int64), m, replace(protocol, val_fraction=0.0), real=True)
    rows |= {"val": np.arange(n_tr, n), "test": np.arange(n, n + m)}
    return select(pool, rows)
