"""Shared test setup: one CPU thread (2-core machines run small models faster without oversubscription)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
