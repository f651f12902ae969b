"""AUROC and standardised pAUC against ``sklearn.metrics.roc_auc_score`` (the metric FeDXL reports).

Tolerance 1e-6: torchmetrics' ``max_fpr`` branch computes in float32 (errors ~1e-8 observed).
"""

import itertools
import math
import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from flx.metrics.auc import AUROCs, binary_auroc, partial_auroc

MAX_FPRS = (0.1, 0.3, 0.5, 1.0)


def _sample(seed: int, n: int, pos_rate: float, ties: bool, scale: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    """Labels with both classes and scores weakly correlated with them; ``ties`` rounds scores to a coarse grid."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < pos_rate).astype(np.int64)
    y[:2] = (0, 1)
    s = scale * (rng.normal(size=n) + 0.7 * y)
    return (np.round(s) if ties else s), y


def _sk(s: np.ndarray, y: np.ndarray, max_fpr: float | None) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(roc_auc_score(y, s, max_fpr=max_fpr))


CASES = list(itertools.product(range(3), (20, 257), (0.05, 0.5, 0.9), (False, True)))


@pytest.mark.parametrize(("seed", "n", "pos_rate", "ties"), CASES)
def test_matches_sklearn(seed: int, n: int, pos_rate: float, ties: bool) -> None:
    s, y = _sample(seed, n, pos_rate, ties)
    assert binary_auroc(torch.from_numpy(s), torch.from_numpy(y)).item() == pytest.approx(_sk(s, y, None), abs=1e-6)
    for m in MAX_FPRS:
        got = partial_auroc(torch.from_numpy(s), torch.from_numpy(y), m).item()
        assert got == pytest.approx(_sk(s, y, m), abs=1e-6), m


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_logits_are_not_tied_by_a_sigmoid(dtype: torch.dtype) -> None:
    """Scores far outside [0, 1] (sigmoid(x) == 1.0 for x > ~17 in float32) keep their ranking; the
    ``[0, 1]``-looking probabilities from the same ranking give the same result."""
    s, y = _sample(7, 300, 0.3, ties=False, scale=40.0)
    for m in MAX_FPRS:
        got = partial_auroc(torch.from_numpy(s).to(dtype), torch.from_numpy(y), m).item()
        assert got == pytest.approx(_sk(s.astype(np.float32) if dtype == torch.float32 else s, y, m), abs=1e-6)


def test_target_dtypes_and_shapes_agree() -> None:
    s, y = _sample(3, 50, 0.4, ties=True)
    ref = _sk(s, y, 0.3)
    for t in (torch.from_numpy(y), torch.from_numpy(y).bool(), torch.from_numpy(y).float()):
        assert partial_auroc(torch.from_numpy(s)[:, None], t[:, None], 0.3).item() == pytest.approx(ref, abs=1e-6)


@pytest.mark.parametrize("max_fpr", MAX_FPRS)
def test_perfect_and_reversed_rankings(max_fpr: float) -> None:
    """Perfect: 1. Reversed: pAUC area A = 0, so McClish gives 1/2 + 1/2 * (0 - a^2/2) / (a - a^2/2)
    = 1/2 - a / (2 (2 - a)), which is 0 at a = 1 and tends to the 0.5 floor as a -> 0 (sklearn's values)."""
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    s = torch.arange(6.0)
    reversed_expected = 0.5 - max_fpr / (2 * (2 - max_fpr))
    assert partial_auroc(s, y, max_fpr).item() == pytest.approx(1.0, abs=1e-6)
    assert partial_auroc(-s, y, max_fpr).item() == pytest.approx(reversed_expected, abs=1e-6)
    assert reversed_expected == pytest.approx(_sk(-s.numpy(), y.numpy(), max_fpr), abs=1e-6)
    assert binary_auroc(s, y).item() == 1.0 and binary_auroc(-s, y).item() == 0.0


def test_all_tied_scores_give_one_half() -> None:
    y = torch.tensor([0, 1, 0, 1, 1])
    for m in MAX_FPRS:
        assert partial_auroc(torch.zeros(5), y, m).item() == pytest.approx(0.5, abs=1e-6)


@pytest.mark.parametrize("label", [0, 1])
def test_one_class_only_is_nan(label: int) -> None:
    """Documented choice: nan (as sklearn returns), for the functions and for the metric."""
    y, s = torch.full((8,), label), torch.randn(8)
    assert math.isnan(binary_auroc(s, y).item())
    assert math.isnan(partial_auroc(s, y, 0.3).item())
    metric = AUROCs()
    metric.update(s, y)
    assert all(math.isnan(v.item()) for v in metric.compute().values())


def test_invalid_inputs_raise() -> None:
    s, y = torch.randn(4), torch.tensor([0, 1, 0, 1])
    with pytest.raises(ValueError, match="target"):
        binary_auroc(s, torch.tensor([0, 1, 2, 1]))
    with pytest.raises(ValueError, match="finite"):
        binary_auroc(torch.tensor([0.1, math.nan, 0.2, 0.3]), y)
    with pytest.raises(ValueError, match="size"):
        binary_auroc(s, y[:3])
    with pytest.raises(ValueError, match="max_fpr"):
        partial_auroc(s, y, 0.0)
    with pytest.raises(ValueError, match="max_fprs"):
        AUROCs(max_fprs=(0.3, 1.5))


def test_metric_streaming_equals_one_shot_and_sklearn() -> None:
    s, y = _sample(11, 203, 0.2, ties=True)
    metric = AUROCs(max_fprs=(0.3, 0.5))
    for chunk in np.array_split(np.arange(len(y)), [17, 18, 90, 150]):
        metric.update(torch.from_numpy(s[chunk]), torch.from_numpy(y[chunk]))
    streamed = metric.compute()
    assert list(streamed) == ["auroc", "pauc_0.3", "pauc_0.5"]

    one_shot = AUROCs(max_fprs=(0.3, 0.5))
    one_shot.update(torch.from_numpy(s), torch.from_numpy(y))
    for key, value in one_shot.compute().items():
        assert streamed[key].item() == value.item()
    assert streamed["auroc"].item() == pytest.approx(_sk(s, y, None), abs=1e-6)
    assert streamed["pauc_0.3"].item() == pytest.approx(_sk(s, y, 0.3), abs=1e-6)
    assert streamed["pauc_0.5"].item() == pytest.approx(_sk(s, y, 0.5), abs=1e-6)

    metric.reset()
    metric.update(torch.tensor([0.2, 0.9]), torch.tensor([0, 1]))
    assert metric.compute()["auroc"].item() == 1.0
