"""The WikiText-2 loader (:mod:`flx.datamodules.wikitext`): tiny ``wiki.*.tokens`` files in the real format (leading
spaces, blank lines, `` = Title = `` headings, ``<unk>``) loaded by the real code: the vocabulary, the rows, the static
BERT masking (rate, 80/10/10 ratios, determinism, targets at exactly the chosen positions), the official splits, the
one-line errors, and WHALE-FL on the masked LM end to end."""

from __future__ import annotations

import csv
import math
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import raises_one_line

from flx.config import precheck
from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.partitioners import IID, Shards
from flx.datamodules.protocol import DataProtocol
from flx.datamodules.wikitext import build_vocab, mask_rows, read_tokens, to_rows, wikitext2

TRAIN = [
    " ",
    " = Boulter = ",
    " ",
    " Boulter is an actor . He had a <unk> role . ",
    " ",
    " = = Career = = ",
    " ",
    " In 2000 Boulter had a role . ",
]
VALID = [" ", " = Boulter = ", " Boulter is a stranger . "]  # "stranger" is not a train word
TEST = [" ", " He had an actor role in 2000 . ", " "]  # nor is "in"
WORDS = "<eos> = Boulter is an actor . He had a <unk> role Career In 2000".split()  # first occurrences in TRAIN
STREAM = (
    "<eos> = Boulter = <eos> <eos> Boulter is an actor . He had a <unk> role . <eos> <eos> = = Career = = <eos> <eos> "
    "In 2000 Boulter had a role . <eos>"
).split()


def write_wikitext(root: Path, train: list[str] = TRAIN, valid: list[str] = VALID, test: list[str] = TEST) -> Path:
    """``<root>/wikitext-2/wiki.{train,valid,test}.tokens``, one line per paragraph, as the release."""
    folder = root / "wikitext-2"
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in (("train", train), ("valid", valid), ("test", test)):
        (folder / f"wiki.{name}.tokens").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def test_vocabulary_is_the_train_words_in_first_occurrence_order_with_eos(tmp_path: Path) -> None:
    """Every line (blank ones too) ends with ``<eos>``; ids follow the first occurrence; ``<unk>`` is a word of the
    file, appended only when the file has none."""
    folder = write_wikitext(tmp_path)
    words = read_tokens(folder / "wiki.train.tokens")
    assert words == STREAM and len(words) == 34
    assert build_vocab(words) == {w: i for i, w in enumerate(WORDS)}
    assert build_vocab(["b", "a", "b"]) == {"b": 0, "a": 1, "<unk>": 2}


def test_rows_are_consecutive_windows_and_the_splits_are_the_files(tmp_path: Path) -> None:
    """``seq_len = 8``: the train stream's 34 tokens give 4 rows (the last 2 tokens dropped), valid and test one row
    each with unknown words as ``<unk>``; ``scored=all`` makes the targets the original ids. 15 words, ``<mask>``
    = 15."""
    write_wikitext(tmp_path)
    data = wikitext2(str(tmp_path), seq_len=8, scored="all")
    vocab = {w: i for i, w in enumerate(WORDS)}
    ids = torch.tensor([vocab[w] for w in STREAM[:32]]).view(4, 8)
    assert data.num_classes == 15 and data.name == "wikitext2" and data.input_shape == (8,)
    assert data.token_targets and data.x_train.dtype == data.y_train.dtype == torch.int64
    assert torch.equal(data.y_train, ids)
    valid = "<eos> = Boulter = <eos> Boulter is a".split()
    assert data.y_val.tolist() == [[vocab[w] for w in valid]] and data.num_val == 1
    test = "<eos> He had an actor role <unk> 2000".split()  # "in" -> <unk>
    assert data.y_test.tolist() == [[vocab[w] for w in test]]
    assert (
        data.rows["val"].tolist() == [4]
        and data.rows["test"].tolist() == [5]
        and data.rows["train"].tolist()
        == [
            0,
            1,
            2,
            3,
        ]
    )
    chosen = data.x_train != data.y_train
    assert torch.equal(data.x_train[~chosen], ids[~chosen]) and int(data.x_train.max()) <= 15


def test_masking_rate_ratios_and_targets_on_a_large_stream() -> None:
    """Each position chosen with probability 0.15; of the chosen, ``<mask>`` 80%, a random word 10% (a different one
    with probability ``1 - 1/V``), unchanged otherwise; the target is the original id at exactly the chosen
    positions and -100 elsewhere; unchosen inputs are untouched. Tolerances: 5 standard deviations."""
    v, shape = 50, (2000, 64)
    ids = np.random.default_rng(0).integers(0, v, shape)
    x, y = mask_rows(ids, v, 0.15, "bert", np.random.default_rng(1))
    chosen = y != -100
    n, m = ids.size, int(chosen.sum())
    assert abs(m / n - 0.15) < 5 * math.sqrt(0.15 * 0.85 / n)
    assert np.array_equal(y[chosen], ids[chosen]) and np.array_equal(x[~chosen], ids[~chosen])
    masked, same = (x[chosen] == v).mean(), (x[chosen] == ids[chosen]).mean()
    swapped = 1 - masked - same
    for got, p in ((masked, 0.8), (swapped, 0.1 * (1 - 1 / v)), (same, 0.1 + 0.1 / v)):
        assert abs(got - p) < 5 * math.sqrt(p * (1 - p) / m), (got, p)
    assert x.min() >= 0 and x.max() <= v


def test_masking_is_static_seeded_and_the_mode_changes_only_what_is_read() -> None:
    """Same seed, same rows; another seed, other positions; ``mask_only`` chooses the same positions as ``bert`` for a
    seed and reads ``<mask>`` at all of them; ``scored=all`` puts the original id everywhere."""
    ids = np.random.default_rng(0).integers(0, 30, (50, 16))
    a = mask_rows(ids, 30, 0.15, "bert", np.random.default_rng(3))
    b = mask_rows(ids, 30, 0.15, "bert", np.random.default_rng(3))
    c = mask_rows(ids, 30, 0.15, "bert", np.random.default_rng(4))
    only = mask_rows(ids, 30, 0.15, "mask_only", np.random.default_rng(3))
    assert all(np.array_equal(p, q) for p, q in zip(a, b)) and not np.array_equal(a[1], c[1])
    assert np.array_equal(only[1], a[1]) and np.all(only[0][a[1] != -100] == 30)
    assert np.array_equal(only[0][a[1] == -100], ids[a[1] == -100])
    _, every = mask_rows(ids, 30, 0.15, "bert", np.random.default_rng(3), scored="all")
    assert np.array_equal(every, ids)


def test_loader_masks_each_split_from_its_own_seeded_stream(tmp_path: Path) -> None:
    """``mask_seed`` fixes the masked rows (the same on every load); split ``k`` uses ``default_rng([seed, k])``."""
    write_wikitext(tmp_path)
    a, b = wikitext2(str(tmp_path), seq_len=8, mask_seed=5), wikitext2(str(tmp_path), seq_len=8, mask_seed=5)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_train, b.y_train)
    vocab = build_vocab(STREAM)
    rows = to_rows(STREAM, vocab, 8)
    x, y = mask_rows(rows, 15, 0.15, "bert", np.random.default_rng([5, 0]))
    assert np.array_equal(a.x_train.numpy(), x) and np.array_equal(a.y_train.numpy(), y)
    x, y = mask_rows(to_rows(read_tokens(tmp_path / "wikitext-2" / "wiki.test.tokens"), vocab, 8), 15, 0.15, "bert",
                     np.random.default_rng([5, 2]))  # fmt: skip
    assert np.array_equal(a.y_test.numpy(), y)


def test_without_the_valid_file_there_is_no_validation_split(tmp_path: Path) -> None:
    folder = write_wikitext(tmp_path)
    (folder / "wiki.valid.tokens").unlink()
    data = wikitext2(str(tmp_path), seq_len=8, use_valid=False)
    assert data.num_val == 0 and len(data.y_train) == 4
    data = wikitext2(str(tmp_path), seq_len=8, use_valid=False, protocol=DataProtocol(server_fraction=0.25))
    assert data.num_server == 1 and data.num_client_rows == 3


def test_missing_files_and_bad_options_are_one_line(tmp_path: Path) -> None:
    where = (tmp_path / "wikitext-2").resolve()
    message = raises_one_line(wikitext2, str(tmp_path), match=f"data=wikitext2: WikiText-2 not found at {where}")
    assert "missing wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens" in message and "paths.data_dir" in message
    lm = ["task=masked_lm", "data=wikitext2", "model=transformer_scalable", "partition=iid"]
    raises_one_line(precheck, [*lm, f"paths.data_dir={tmp_path}"], match=f"WikiText-2 not found at {where}")
    write_wikitext(tmp_path)
    assert precheck([*lm, f"paths.data_dir={tmp_path}"]).data.loader.mask_mode == "bert"
    root = str(tmp_path)
    raises_one_line(wikitext2, root, mask_mode="sometimes", match="data.mask_mode='sometimes': must be one of bert")
    raises_one_line(wikitext2, root, mask_rate=1.5, match="data.mask_rate=1.5: must be a number in (0, 1)")
    raises_one_line(wikitext2, root, seq_len=0, match="data.seq_len=0")
    raises_one_line(wikitext2, root, scored="some", match="data.scored='some'")
    raises_one_line(wikitext2, root, seq_len=40, match="wiki.train.tokens holds fewer than data.seq_len=40 tokens")
    val = DataProtocol(val_fraction=0.1)
    raises_one_line(wikitext2, root, protocol=val, match="data.val_fraction=0.1: data=wikitext2 validates on wiki.val")


def test_clients_hold_iid_rows_and_a_label_partition_stops_with_one_line(tmp_path: Path) -> None:
    """Through the datamodule: IID rows over 2 clients, token ids stay int64; ``partition=shards`` (WHALE's default)
    has no labels to split by."""
    write_wikitext(tmp_path, train=TRAIN * 3)
    loader = partial(wikitext2, str(tmp_path), seq_len=8)  # as Hydra's _partial_: the datamodule passes the protocol
    dm = FederatedDataModule(loader, IID(num_clients=2))
    dm.setup("fit")
    assert sorted(torch.cat(list(dm.client_train)).tolist()) == list(range(12)) and dm.data.num_val == 1
    store = dm.clients.to(torch.device("cpu"), torch.float64)
    assert store.x.dtype == store.y.dtype == torch.int64 and store.y.shape == (12, 8)
    dm = FederatedDataModule(loader, Shards(num_clients=2))
    raises_one_line(dm.setup, "fit", match="partition='shards': splits by class label and data=wikitext2 has token")


def _logged(out: Path, key: str) -> list[float]:
    return [float(r[key]) for r in csv.DictReader(open(out / "csv" / "metrics.csv")) if r.get(key)]


@pytest.mark.slow
def test_whale_trains_the_masked_lm_end_to_end(tmp_path: Path) -> None:
    """``algo=whale system=mobile20 model=transformer_scalable task=masked_lm data=wikitext2 partition=iid`` through
    ``train``: a tiny LM (embed 16, 2 heads, FFN 32, 1 layer, dropout 0.2, rows of 8), 5 clients, 2 rounds, the
    per-sample Fisher on the LM (WHALE's default trace): finite losses, perplexity, levels, Fisher and the clock."""
    from flx.run import train

    write_wikitext(tmp_path / "data", train=TRAIN * 12)
    out = tmp_path / "run"
    cfg = precheck(
        [
            "algo=whale",
            "system=mobile20",
            "model=transformer_scalable",
            "task=masked_lm",
            "data=wikitext2",
            "partition=iid",
            "partition.num_clients=5",
            "partition.test_fraction=0.3",
            "model.embed=16",
            "model.heads=2",
            "model.ffn=32",
            "model.layers=1",
            "data.seq_len=8",
            "algo.rounds=2",
            "algo.local_steps=2",
            "algo.batch_size=4",
            "algo.lr=0.1",
            "callbacks.progress_bar=null",
            "trainer.enable_progress_bar=false",
            "trainer.accelerator=cpu",
            f"paths.data_dir={tmp_path / 'data'}",
            f"paths.output_dir={out}",
        ]
    )
    metrics = train(cfg)
    assert math.isfinite(metrics["test/loss"]) and metrics["test/ppl"] == pytest.approx(math.exp(metrics["test/loss"]))
    assert 0.0 <= metrics["test/acc"] <= 1.0 and 0.0 <= metrics["test/client_acc_mean"] <= 1.0
    levels = [_logged(out, f"whale/level_{p}") for p in range(1, 6)]
    assert [sum(v[r] for v in levels) for r in range(2)] == [5.0, 5.0]
    assert [v[0] for v in levels] == [0.0, 0.0, 0.0, 0.0, 5.0]  # cold start: the smallest level, width 1/16
    assert all(math.isfinite(f) and f > 0 for f in _logged(out, "whale/fi_mean"))
    assert all(math.isfinite(v) for v in _logged(out, "val/loss")) and len(_logged(out, "val/ppl")) == 2
