"""Which task a config asks for, and whether the data, partition and algorithm suit it; torch-free, so the pre-run
check (:func:`flx.checks.validate`) can use it. The tasks themselves (losses, metrics) are in :mod:`flx.tasks`.

A data config says what its targets are with ``data.targets``: ``classes`` (int64 labels, the default when the key is
absent), ``real`` (float targets: regression, ``data=diabetes``) or ``tokens`` (int64 ids per position, ``-100`` where
nothing is scored: a masked language model, ``data=wikitext2``). A task says what it needs: ``classification``
classes, ``regression`` real values, ``masked_lm`` tokens, ``custom`` its ``task.targets`` (classes or real).
"""

from __future__ import annotations

import importlib
from typing import Any

from omegaconf import DictConfig, OmegaConf

from flx.errors import MAX_INT, ConfigError, bad_value, count, not_binary
from flx.models.head_spec import num_outputs

REAL, CLASSES, TOKENS = "real", "classes", "tokens"
TARGETS = (CLASSES, REAL)
"""What ``task=custom`` may take (``task.targets``)."""
DATA_TARGETS = (CLASSES, REAL, TOKENS)
"""What a data config may have (``data.targets``)."""
TASKS = {
    "flx.tasks.Classification": "classification",
    "flx.tasks.Regression": "regression",
    "flx.tasks.MaskedLM": "masked_lm",
    "flx.tasks.Custom": "custom",
}
"""The shipped tasks' ``_target_`` -> their ``task=`` name; their targets are known without importing torch."""
NEEDS = {"classification": CLASSES, "regression": REAL, "masked_lm": TOKENS}
KINDS = {REAL: "real-valued targets", CLASSES: "class labels", TOKENS: "token targets"}
ALLOWED = {
    CLASSES: "task=classification (or task=custom with task.targets=classes)",
    REAL: "task=regression or task=custom",
    TOKENS: "task=masked_lm",
}


def mismatch(task: str, needs: str, data: str, has: str | None = None) -> ConfigError:
    """The one line for a task whose targets (``needs``) are not those of ``data`` (``has``; default: the other of
    classes and real)."""
    has = has if has is not None else CLASSES if needs == REAL else REAL
    why = f"needs {KINDS[needs]} and data={data} has {KINDS[has]}; allowed with data={data}: {ALLOWED[has]}"
    return bad_value("task", task, why)


def task_targets(task: Any) -> tuple[str, str | None]:
    """``(name, targets)`` of a ``task`` config node: its ``task=`` name and ``real`` / ``classes`` (None: unknown)."""
    if task is None:
        return "classification", CLASSES  # no task node: the default
    target = str(task.get("_target_", ""))
    name = TASKS.get(target, target)
    targets = NEEDS.get(name, task.get("targets", REAL if name == "custom" else None))
    allowed = TARGETS if name == "custom" else DATA_TARGETS
    if targets is not None and targets not in allowed:
        raise bad_value("task.targets", targets, f"allowed: {', '.join(allowed)}")
    return name, targets


def check_task(cfg: DictConfig) -> None:
    """The task against the data (``data.targets``), the partition, ``client_eval`` and the algorithm; the custom
    loss and metric must import. One line naming the key, the value and what is allowed."""
    data_targets = cfg.data.get("targets", CLASSES)
    if data_targets not in DATA_TARGETS:
        raise bad_value("data.targets", data_targets, f"allowed: {', '.join(DATA_TARGETS)}")
    name, targets = task_targets(cfg.get("task"))
    if targets is not None and targets != data_targets:
        raise mismatch(name, targets, cfg.data.get("name", "?"), data_targets)
    _check_imports(cfg.get("task"), name)
    if data_targets == CLASSES:
        _check_classes(cfg)
    else:
        _check_no_labels(cfg, data_targets)


def _check_classes(cfg: DictConfig) -> None:
    """An algorithm for binary tasks (``algo.binary_task``) on data whose config says it has other than 2 classes
    (``data.num_classes``): reported here, before any import or loading; the parts check the loaded labels again."""
    classes = cfg.data.get("num_classes")
    if classes is not None:
        count("data.num_classes", classes, 1, MAX_INT)
    if cfg.algo.get("binary_task") and classes is not None and classes != 2:
        raise not_binary(f"algo={cfg.algo.name}", int(classes))
    head = cfg.model.get("binary_head", "two_logits")
    num_outputs(head, 2 if classes is None else int(classes))  # a bad head; one_logit on a multi-class task


def _check_no_labels(cfg: DictConfig, targets: str) -> None:
    """Real-valued or token targets (``targets``): no binary algorithm, no partition by class label, no per-class
    client evaluation."""
    from hydra.utils import get_class

    data = cfg.data.get("name", "?")
    if cfg.algo.get("binary_task"):
        has = "real targets" if targets == REAL else KINDS[targets]
        raise ConfigError(f"data: algo={cfg.algo.name} needs a binary task (labels 0/1), data={data} has {has}")
    if cfg.get("client_eval", "holdout") == "test_labels":
        why = f"needs class labels and data={data} has {KINDS[targets]}; allowed: holdout, test_group"
        raise bad_value("client_eval", cfg.client_eval, why)
    try:  # numpy only; a partition that does not import is reported by the partition check
        cls = get_class(str(OmegaConf.select(cfg, "partition._target_")))
    except Exception:
        return
    if getattr(cls, "uses_labels", False):
        from flx.datamodules.partitioners import REAL_TARGETS, TOKEN_TARGETS, needs_labels

        raise needs_labels(getattr(cls, "name", cls.__name__), data, REAL_TARGETS if targets == REAL else TOKEN_TARGETS)


def _check_imports(task: Any, name: str) -> None:
    """A task that is not one of flx's, and the callables a task names by ``_target_`` (``task.loss``,
    ``task.metric``), must import (imports torch for ``task=custom``: the pre-run check is then ~1 s slower)."""
    if task is None:
        return
    if name not in NEEDS and name != "custom":
        _locate("task._target_", name, "a flx.tasks.Task class, e.g. flx.tasks.Regression")
    for key in ("loss", "metric"):
        node = task.get(key)
        if OmegaConf.is_dict(node) and "_target_" in node:
            _locate(f"task.{key}._target_", str(node._target_), "a callable, e.g. torch.nn.functional.l1_loss")


def _locate(key: str, path: str, what: str) -> None:
    """Imports the longest module prefix of the dotted ``path`` and walks the rest as attributes."""
    parts, obj = path.split("."), None
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # not a module (ImportError), or one that fails to import: try a shorter prefix
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        break
    if obj is None or not callable(obj):
        raise bad_value(key, path, f"cannot be imported; give an importable name of {what}")
