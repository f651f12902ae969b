"""What :class:`~flx.module.FederatedModule` logs, in one place: the keys a run logs (:func:`metric_names`), the
round's row (``train/loss``, ``fl/*``, ``sim/*``), the evaluated splits' metrics and their per-client summaries, the
personalised models' spread, and W&B's per-client tables.

Round-level scalars reach ``trainer.callback_metrics`` directly (:meth:`Reporter.publish`) and the loggers in one
call per round (:meth:`Reporter.log_round`), not through ``self.log``: Lightning's result collection costs ~0.7 ms
a key and round (docs/performance.md). Evaluation metrics go through the module's ``log`` (Lightning's epoch-end
aggregation of the validation/test loops). Keys: classification ``val/acc``, ``val/loss``,
``val/client_acc_{mean,worst,std}``, binary tasks also ``val/auroc``, ``val/pauc_0.3``, ``val/pauc_0.5``; regression
``val/loss``, ``val/mse``, ``val/rmse``, ``val/client_mse_{mean,worst,std}``; ``test/*`` likewise, and with unseen
clients ``participating/*`` and ``unseen/*`` (:data:`flx.datamodules.datamodule.SIDE_SPLITS`), round-level keys
under ``fl/`` (``round``: communication rounds so far, ``local_steps``: local iterations per client so far,
``cohort``, ``samples``), simulated time under ``sim/`` (``round_time``, ``clock``: seconds, with a ``system``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from flx.hooks import FederatedCallback, overrides
from flx.metrics.client_summary import SPREAD, spread, summarize
from flx.tasks import Task
from flx.wandb_logging import ROUND, log_wandb, wandb_loggers


def metric_names(task: Task, parts: list[Any], datamodule: Any, simulated: bool) -> tuple[str, ...]:
    """Every key a run of this module logs into Lightning's metrics during fit (``trainer.callback_metrics``: what
    ``checkpoint.monitor`` may name), known at build time: ``train/loss``, ``fl/round``, ``sim/round_time`` and
    ``sim/clock`` (``simulated``: a ``system``), each evaluated split's task metrics (:meth:`Task.metric_names`) and
    personalised summaries (``{split}/personal_<key>_{mean,worst,p10}`` with a part that personalises), and the parts'
    own (``traits.metrics``; ``{split}`` expanded, ``*`` patterns kept).

    Args:
        task: the run's task.
        parts: the algorithm's parts (others are skipped).
        datamodule: the set-up :class:`~flx.datamodules.datamodule.FederatedDataModule`.
        simulated: whether the run has a simulated system (``system=``).
    """
    fed_parts = [p for p in parts if isinstance(p, FederatedCallback)]
    names = ["train/loss", ROUND, *(("sim/round_time", "sim/clock") if simulated else ())]
    personal = any(overrides(p, "personalize") for p in fed_parts)
    splits = list(dict.fromkeys(loader.split for loader in datamodule.eval_plan("val")))
    for split in splits:
        rows = datamodule.has_client_rows(split)
        names += [f"{split}/{n}" for n in task.metric_names(datamodule.data.num_classes, rows)]
        own = personal and datamodule.has_personal_rows(split)
        names += [f"{split}/personal_{task.client_key}_{k}" for k in SPREAD] if own else []
    for part in fed_parts:
        for name in part.traits.metrics:
            names += [name.format(split=s) for s in splits] if "{split}" in name else [name]
    return tuple(dict.fromkeys(names))


def participation_gap(metrics: Mapping[str, float], key: str) -> dict[str, float]:
    """The final values of a run with unseen clients: ``unseen_<key>`` (the global model on the unseen clients' rows)
    and ``participation_gap``, ``participating/<key> - unseen/<key>`` (Yuan et al., ICLR 2022: the metric on the
    participating clients' held-out rows less the metric on clients that never participate; ``key``: the task's
    per-client metric, ``acc`` or ``mse``). Empty without unseen clients; no gap without the participating
    clients' held-out rows (``partition.test_fraction=0``).

    >>> participation_gap({"participating/acc": 0.75, "unseen/acc": 0.5}, "acc")
    {'unseen_acc': 0.5, 'participation_gap': 0.25}
    """
    out = {f"unseen_{key}": float(metrics[f"unseen/{key}"])} if f"unseen/{key}" in metrics else {}
    if out and f"participating/{key}" in metrics:
        out["participation_gap"] = float(metrics[f"participating/{key}"]) - out[f"unseen_{key}"]
    return out


class Reporter:
    """The module's logging: the round's row at each round's end, the evaluation's metrics and W&B tables.

    Args:
        module: the :class:`~flx.module.FederatedModule` whose trainer, federation, metrics and ``log`` it uses.
    """

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module

    # ------------------------------------------------------------------ the round's row
    def round_end(self) -> None:
        """The round's scalars: the mean local loss of the round's aggregated clients, summed over ranks in the
        round's one all-reduce (``Federation.train_loss``), so it is the same on every rank and costs no collective
        of its own, and the simulated seconds (docs/systems.md; published even without a logger, for the curves);
        with a logger, the round's counts too (``fl/*``)."""
        module = self.module
        fed = module.federation
        values = {}
        loss = fed.train_loss
        if loss is not None:
            values["train/loss"] = loss
        clock = fed.clock
        if clock is not None:
            values |= {"sim/round_time": clock.round_time, "sim/clock": clock.elapsed}
        published = self.publish(values)
        if not module.loggers:
            return
        rnd = fed.rnd
        samples = sum(fed.num_samples(c) for c in rnd.cohort)
        faults = fed.faults
        counts = {"fl/round": float(rnd.round + 1), "fl/cohort": float(len(rnd.cohort)), "fl/samples": float(samples)}
        counts |= {"fl/dropped_clients": float(len(faults.dropped)), "fl/skipped_clients": float(len(faults.skipped))}
        if fed.cfg.local_epochs is None:  # local iterations so far, per client (AFL: one per round)
            counts["fl/local_steps"] = float((rnd.round + 1) * fed.cfg.local_steps)
        self.log_round({**published, **counts})

    def publish(self, values: Mapping[str, float]) -> dict[str, float]:
        """Puts round-level scalars into ``trainer.callback_metrics`` (what the bar, the curves, ``checkpoint.monitor``
        and Lightning's monitoring callbacks read) as ``self.log(name, value, on_epoch=True)`` would at the round's
        end: scalars of the module's ``logged_dtype`` (float32; float64 in a float64 run), after the plain callbacks'
        and before the monitoring callbacks' ``on_train_epoch_end``. Not through ``self.log``: Lightning's result
        collection moves the whole metric object to the value's device at every call, a tenth of the overhead of a
        small model's round (docs/performance.md); the loggers get the values from :meth:`log_round`.
        Returns the values as the loggers write them (rounded to ``logged_dtype`` on the host: no device sync)."""
        module = self.module
        host = {k: torch.tensor(v, dtype=module.logged_dtype) for k, v in values.items()}
        module.trainer.callback_metrics.update({k: t.to(module.device) for k, t in host.items()})
        return {k: t.item() for k, t in host.items()}

    def log_round(self, values: dict[str, float]) -> None:
        """Sends round-level scalars to every logger, in one row per round: at the step of the round's last batch,
        ``trainer.global_step - 1`` (the 0-based round: a round is one step), plus ``epoch``, as Lightning logs
        epoch-end metrics. Identical on every rank (rank zero writes). One logger call, not a ``self.log`` per key.
        Values the parts log with ``self.log`` at the round's end join the row (``flx.loggers.CSVLogger`` merges a
        step's calls until it writes); :meth:`flx.loop.FederatedFitLoop.on_advance_end` writes the row.
        """
        module = self.module
        for logger in module.loggers:
            logger.log_metrics({**values, "epoch": module.current_epoch}, step=module.trainer.global_step - 1)

    # ------------------------------------------------------------------ the evaluation's metrics
    def eval_round(self) -> None:
        """With a logger, the round the evaluated model comes from: the x-axis of the evaluation's metrics."""
        module = self.module
        if module.loggers:
            module.log(ROUND, float(module.federation.server.round), add_dataloader_idx=False)

    def log_split(self, split: str, per_client_rows: bool) -> None:
        """The global model's metrics on ``split`` (``{split}/<key>``) and, with per-client rows, their per-client
        summaries (``{split}/client_<key>_{mean,worst,std}``) and W&B table."""
        module = self.module
        metrics = module.metrics[split]
        for key, value in metrics.values().items():
            module.log(f"{split}/{key}", value, add_dataloader_idx=False)
        if per_client_rows and metrics.client_key is not None:
            per_client, key = metrics.client_values(), metrics.client_key
            for k, v in summarize(per_client, metrics.higher_is_better).items():
                module.log(f"{split}/client_{key}_{k}", v, add_dataloader_idx=False)
            columns = {key: per_client}
            loss_rows = metrics.client_loss_values()
            if loss_rows is not None:
                columns |= {"loss": loss_rows[0], "samples": loss_rows[1]}
            self.client_table(split, columns)

    def log_personal(self, split: str, name: str, per_client: Tensor) -> None:
        """The personalised models' per-client metric on ``split``: ``{split}/<name>_<key>_{mean,worst,p10}``
        (``<key>``: the task's per-client metric), and on W&B the per-client table and bar chart."""
        module = self.module
        key = module.task.client_key
        for k, v in spread(per_client, module.task.higher_is_better).items():
            module.log(f"{split}/{name}_{key}_{k}", v.to(module.logged_dtype), add_dataloader_idx=False)
        self.client_table(split, {f"{name}_{key}": per_client})

    def client_table(self, split: str, columns: dict[str, Tensor]) -> None:
        """W&B, rank zero: the table ``{split}/client_<key>_table``, with ``<key>`` the first column's name, and a bar
        chart of that column, ``{split}/client_<key>_bar``. One row per client with evaluation rows: ``client``, the
        ``columns`` (the global model's: the task's per-client metric, ``loss``, ``samples``: its evaluation rows),
        ``train_samples`` (its training rows) and ``sampled`` (in the cohort of the round the model comes from)."""
        trainer = self.module.trainer
        loggers = wandb_loggers(trainer)
        if not loggers:
            return
        import wandb

        key, fed = next(iter(columns)), self.module.federation
        cohort, values = set(fed.cohort), {k: v.tolist() for k, v in columns.items()}
        rows = [
            [c, *(v[c] for v in values.values()), fed.num_samples(c) if c < fed.num_clients else 0, c in cohort]
            for c, a in enumerate(values[key])
            if not math.isnan(a)
        ]
        table = wandb.Table(columns=["client", *columns, "train_samples", "sampled"], data=rows)
        model = "the personalised models" if key.startswith("personal_") else "the global model"
        title = f"{split}: {'accuracy' if key == 'acc' else key} of {model} per client"
        bar = wandb.plot.bar(table, "client", key, title=title)
        tables = {f"{split}/client_{key}_table": table, f"{split}/client_{key}_bar": bar}
        log_wandb(trainer, tables | {ROUND: float(fed.server.round)})  # in the round's row, with the round
