"""What a run prints: its headline metrics, and the final line ``final test_acc=0.9123 test_auroc=0.8812``.

A run's headline metrics are named by the task (``Task.headline``: ``acc`` for classification, ``mse`` for
regression) and then by the algorithm's parts (``PartTraits.headline``: FeDXL's ``auroc`` and ``pauc_*``,
DRFA's ``client_acc_worst``), without the split: the progress bar shows them from the latest evaluation
(``val/<name>``) and the final line from the test (``test/<name>``). A name the run did not log is left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def headline(task: Any, parts: Iterable[Any]) -> tuple[str, ...]:
    """The task's headline names, then each part's (list order), without repeats."""
    names = [*getattr(task, "headline", ())]
    for part in parts:
        traits = getattr(part, "traits", None)  # a part's (flx.traits.PartTraits); other callbacks have none
        names += traits.headline if traits is not None else ()
    return tuple(dict.fromkeys(names))


def present(metrics: Mapping[str, Any], names: Sequence[str], splits: Sequence[str]) -> dict[str, float]:
    """``{split/name: value}`` for each name, from the first of ``splits`` that has it; names no split has are left
    out."""
    out: dict[str, float] = {}
    for name in names:
        key = next((f"{s}/{name}" for s in splits if f"{s}/{name}" in metrics), None)
        if key is not None:
            out[key] = float(metrics[key])
    return out


def final_line(
    metrics: Mapping[str, float],
    names: Sequence[str],
    job: str | None = None,
    extra: Mapping[str, float | str] | None = None,
) -> str | None:
    """``final test_<name>=<value> ...`` over the headline names the test logged, then the ``extra`` values (the
    parts' final values: ``epsilon``, ``private``), numbers with 4 decimals, then ``for <job>`` in a sweep (``job``:
    :func:`flx.launch.job_label`); None when the test logged none of the names.

    >>> final_line({"test/acc": 0.91234, "test/auroc": 0.8, "test/loss": 0.3}, ("acc", "auroc"), "job 1 (algo.lr=0.1)")
    'final test_acc=0.9123 test_auroc=0.8000 for job 1 (algo.lr=0.1)'
    >>> final_line({"test/acc": 0.91234}, ("acc",), extra={"epsilon": 7.98765, "private": "all"})
    'final test_acc=0.9123 epsilon=7.9877 private=all'
    """
    values = {key.replace("/", "_"): value for key, value in present(metrics, names, ("test",)).items()}
    if not values:
        return None
    values |= dict(extra or {})
    line = "final " + " ".join(
        f"{key}={value if isinstance(value, str) else f'{value:.4f}'}" for key, value in values.items()
    )
    return f"{line} for {job}" if job else line
