"""The one exception type that reaches the user as a single line.

Anything the user can get wrong (a config value, a missing dataset, a bad checkpoint) raises
:class:`ConfigError` with a message that names the key, the value and what is allowed.
``train.py`` prints it as one line and exits with status 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A user-facing error: one line, what key, what value, what is allowed."""


def bad_value(key: str, value: Any, allowed: str) -> ConfigError:
    """Builds the standard message ``key=value: allowed``."""
    return ConfigError(f"{key}={value!r}: {allowed}")


BINARY_DATA = "data=digits_binary, breast_cancer, cifar10_binary, cifar100_binary, chestmnist or adult"


def not_binary(algo: str, classes: int) -> ConfigError:
    """The one-line error of an AUC / X-risk algorithm given a task of ``classes`` classes."""
    return ConfigError(
        f"data: {algo} needs a binary task (labels 0/1), the data has {classes} classes: use {BINARY_DATA}"
    )


def existing_file(key: str, path: Any) -> Path:
    """The file ``path`` (``~`` expanded), or a one-line error ``key=path: no such file (looked at <absolute>)``."""
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise bad_value(key, path, f"no such file (looked at {file.resolve()})")
    return file


def instantiate(cfg: Any, **kwargs: Any) -> Any:
    """Hydra's ``instantiate``, with a :class:`ConfigError` raised by the target passed through unwrapped (one line)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    try:
        return hydra_instantiate(cfg, **kwargs)
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise


_NOISE = ("full_key:", "object_type=", "Set the environment variable HYDRA_FULL_ERROR")


def _lines(e: BaseException | None) -> list[str]:
    """The informative lines of an exception's message, without Hydra/OmegaConf location and debugging hints."""
    lines = []
    for line in ("" if e is None else str(e)).splitlines():
        line = line.split(", set env var HYDRA_FULL_ERROR")[0].strip().rstrip(".:")
        if line and not line.startswith(_NOISE):
            lines.append(line)
    return lines


def one_line(e: BaseException) -> str:
    """Folds a (Hydra) exception and its cause into one line, e.g.
    ``Could not override 'algo.lrr'; Key 'lrr' is not in struct; To append to your config use +algo.lrr=0.1``."""
    lines = _lines(e) or [type(e).__name__]
    cause = [c for c in _lines(e.__cause__) if not any(c in line for line in lines)]
    return "; ".join(lines[:1] + cause + lines[1:])
