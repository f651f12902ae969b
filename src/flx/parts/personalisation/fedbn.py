r"""FedBN: batch-norm layers stay on the client.

Li, Jiang, Zhang, Kamp, Dou, "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization", ICLR 2021,
arXiv:2102.07623, Algorithm 1: FedAvg in which every BatchNorm layer (its scale and shift :math:`\gamma, \beta` and
its running mean and variance) stays local; the other parameters are averaged:

.. math::
    w_{k}^{t+1} \leftarrow \sum_{i} p_i\, w_{k,i}^{t} \ \text{for every non-BN layer } k, \qquad
    w_{k,i}^{t+1} \leftarrow w_{k,i}^{t} \ \text{for every BN layer } k.

Each client is evaluated with its own BatchNorm layers and the averaged rest (the personalised model; a client
never sampled: the global model, whose BatchNorm layers keep their initial values). ``algo.local`` (default
``[batch_norm]``) may name more local tensors. The mechanism is
:class:`~flx.parts.personalisation.local_layers.LocalLayers`'s; on a net without BatchNorm FedBN is FedAvg bit for
bit. ``algo=fedbn`` runs the MLP with a BatchNorm1d after each hidden layer (``model=mlp_bn``).
"""

from __future__ import annotations

from collections.abc import Sequence

from flx.parts.personalisation.local_layers import BATCH_NORM, LocalLayers


class FedBN(LocalLayers):
    """FedBN: every BatchNorm layer's :math:`\\gamma, \\beta` and running statistics stay on each client."""

    def __init__(self, local: Sequence[str] = (BATCH_NORM,)) -> None:
        super().__init__(local)
