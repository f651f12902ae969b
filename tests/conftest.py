"""Shared test setup: one CPU thread (2-core machines run small models faster without oversubscription); W&B offline,
quiet and without its system-metrics sampler (a process probing the machine for each run), unless a test says
otherwise."""

from __future__ import annotations

import os

import torch

torch.set_num_threads(1)
for _key, _value in {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_X_DISABLE_STATS": "true",
    "WANDB_X_DISABLE_MACHINE_INFO": "true",
}.items():
    os.environ.setdefault(_key, _value)
