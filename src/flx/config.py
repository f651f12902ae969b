"""Command-line composition: :func:`precheck` composes the command line with Hydra's compose API before the run
starts (unknown group options, unknown keys, unparsable overrides, the run folder), then runs the value checks of
:mod:`flx.checks` on the composed config; a wrong value stops with one line naming the key, the value and what is
allowed. No torch is imported.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flx.checks import check_experiments, check_files, check_partition, check_wandb, validate
from flx.errors import ConfigError, bad_value, one_line
from flx.launch import run_name, shared_run_name
from flx.resource_spec import SERVER_MODELS
from flx.resume import flatten

# the run folder's name (configs/hydra/default.yaml): the same on every task of a SLURM job step (flx.launch.run_name)
OmegaConf.register_new_resolver("flx_run_name", run_name, use_cache=True, replace=True)
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def group_options(group: str, config_dir: str = CONFIG_DIR) -> list[str]:
    """The options of a config group (yaml files of ``configs/<group>/``)."""
    folder = os.path.join(config_dir, group)
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml")) if os.path.isdir(folder) else []


def _check_groups(overrides: Sequence[str], config_dir: str) -> None:
    for ov in overrides:
        key, sep, value = ov.lstrip("+~").partition("=")
        if sep and "." not in key and os.path.isdir(os.path.join(config_dir, key)) and value not in ("null", ""):
            allowed = group_options(key, config_dir)
            for option in value.strip("[]").split(","):  # `logger=[csv,wandb]` selects several
                if option.strip() not in allowed:
                    raise bad_value(key, option.strip(), f"unknown option; allowed: {', '.join(allowed)}")


def precheck(overrides: Sequence[str], config_name: str = "train", config_dir: str = CONFIG_DIR) -> DictConfig | None:
    """Composes ``overrides`` as ``train.py`` will and validates; raises :class:`ConfigError` (one line) on failure.

    Returns the composed config without Hydra's node (what the run gets), or None when Hydra runs the command line
    itself (see :func:`compose_run`; e.g. ``-m``: jobs are validated as they start).
    """
    composed = _compose(overrides, config_name, config_dir, "train", check=True)
    return None if composed is None else composed[1]


def compose_run(
    overrides: Sequence[str],
    config_name: str = "train",
    config_dir: str = CONFIG_DIR,
    job_name: str = "train",
    check: bool = True,
) -> DictConfig | None:
    """The config of a single run of ``overrides`` as ``hydra.main`` composes it, Hydra's ``hydra`` node included
    (``hydra.mode=RUN``), and, with ``check``, validated as :func:`precheck` validates it (:class:`ConfigError`, one
    line). ``train.py`` runs it with :func:`flx.launch.run_composed`: the command line is composed once.

    None when Hydra runs the command line itself: Hydra flags (``-m``, ``--cfg``, ...; see :func:`precheck`), or a
    config that sets ``hydra.mode`` to MULTIRUN (a sweep without ``-m``).
    """
    composed = _compose(overrides, config_name, config_dir, job_name, check)
    return None if composed is None else composed[0]


def _compose(
    overrides: Sequence[str], config_name: str, config_dir: str, job_name: str, check: bool
) -> tuple[DictConfig, DictConfig | None] | None:
    """``(config with the hydra node, config without it)`` of a single run, validated with ``check`` (without
    ``check`` the second is None: nothing reads it); or None."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode
    from omegaconf import open_dict, read_write

    _check_launcher(overrides)
    if any(o.startswith("-") for o in overrides):
        # Hydra's own flags: -m sweeps (their values are checked per job, inside the run), --cfg/--info/--help
        # introspection, --config-name/-cp selecting another config: leave the command line to Hydra
        return None
    user = [o for o in overrides if not o.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))]
    if check:
        _check_groups(user, config_dir)
    try:
        OverridesParser.create().parse_overrides(list(overrides))
        with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name=job_name):
            cfg = compose(config_name, overrides=list(overrides), return_hydra_config=True)
    except Exception as e:  # Hydra's exceptions carry multi-line messages: fold them into one line
        _check_other_option(overrides, one_line(e), config_dir)
        override = getattr(e, "override", None)  # OverrideParseException: the override that did not parse
        where = f"cannot parse {override!r}; " if isinstance(override, str) else ""
        raise ConfigError(f"bad command line: {where}{one_line(e)}") from None
    if cfg.hydra.mode not in (None, RunMode.RUN):  # a sweep asked for by the config: Hydra's -m machinery runs it
        return None
    with read_write(cfg.hydra), open_dict(cfg.hydra):  # as hydra.main records a run
        cfg.hydra.mode = RunMode.RUN
        cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
    if not check:
        return cfg, None
    _check_nodes(cfg)
    task = copy.deepcopy(cfg)  # the run's config: without Hydra's node (as hydra.core.utils.run_job passes it)
    with open_dict(task):
        del task["hydra"]
    _validate(user, overrides, task, config_dir)
    return cfg, task


def _validate(user: Sequence[str], overrides: Sequence[str], cfg: DictConfig, config_dir: str) -> None:
    try:
        validate(cfg)
        check_partition(cfg)
    except OmegaConfBaseException as e:  # e.g. a broken interpolation, or partition.path=??? left unset
        raise ConfigError(f"{getattr(e, 'full_key', None) or 'config'}: {one_line(e)}") from None
    _check_added_keys(user, cfg, config_dir)
    check_partition(cfg)
    check_experiments(cfg, lambda name: _algo_alone(name, config_dir))
    check_files(cfg)
    check_wandb(cfg)
    _check_run_dir(overrides, cfg)


def _algo_alone(name: str, config_dir: str) -> DictConfig:
    """The ``algo`` node of ``algo=<name>`` with nothing else on the command line: the algorithm's defaults."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="train"):
        return compose("train", overrides=[f"algo={name}"]).algo


def _check_other_option(overrides: Sequence[str], message: str, config_dir: str) -> None:
    """``privacy.target_epsilon=8`` while ``privacy=none`` is chosen: Hydra suggests ``+privacy.target_epsilon=8``,
    which adds a key no one reads. The real fix is the option that has the key: this names it (``privacy=central``
    or ``privacy=local``, then the key). Returns quietly when the failure is of another kind."""
    match = re.search(r"Could not override '([^']+)'.*is not in struct", message, re.S)
    group = match.group(1).split(".", 1)[0] if match else ""
    if not match or not os.path.isdir(os.path.join(config_dir, group)):
        return
    key = match.group(1)
    having = [o for o in group_options(group, config_dir) if _option_has(group, o, key.split(".")[1:], config_dir)]
    if not having:
        return
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{group}=")] or [
        _default_option(group, config_dir)
    ]
    value = next((o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")), "")
    fix = f"choose one of them first, e.g. {group}={having[0]} {key}={value}"
    raise ConfigError(
        f"{key}={value}: not a key of {group}={chosen[-1]}; it is a key of {group}={', '.join(having)}: {fix}"
    )


def _default_option(group: str, config_dir: str) -> str:
    """The option of ``group`` that ``train.yaml``'s defaults choose (``none`` for ``privacy``)."""
    for entry in OmegaConf.load(os.path.join(config_dir, "train.yaml")).get("defaults", []):
        if OmegaConf.is_dict(entry) and group in entry:
            return str(entry[group])
    return "null"


def _option_has(group: str, option: str, path: list[str], config_dir: str) -> bool:
    """Whether the yaml of ``group=option``, or of an option of the same group it builds on (its ``defaults``),
    has the key ``path``."""
    node = OmegaConf.load(os.path.join(config_dir, group, f"{option}.yaml"))
    if OmegaConf.select(node, ".".join(path), default=None, throw_on_missing=False) is not None or (
        OmegaConf.is_dict(node) and _has_path(node, path)
    ):
        return True
    bases = (
        [d for d in node.get("defaults", []) if isinstance(d, str) and d != "_self_"] if OmegaConf.is_dict(node) else []
    )
    return any(_option_has(group, b, path, config_dir) for b in bases if b in group_options(group, config_dir))


def _has_path(node: DictConfig, path: list[str]) -> bool:
    for name in path:
        if not OmegaConf.is_dict(node) or name not in node:
            return False
        node = node._get_node(name)
    return True


def _check_nodes(cfg: DictConfig) -> None:
    """``trainer.num_nodes > 1``: every node writes into one run folder, so its name must not come from each node's
    clock (``hydra.run.dir``'s default), unless the launcher gives every process one name (``srun``, torchrun with a
    rendezvous id: :func:`flx.launch.shared_run_name`). A node in a folder of its own would not find the run's
    checkpoints, and ``ckpt_path=auto`` would resume rank zero alone."""
    nodes = cfg.trainer.get("num_nodes") or 1
    folder = OmegaConf.to_container(cfg.hydra.run, resolve=False).get("dir")
    if not isinstance(nodes, int) or nodes < 2 or "${now:" not in str(folder) or shared_run_name() is not None:
        return
    raise bad_value(
        "trainer.num_nodes",
        nodes,
        "every node must write into one run folder: give all nodes the same hydra.run.dir=<a folder they share> "
        "(srun, and torchrun with --rdzv-id=<job id>, name one themselves)",
    )


def _check_launcher(overrides: Sequence[str]) -> None:
    """``hydra/launcher=slurm`` submits with SLURM's ``sbatch``: without it submitit would fail with a traceback."""
    import shutil

    if "hydra/launcher=slurm" in overrides and shutil.which("sbatch") is None:
        raise bad_value("hydra/launcher", "slurm", "needs SLURM's sbatch on the PATH (run the sweep on a login node)")


def _check_run_dir(overrides: Sequence[str], cfg: DictConfig) -> None:
    """The run folder (``hydra.run.dir``, else under ``paths.log_dir``) must be named (not empty: the current folder)
    and creatable: Hydra creates it before the run starts, so a read-only or unwritable place is reported here, as one
    line.

    ``os.access`` is not asked: it says yes to root everywhere, also on ``/proc`` or a read-only mount. The nearest
    existing ancestor of the folder is probed instead (:func:`_probe_folder`), which leaves nothing behind."""
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
    log_dir = str(OmegaConf.select(cfg, "paths.log_dir"))
    key, path = ("hydra.run.dir", given[-1]) if given else ("paths.log_dir", log_dir)
    if given and not path:  # the current folder: a run would write (run.overwrite=true: move) a checkout's
        why = f"empty is the current folder ({os.getcwd()}), not a run folder"
        raise bad_value(key, path, f"{why}; name a folder of its own, or leave hydra.run.dir out for a new one")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    _check_path_length(key, path, existing)
    why = "is not a folder" if not os.path.isdir(existing) else _probe_folder(existing)
    if why:
        raise bad_value(key, path, f"cannot create the run folder there ({existing} {why}); choose another folder")


def _check_path_length(key: str, path: str, existing: str) -> None:
    """Every name in the run folder's path fits the file system's limit (``NAME_MAX``, 255 bytes on Linux) and the
    whole path its ``PATH_MAX`` (4096), with room for the files the run writes inside (:data:`ROOM`); else Hydra's
    ``mkdir`` fails with a traceback."""
    full = os.path.abspath(path)
    name_max, path_max = (
        _pathconf(existing, name, default) for name, default in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096))
    )
    longest = max(full.split(os.sep), key=lambda n: len(os.fsencode(n)))
    if len(os.fsencode(longest)) > name_max:
        why = f"a folder name of {len(os.fsencode(longest))} bytes, the file system takes at most {name_max}"
        raise bad_value(key, _short(path), f"{why}; choose a shorter name")
    if len(os.fsencode(full)) + ROOM > path_max:
        why = f"a path of {len(os.fsencode(full))} bytes, the file system takes {path_max} with the run's files inside"
        raise bad_value(key, _short(path), f"{why}; choose a shorter path")


ROOM = 256
"""Bytes kept free under the run folder's path for what the run writes inside it (``checkpoints/round_00001.ckpt``,
``.hydra/config.yaml``, ``csv/version_0/metrics.csv``)."""


def _pathconf(folder: str, name: str, default: int) -> int:
    try:
        return os.pathconf(folder, name)
    except (OSError, ValueError):  # not on this OS or file system
        return default


def _short(path: str) -> str:
    """A long path as the error line shows it: its start and end."""
    return path if len(path) <= 80 else f"{path[:40]}...{path[-30:]} ({len(path)} characters)"


def _probe_folder(folder: str) -> str | None:
    """Why nothing can be created in the existing ``folder`` (e.g. ``is not writable: Permission denied``), or None.

    Does what Hydra and the run will do there, once and undone: makes a folder, writes a file in it, removes both.
    """
    import tempfile

    try:
        probe = tempfile.mkdtemp(prefix=".flx-probe-", dir=folder)
    except OSError as e:
        return f"is not writable: {e.strerror}"
    try:
        with open(os.path.join(probe, "probe"), "wb") as f:
            f.write(b"flx")
    except OSError as e:
        return f"is not writable: {e.strerror}"
    finally:
        _remove_probe(probe)
    return None


def _remove_probe(probe: str) -> None:
    """Removes the probe folder of :func:`_probe_folder` and the file it may hold."""
    for remove, target in ((os.unlink, os.path.join(probe, "probe")), (os.rmdir, probe)):
        try:
            remove(target)
        except OSError:  # the file was never written; nothing else can stop removing what this process made
            pass


def _inside_target(cfg: DictConfig, key: str) -> bool:
    """Whether ``key`` lies in a node instantiated with ``_target_`` (whose class takes or rejects the key)."""
    parts = key.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        node = OmegaConf.select(cfg, ".".join(parts[:depth]), throw_on_missing=False)
        if OmegaConf.is_dict(node) and "_target_" in node:
            return True
    return parts[-1] == "_target_"


def _check_added_keys(overrides: Sequence[str], cfg: DictConfig, config_dir: str) -> None:
    """A key added with ``+key=value`` must be read by something: a ``_target_`` class or an interpolation.

    Otherwise (``+foo=1``, ``+algo.compositional=false`` when the part takes ``algo.parts.<part>.compositional``)
    it would be silently ignored; the error names the keys of the same name that are read.
    """
    text = str(OmegaConf.to_container(cfg, resolve=False))
    for ov in overrides:
        if not ov.startswith("+"):
            continue
        key, sep, value = ov.lstrip("+").partition("=")
        if not sep or "." not in key and os.path.isdir(os.path.join(config_dir, key)) or key.startswith("hydra"):
            continue  # a config group (+experiment=...), or Hydra's own settings
        if _inside_target(cfg, key) or "${" + key + "}" in text or key.startswith(SERVER_MODELS):
            continue
        leaf = key.rsplit(".", 1)[-1]
        same = [k for k in flatten(OmegaConf.to_container(cfg, resolve=False)) if k.endswith(f".{leaf}") and k != key]
        hint = f"; did you mean {' or '.join(same[:3])}?" if same else ""
        raise ConfigError(f"+{key}={value}: nothing reads {key}, so it would be ignored{hint}")
