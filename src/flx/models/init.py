"""Starting weights of the global model ``w^0`` (``model.init``).

``default`` keeps the net's own initialisation (PyTorch's, drawn from the run seed). ``zeros`` sets every
parameter to 0: the usual start of a convex model, and what the DRFA authors' FedTorch code does for its logistic
regression (``_weight_initialization`` zeroes the weight and the bias); the DRFA paper itself does not say. With
zeros every seed starts from the same ``w^0``. Zeros suits convex models (``model=logreg``): in a net with hidden
layers it makes the hidden units of a layer identical and keeps them so (no symmetry breaking).
"""

from __future__ import annotations

import torch
from torch import nn

from flx.choices import MODEL_INITS as INITS
from flx.errors import bad_value


def check_init(init: str) -> str:
    """Returns ``init`` if it is one of :data:`INITS`; raises a one-line ``ConfigError`` naming ``model.init``."""
    if init not in INITS:
        raise bad_value("model.init", init, f"allowed: {', '.join(INITS)}")
    return init


@torch.no_grad()
def init_weights(net: nn.Module, init: str = "default") -> nn.Module:
    """Applies ``init`` to ``net`` in place (buffers such as BatchNorm statistics are left alone).

    Args:
        net: the freshly built model.
        init: ``default`` (leave as built) or ``zeros`` (every parameter 0).

    Returns:
        ``net``, for chaining.
    """
    if check_init(init) == "zeros":
        for p in net.parameters():
            p.zero_()
    return net
