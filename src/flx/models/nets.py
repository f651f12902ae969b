"""Small from-scratch networks used as FL baselines: a linear model, logistic regression, MLP, the FedAvg CNN and a
character GRU.

Every constructor takes ``input_shape`` (the per-sample shape, e.g. ``(1, 28, 28)`` or ``(30,)``) and
``num_classes`` as keyword arguments, so each class can be a Hydra ``_target_`` with both values filled in at
instantiate time. Each model maps a float batch ``(B, *input_shape)`` to logits ``(B, num_classes)``; ``CharGRU``
takes an int64 batch of token ids ``(B, L)`` instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from flx.errors import ConfigError, bad_value

__all__ = ["CNN", "MLP", "CharGRU", "Linear", "LogisticRegression", "as_shape", "check_num_classes"]


def as_shape(input_shape: Sequence[Any]) -> tuple[int, ...]:
    """Normalises a per-sample shape given as a tuple, list or OmegaConf ``ListConfig``.

    Args:
        input_shape: per-sample shape, e.g. ``(1, 28, 28)``.

    Returns:
        The shape as a tuple of positive ints.

    Raises:
        ConfigError: if the shape is empty or has a non-positive dimension.
    """
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError):
        raise bad_value("input_shape", input_shape, "expected a sequence of positive ints") from None
    if not shape or any(s <= 0 for s in shape):
        raise bad_value("input_shape", shape, "expected a non-empty sequence of positive ints")
    return shape


def check_num_classes(num_classes: Any) -> int:
    """Returns ``num_classes`` as an int, raising ConfigError unless it is at least 1."""
    try:
        n = int(num_classes)
    except (TypeError, ValueError):
        raise bad_value("num_classes", num_classes, "expected an int >= 1") from None
    if n < 1:
        raise bad_value("num_classes", num_classes, "expected an int >= 1")
    return n


def _as_widths(key: str, widths: int | Sequence[Any], allow_empty: bool) -> tuple[int, ...]:
    """Normalises a layer-width option (an int or a sequence of ints) to a tuple of positive ints."""
    out = (int(widths),) if isinstance(widths, int) else tuple(int(w) for w in widths)
    if (not out and not allow_empty) or any(w <= 0 for w in out):
        what = "a sequence of positive ints" if allow_empty else "a non-empty sequence of positive ints"
        raise bad_value(key, out, f"expected {what}")
    return out


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: flatten, then one affine layer.

    Args:
        input_shape: per-sample shape; it is flattened to ``prod(input_shape)`` features.
        num_classes: number of output logits.
    """

    rowwise = True  # forward chains row-wise layers: algo.vectorize folds the cohort into the batch

    def __init__(self, *, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.input_shape = as_shape(input_shape)
        self.num_classes = check_num_classes(num_classes)
        self.flatten = nn.Flatten(start_dim=1)
        self.linear = nn.Linear(math.prod(self.input_shape), self.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``(B, *input_shape)`` to logits ``(B, num_classes)``."""
        return self.linear(self.flatten(x))  # (B, D) -> (B, K)


class Linear(nn.Module):
    r"""A linear model :math:`\hat y = W \mathrm{vec}(x) + b`: flatten (row-major), one ``nn.Linear``, optional bias.

    The regression model of pFedFBE's Lasso and matrix completion (``model=linear``): with one output the weight
    ``linear.weight`` ``(1, D)`` is :math:`w`, and for ``(32, 32)`` inputs ``linear.weight.view(32, 32)`` is the matrix
    :math:`W` of :math:`\langle W, X \rangle`; ``linear.bias`` is the unregularised :math:`b`.

    Args:
        input_shape: per-sample shape; it is flattened to ``D = prod(input_shape)`` features.
        num_classes: number of outputs ``K`` (regression: one per target column).
        bias: whether the model has the intercept :math:`b`.
    """

    rowwise = True  # forward chains row-wise layers: algo.vectorize folds the cohort into the batch

    def __init__(self, *, input_shape: Sequence[int], num_classes: int, bias: bool = True) -> None:
        super().__init__()
        self.input_shape = as_shape(input_shape)
        self.num_classes = check_num_classes(num_classes)
        if not isinstance(bias, bool):
            raise bad_value("model.bias", bias, "expected true or false")
        self.flatten = nn.Flatten(start_dim=1)
        self.linear = nn.Linear(math.prod(self.input_shape), self.num_classes, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``(B, *input_shape)`` to ``(B, num_classes)``."""
        return self.linear(self.flatten(x))  # (B, D) -> (B, K)


class MLP(nn.Module):
    """Fully connected network: flatten, ``Linear (+ BatchNorm1d) + ReLU (+ Dropout)`` per hidden layer, linear head.

    Args:
        input_shape: per-sample shape; it is flattened to ``prod(input_shape)`` features.
        num_classes: number of output logits.
        hidden: widths of the hidden layers (an empty sequence gives logistic regression).
        dropout: dropout probability after each hidden ReLU, in ``[0, 1)``; 0 adds no dropout layer.
        batch_norm: a ``BatchNorm1d`` between each hidden ``Linear`` and its ReLU (FedBN's nets: Li et al., ICLR 2021,
            put one after every hidden layer); False keeps the net free of batch statistics.

    Attributes:
        feat_dim: width of :meth:`features`: the last hidden width (``prod(input_shape)`` without hidden layers).
    """

    rowwise = True  # forward chains row-wise layers: algo.vectorize folds the cohort into the batch

    def __init__(
        self,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        hidden: int | Sequence[int] = (200, 200),
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.input_shape = as_shape(input_shape)
        self.num_classes = check_num_classes(num_classes)
        widths = _as_widths("model.hidden", hidden, allow_empty=True)
        if not isinstance(batch_norm, bool):
            raise bad_value("model.batch_norm", batch_norm, "expected true or false")
        dropout = float(dropout)
        if not 0.0 <= dropout < 1.0:
            raise bad_value("model.dropout", dropout, "expected a probability in [0, 1)")

        layers: list[nn.Module] = [nn.Flatten(start_dim=1)]
        in_features = math.prod(self.input_shape)
        for width in widths:
            layers.append(nn.Linear(in_features, width))
            if batch_norm:  # (B, width) normalised over the batch
                layers.append(nn.BatchNorm1d(width))
            layers.append(nn.ReLU(inplace=True))
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            in_features = width
        layers.append(nn.Linear(in_features, self.num_classes))
        self.net = nn.Sequential(*layers)
        self.feat_dim = in_features

    @property
    def head(self) -> nn.Linear:
        """The last ``Linear(feat_dim -> num_classes)`` (a view of ``net[-1]``: no new state_dict key)."""
        return self.net[-1]

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The penultimate features ``(B, feat_dim)``: the last hidden layer's activations (after its dropout), or
        the flattened input without hidden layers; ``forward(x) == head(features(x))``."""
        return self.net[:-1](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``(B, *input_shape)`` to logits ``(B, num_classes)``."""
        return self.net(x)


class CNN(nn.Module):
    """The small CNN of the FedAvg paper (McMahan et al., 2017), generalised to any image size.

    Each entry of ``channels`` adds a block ``Conv5x5(padding=2) + ReLU + MaxPool2``; the 5x5 convolution
    keeps the spatial size and the pooling halves it (rounding down). The features are flattened and fed to
    ``Linear(-> hidden) + ReLU`` and a linear head. With the defaults and a ``(1, 28, 28)`` input this is the
    FedAvg MNIST CNN: 28x28 -> 14x14 -> 7x7, flatten size ``64 * 7 * 7``.

    Args:
        input_shape: per-sample image shape ``(C, H, W)``.
        num_classes: number of output logits.
        channels: output channels of the convolution blocks.
        hidden: width of the fully connected layer before the head.

    Attributes:
        features: the convolution blocks, ``(B, C, H, W) -> (B, C', H', W')`` (a submodule: its name is in the
            state_dict keys, ``features.0.weight``, so the penultimate features are :meth:`pre_logits`).
        feat_dim: width of :meth:`pre_logits`, ``hidden``.

    Raises:
        ConfigError: if the input is not an image, or is too small for the number of pooling steps.
    """

    def __init__(
        self,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        channels: int | Sequence[int] = (32, 64),
        hidden: int = 512,
    ) -> None:
        super().__init__()
        self.input_shape = as_shape(input_shape)
        self.num_classes = check_num_classes(num_classes)
        if len(self.input_shape) != 3:
            raise ConfigError(f"model=cnn needs image inputs (C, H, W); got input_shape={self.input_shape}")
        widths = _as_widths("model.channels", channels, allow_empty=False)
        hidden = int(hidden)
        if hidden <= 0:
            raise bad_value("model.hidden", hidden, "expected a positive int")

        self.flatten_size = self.flat_features(self.input_shape, widths)
        blocks: list[nn.Module] = []
        in_ch = self.input_shape[0]
        for out_ch in widths:
            # (B, in_ch, h, w) -> (B, out_ch, h // 2, w // 2)
            blocks += [nn.Conv2d(in_ch, out_ch, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            in_ch = out_ch
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(
            nn.Flatten(start_dim=1),  # (B, C', H', W') -> (B, C' * H' * W')
            nn.Linear(self.flatten_size, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, self.num_classes),  # (B, hidden) -> (B, K)
        )
        self.feat_dim = hidden

    @property
    def head(self) -> nn.Linear:
        """The last ``Linear(hidden -> num_classes)`` (a view of ``classifier[-1]``: no new state_dict key)."""
        return self.classifier[-1]

    def pre_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The penultimate features ``(B, hidden)``, after the hidden layer's ReLU.

        ``forward(x) == head(pre_logits(x))``.
        """
        return self.classifier[:-1](self.features(x))

    @staticmethod
    def flat_features(input_shape: tuple[int, ...], channels: tuple[int, ...]) -> int:
        """Returns the flattened feature size ``channels[-1] * H' * W'`` after all conv blocks.

        Raises:
            ConfigError: if a pooling step would shrink a spatial side to zero.
        """
        _, h, w = input_shape
        for _ in channels:
            h, w = h // 2, w // 2
        if h < 1 or w < 1:
            raise bad_value(
                "input_shape",
                input_shape,
                f"model=cnn with {len(channels)} pooling steps needs H and W >= {2 ** len(channels)}",
            )
        return channels[-1] * h * w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``(B, C, H, W)`` to logits ``(B, num_classes)``."""
        return self.classifier(self.features(x))


class CharGRU(nn.Module):
    """Next-token RNN: embedding, GRU, linear head on the last hidden state.

    The DRFA paper's Shakespeare model (Deng et al., NeurIPS 2020, Section 6): an embedding of the characters into
    50 dimensions, one GRU layer with 50 units and a fully connected layer back to the vocabulary, trained with
    cross-entropy on the next character. Parameters: ``V E`` (embedding) ``+ 3 H (E + H) + 6 H`` (first GRU layer,
    gates r, z, n with input and hidden biases; each further layer ``3 H (2 H) + 6 H``) ``+ H C + C`` (head).

    Args:
        input_shape: per-sample shape ``(L,)``: a sequence of ``L`` token ids.
        num_classes: number of output logits ``C`` (the vocabulary of the predicted token).
        vocab_size: number of input token ids ``V``; ``None`` uses ``num_classes``.
        embed_dim: embedding width ``E``.
        hidden: GRU units ``H``.
        num_layers: stacked GRU layers.

    Raises:
        ConfigError: if the input is not a 1-D sequence or a width is not a positive int.
    """

    def __init__(
        self,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        vocab_size: int | None = None,
        embed_dim: int = 50,
        hidden: int = 50,
        num_layers: int = 1,
    ) -> None:
        super().__init__()
        self.input_shape = as_shape(input_shape)
        self.num_classes = check_num_classes(num_classes)
        if len(self.input_shape) != 1:
            raise ConfigError(f"model=gru needs token sequences (L,); got input_shape={self.input_shape}")
        vocab = self.num_classes if vocab_size is None else _as_widths("model.vocab_size", vocab_size, False)[0]
        embed_dim = _as_widths("model.embed_dim", embed_dim, allow_empty=False)[0]
        hidden = _as_widths("model.hidden", hidden, allow_empty=False)[0]
        num_layers = _as_widths("model.num_layers", num_layers, allow_empty=False)[0]
        self.embed = nn.Embedding(vocab, embed_dim)
        self.gru = nn.GRU(embed_dim, hidden, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden, self.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps token ids ``(B, L)`` (int64) to logits ``(B, num_classes)`` for the token after the sequence."""
        if x.is_floating_point():
            raise ConfigError(f"model=gru needs integer token ids (e.g. data=shakespeare), got {x.dtype} inputs")
        out, _ = self.gru(self.embed(x))  # (B, L) -> (B, L, E) -> (B, L, H); the hidden state starts at zero
        return self.head(out[:, -1])  # (B, H) -> (B, C)
