"""The round loader: the train "dataloader" of a federated run (:mod:`flx.loop` sets its clients each round)."""

from __future__ import annotations

from collections.abc import Iterator


class RoundLoader:
    """The train "dataloader": yields one batch per round, the tuple of this rank's client ids to train.

    Every rank yields exactly one batch per round (an empty tuple when it has no client), because Lightning runs
    collectives per batch in DDP. It has no ``__len__`` on purpose: the loop sets ``max_batches = 1`` at each round
    start.
    """

    def __init__(self) -> None:
        self.clients: tuple[int, ...] = ()

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter((self.clients,))
