"""Which task a config asks for, and whether the data, partition and algorithm suit it; torch-free, so the pre-run
check (:func:`flx.config.validate`) can use it. The tasks themselves (losses, metrics) are in :mod:`flx.tasks`.

A data config says what its targets are with ``data.targets``: ``classes`` (int64 labels, the default when the key is
absent) or ``real`` (float targets: regression, ``data=diabetes``). A task says what it needs: ``classification``
classes, ``regression`` real values, ``custom`` its ``task.targets``.
"""

from __future__ import annotations

import importlib
from typing import Any

from omegaconf import DictConfig, OmegaConf

from flx.errors import ConfigError, bad_value, not_binary
from flx.models.head_spec import num_outputs

REAL, CLASSES = "real", "classes"
TARGETS = (CLASSES, REAL)
TASKS = {
    "flx.tasks.Classification": "classification",
    "flx.tasks.Regression": "regression",
    "flx.tasks.Custom": "custom",
}
"""The shipped tasks' ``_target_`` -> their ``task=`` name; their targets are known without importing torch."""
NEEDS = {"classification": CLASSES, "regression": REAL}


def mismatch(task: str, needs: str, data: str) -> ConfigError:
    """The one line for a task whose targets (``needs``) are not those of ``data`` (which has the other kind)."""
    kind = {REAL: "real-valued targets", CLASSES: "class labels"}
    has = CLASSES if needs == REAL else REAL
    allowed = {
        CLASSES: "task=classification (or task=custom with task.targets=classes)",
        REAL: "task=regression or task=custom",
    }
    why = f"needs {kind[needs]} and data={data} has {kind[has]}; allowed with data={data}: {allowed[has]}"
    return bad_value("task", task, why)


def task_targets(task: Any) -> tuple[str, str | None]:
    """``(name, targets)`` of a ``task`` config node: its ``task=`` name and ``real`` / ``classes`` (None: unknown)."""
    if task is None:
        return "classification", CLASSES  # no task node: the default
    target = str(task.get("_target_", ""))
    name = TASKS.get(target, target)
    targets = NEEDS.get(name, task.get("targets", REAL if name == "custom" else None))
    if targets is not None and targets not in TARGETS:
        raise bad_value("task.targets", targets, f"allowed: {', '.join(TARGETS)}")
    return name, targets


def check_task(cfg: DictConfig) -> None:
    """The task against the data (``data.targets``), the partition, ``client_eval`` and the algorithm; the custom
    loss and metric must import. One line naming the key, the value and what is allowed."""
    data_targets = cfg.data.get("targets", CLASSES)
    if data_targets not in TARGETS:
        raise bad_value("data.targets", data_targets, f"allowed: {', '.join(TARGETS)}")
    name, targets = task_targets(cfg.get("task"))
    if targets is not None and targets != data_targets:
        raise mismatch(name, targets, cfg.data.get("name", "?"))
    _check_imports(cfg.get("task"), name)
    if data_targets == REAL:
        _check_real_targets(cfg)
    else:
        _check_classes(cfg)


def _check_classes(cfg: DictConfig) -> None:
    """An algorithm for binary tasks (``algo.binary_task``) on data whose config says it has other than 2 classes
    (``data.num_classes``): reported here, before any import or loading; the parts check the loaded labels again."""
    classes = cfg.data.get("num_classes")
    if cfg.algo.get("binary_task") and classes is not None and classes != 2:
        raise not_binary(f"algo={cfg.algo.name}", int(classes))
    head = cfg.model.get("binary_head", "two_logits")
    num_outputs(head, 2 if classes is None else int(classes))  # a bad head; one_logit on a multi-class task


def _check_real_targets(cfg: DictConfig) -> None:
    """Real-valued targets: no binary algorithm, no partition by class label, no per-class client evaluation."""
    from hydra.utils import get_class

    data = cfg.data.get("name", "?")
    if cfg.algo.get("binary_task"):
        raise ConfigError(f"data: algo={cfg.algo.name} needs a binary task (labels 0/1), data={data} has real targets")
    if cfg.get("client_eval", "holdout") == "test_labels":
        why = f"needs class labels and data={data} has real-valued targets; allowed: holdout, test_group"
        raise bad_value("client_eval", cfg.client_eval, why)
    try:  # numpy only; a partition that does not import is reported by the partition check
        cls = get_class(str(OmegaConf.select(cfg, "partition._target_")))
    except Exception:
        return
    if getattr(cls, "uses_labels", False):
        from flx.datamodules.partitioners import needs_labels

        raise needs_labels(getattr(cls, "name", cls.__name__), data)


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
