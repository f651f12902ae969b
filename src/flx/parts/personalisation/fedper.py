r"""FedPer: a shared body and a personal head per client.

Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization Layers", arXiv:1912.00818 (2019),
Sec. 3: the base layers :math:`W_B` are trained by every client and averaged, the personalization layers
:math:`W_{P_j}` of client :math:`j` are trained with them and never leave it:

.. math::
    (W_{B,j}, W_{P_j}) \leftarrow \mathrm{SGD}_j(W_B, W_{P_j}) \ \text{(E epochs, both at once)}, \qquad
    W_B \leftarrow \sum_j \frac{n_j}{n} W_{B,j}.

The personalised model of client :math:`j` is :math:`(W_B, W_{P_j})`. The split is ``algo.local`` (default ``head``,
the final linear layer; the paper varies how many top layers are personal: ``algo.local=[classifier.*]`` keeps the
CNN's two fully connected layers). The mechanism is
:class:`~flx.parts.personalisation.local_layers.LocalLayers`'s; with ``local=[]`` FedPer is FedAvg bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

from flx.parts.personalisation.local_layers import LocalLayers


class FedPer(LocalLayers):
    """FedPer: ``local`` (:math:`W_P`, default the head) stays on each client; the rest (:math:`W_B`) is averaged."""

    def __init__(self, local: Sequence[str] = ("head",)) -> None:
        super().__init__(local)
