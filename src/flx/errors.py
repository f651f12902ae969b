"""The one exception type that reaches the user as a single line.

Anything the user can get wrong (a config value, a missing dataset, a bad checkpoint) raises
:class:`ConfigError` with a message that names the key, the value and what is allowed.
``train.py`` prints it as one line and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A user-facing error: one line, what key, what value, what is allowed."""


def bad_value(key: str, value: Any, allowed: str) -> ConfigError:
    """Builds the standard message ``key=value: allowed`` (``key=nan: not a number; allowed`` for a NaN)."""
    nan = isinstance(value, float) and math.isnan(value) and not allowed.startswith("not a number")
    return ConfigError(f"{key}={value!r}: {'not a number; ' if nan else ''}{allowed}")


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


MAX_LOOP = 10**6
"""The most rounds, local steps or inner steps a key may ask for (``algo.rounds``, ``algo.local_steps``, pFedMe's
``algo.inner_steps``, ...): at a millisecond each 10^6 take 17 minutes, at a second 11 days; a larger value is a typo
that would run for ever without a word."""
LOOP_WHY = " (a larger value would run for days: a typo, not a plan)"


def count(key: str, value: Any, low: int, high: int = MAX_LOOP) -> None:
    """Raises one line unless ``value`` is an integer in ``[low, high]`` (a count of rounds, steps or samples)."""
    err = number_error(key, value, integer=True)
    if err is None and not low <= value <= high:
        err = bad_value(key, value, f"must be an integer >= {low} and <= {high}{LOOP_WHY if high == MAX_LOOP else ''}")
    if err is not None:
        raise err


MAX_INT = 2**31 - 1
"""The largest integer a part's integer key takes (int32: what every index and size type accepts)."""


def number_error(key: str, value: Any, integer: bool = False) -> ConfigError | None:
    """Why ``value`` cannot be ``key``'s number (a finite real, or with ``integer`` an integer), or None if it can.

    Booleans are not numbers here (``true`` where a number goes is a slip, not 1); NaN says so by name."""
    kind = "an integer" if integer else "a finite number"
    if isinstance(value, float) and math.isnan(value):
        return bad_value(key, value, f"not a number; must be {kind}")
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return bad_value(key, value, f"must be {kind}")
    if not integer and not math.isfinite(value):
        return bad_value(key, value, f"must be {kind}")
    if integer and abs(value) > MAX_INT:
        return bad_value(key, value, f"must be an integer of at most {MAX_INT} in size (int32)")
    return None


def check_fields(params: Any, prefix: str, keys: dict[str, str] | None = None) -> None:
    """The values of a frozen params dataclass are of their annotated types, before any range check compares them:
    ``bool`` fields hold booleans (``"no"`` is not false), ``int`` fields integers, ``float`` fields finite numbers,
    ``... | None`` also null. Raises one line naming the user's key: ``prefix + field``, or ``keys[field]``.

    Fields of other types (strings with their own allowed values, lists, mappings) are left to the part's checks."""
    for field in dataclasses.fields(params):
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        kinds = {t.strip() for t in kind.split("|")}
        value, key = getattr(params, field.name), (keys or {}).get(field.name, prefix + field.name)
        if value is None and "None" in kinds:
            continue
        if "bool" in kinds and not isinstance(value, bool):
            raise bad_value(key, value, "allowed: true, false")
        if kinds & {"int", "float"}:
            err = number_error(key, value, integer="float" not in kinds)
            if err is not None:
                raise ConfigError(f"{err}, or null" if "None" in kinds else str(err))
