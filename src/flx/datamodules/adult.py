"""UCI Adult (census income) as used by DRFA (Deng et al., NeurIPS 2020): 14 features, one number each.

Files: ``<root>/adult/adult.data`` (train, 32,561 rows) and ``<root>/adult/adult.test`` (test, 16,281 rows), as in
UCI's ``adult.zip``, each plain or ``.gz``. Rows are comma(+space)-separated with 15 columns (:data:`COLUMNS`); blank
lines and lines starting with ``|`` (``adult.test`` opens with ``|1x3 Cross validator``) are skipped; ``adult.test``
ends its labels with a dot (``>50K.``). Missing values are ``?``.

Encoding (the paper's "14 features" and its MLP 14->50->50->2 take one number per column):

* numeric columns (:data:`NUMERIC`) as they are, a ``?`` counts as the train mean;
* categorical columns as an integer code: the sorted category names of ``adult.data`` (``?`` excluded) are
  ``0..K-1``; ``?`` and a category absent from ``adult.data`` get ``K``;
* then every column is standardised with the train file's mean and std (a zero std counts as 1).

Label: 1 if the income is ``>50K``. Groups (``TensorData.groups_*``, for ``partition=by_group``): the sex or the race
of each row, numbered by the position of its value in :data:`GROUPS`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from flx.datamodules import files
from flx.datamodules.files import ADULT_FILES as FILES
from flx.datamodules.files import choice as _choice
from flx.datamodules.formats import _corrupt, _read_bytes
from flx.datamodules.store import TensorData
from flx.errors import ConfigError

COLUMNS = (
    "age",
    "workclass",
    "fnlwgt",
    "education",
    "education-num",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
    "native-country",
    "income",
)
"""The 15 columns of a row: the 14 features, then the income label."""
FEATURES = COLUMNS[:-1]
NUMERIC = frozenset({"age", "fnlwgt", "education-num", "capital-gain", "capital-loss", "hours-per-week"})
MISSING = "?"
INCOMES = {"<=50K": 0, ">50K": 1}
GROUPS = {
    "sex": ("Female", "Male"),
    "race": ("White", "Black", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other"),
}
"""Group names per ``split_by`` option; a row's group id is the position of its value here."""


class _Table(NamedTuple):
    """The data rows of one Adult file.

    Attributes:
        path: the file, for error messages.
        rows: the 15 stripped fields of each data row.
        lines: the 1-based line number of each row in the file.
    """

    path: Path
    rows: list[list[str]]
    lines: list[int]

    def error(self, i: int, problem: str) -> ConfigError:
        """The one-line error for row ``i``, naming the file and the line."""
        return _corrupt("adult", self.path, f"line {self.lines[i]}: {problem}")

    def column(self, j: int) -> list[str]:
        return [row[j] for row in self.rows]

    def numbers(self, j: int) -> np.ndarray:
        """Column ``j`` as float64, ``?`` as NaN."""
        out = np.empty(len(self.rows))
        for i, value in enumerate(self.column(j)):
            try:
                out[i] = math.nan if value == MISSING else float(value)
            except ValueError:
                raise self.error(i, f"{COLUMNS[j]} {value!r} is not a number") from None
            if not math.isfinite(out[i]) and value != MISSING:
                raise self.error(i, f"{COLUMNS[j]} {value!r} is not a finite number")
        return out

    def ids(self, j: int, names: dict[str, int], what: str) -> np.ndarray:
        """Column ``j`` mapped through ``names`` (with one trailing dot dropped) to int64 ids."""
        out = np.empty(len(self.rows), dtype=np.int64)
        for i, value in enumerate(self.column(j)):
            key = value[:-1] if value.endswith(".") else value
            if key not in names:
                raise self.error(i, f"{COLUMNS[j]} {value!r} is not {what}")
            out[i] = names[key]
        return out


def _read_table(path: Path) -> _Table:
    """Reads the data rows of ``adult.data`` or ``adult.test``.

    Raises:
        ConfigError: if a row does not have 15 fields, or the file has no data rows.
    """
    table = _Table(path, [], [])
    for number, line in enumerate(_read_bytes(path, "adult").decode("latin-1").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("|"):
            continue
        table.rows.append([field.strip() for field in line.split(",")])
        table.lines.append(number)
        if len(table.rows[-1]) != len(COLUMNS):
            raise table.error(-1, f"expected {len(COLUMNS)} comma-separated fields, got {len(table.rows[-1])}")
    if not table.rows:
        raise _corrupt("adult", path, "no data rows")
    return table


def _codes(train: list[str], other: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes of a categorical column: sorted train categories ``0..K-1``, ``?`` and unseen ones ``K``."""
    index = {name: k for k, name in enumerate(sorted(set(train) - {MISSING}))}
    return tuple(np.array([index.get(v, len(index)) for v in col], dtype=np.float64) for col in (train, other))


def _features(train: _Table, test: _Table, standardize: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The ``(N, 14)`` float32 train and test features, standardised with the train statistics (``standardize``)
    or raw (numbers as they are, categories as codes; a missing number is still the train mean)."""
    pairs = [
        (train.numbers(j), test.numbers(j)) if name in NUMERIC else _codes(train.column(j), test.column(j))
        for j, name in enumerate(FEATURES)
    ]
    x_train, x_test = (np.stack([pair[k] for pair in pairs], axis=1) for k in (0, 1))
    mean, std = np.nanmean(x_train, axis=0), np.nanstd(x_train, axis=0)
    std[~(std > 0)] = 1.0
    if not standardize:
        return tuple(np.where(np.isnan(x), mean, x).astype(np.float32) for x in (x_train, x_test))
    # a missing number (NaN) becomes the train mean, i.e. 0 after standardising
    return tuple(np.nan_to_num((x - mean) / std, nan=0.0).astype(np.float32) for x in (x_train, x_test))


def adult(root: str, split_by: str = "sex", standardize: bool = True) -> TensorData:
    """UCI Adult from ``<root>/adult/adult.data`` and ``adult.test`` (see the module docstring for the encoding).

    Args:
        root: the data directory.
        split_by: the sensitive attribute that gives the sample groups: ``sex`` (Female, Male) or ``race``
            (White, Black, Asian-Pac-Islander, Amer-Indian-Eskimo, Other).
        standardize: z-score every column with ``adult.data``'s statistics; ``False`` keeps the raw numbers and codes.

    Returns:
        Inputs ``(N, 14)`` float32, 2 classes, ``groups_train`` / ``groups_test`` by ``split_by``.

    Raises:
        ConfigError: on an unknown ``split_by``, a missing file, or a malformed row (naming the file and line).
    """
    _choice("data.loader.split_by", split_by, list(GROUPS))
    found = files.adult(root)
    train, test = _read_table(found[FILES[0]]), _read_table(found[FILES[1]])
    x_train, x_test = _features(train, test, standardize)
    group_ids = {name: g for g, name in enumerate(GROUPS[split_by])}
    group_col, label_col = COLUMNS.index(split_by), len(COLUMNS) - 1
    one_of = "one of " + ", ".join(GROUPS[split_by])
    return TensorData(
        x_train=torch.from_numpy(x_train),
        y_train=torch.from_numpy(train.ids(label_col, INCOMES, "<=50K or >50K")),
        x_test=torch.from_numpy(x_test),
        y_test=torch.from_numpy(test.ids(label_col, INCOMES, "<=50K. or >50K.")),
        num_classes=2,
        name=f"adult-{split_by}",
        groups_train=torch.from_numpy(train.ids(group_col, group_ids, one_of)),
        groups_test=torch.from_numpy(test.ids(group_col, group_ids, one_of)),
        group_names=GROUPS[split_by],
    )
