r"""LG-FedAvg: local representations, a global head.

Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, "Think Locally, Act Globally: Federated Learning
with Local and Global Representations", arXiv:2001.01523 (2020), Sec. 3 and Algorithm 1: client :math:`m` keeps its
local model :math:`\ell_m` (the lower layers, mapping its data to a representation) and trains it with the global
model :math:`g` (the top layers) on its rows; only :math:`g` is sent and averaged:

.. math::
    (\ell_m, g_m) \leftarrow \mathrm{SGD}_m(\ell_m, g^t), \qquad g^{t+1} = \sum_{m \in P_t} \frac{n_m}{n} g_m.

The personalised model of client :math:`m` is :math:`(\ell_m, g^t)` (the paper's local test). Local is
``algo.local`` (default ``["*", "!head"]``: every layer but the final linear one, the paper's split for its MNIST and
CIFAR nets, whose global part is the last layers). The mechanism is
:class:`~flx.parts.personalisation.local_layers.LocalLayers`'s. A client's local layers start from the net's initial
values at its first visit (the authors' code can instead start from a FedAvg-trained model, its ``load_fed``
option; not done here).
"""

from __future__ import annotations

from collections.abc import Sequence

from flx.parts.personalisation.local_layers import LocalLayers


class LGFedAvg(LocalLayers):
    """LG-FedAvg: ``local`` (:math:`\\ell_m`, default everything but the head) stays on each client; the head
    (:math:`g`) is averaged."""

    def __init__(self, local: Sequence[str] = ("*", "!head")) -> None:
        super().__init__(local)
