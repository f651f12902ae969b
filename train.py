"""Hydra entry point: ``python train.py algo=fedprox data=cifar10 model=resnet18 partition.alpha=0.1``."""

from __future__ import annotations

import errno
import os
import sys

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from flx.config import CONFIG_DIR, check_output_dir, one_line, precheck
from flx.errors import ConfigError

# errors of the file system under the run folder: reported as bad input (exit 2), files already written are kept
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.ENOTDIR)


def _fail(err: BaseException, status: int = 2) -> None:
    """One line on stderr (from the first process only: under DDP every rank fails alike) and ``status``."""
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or os.environ.get("LOCAL_RANK") or "0"
    if rank == "0":
        print(f"flx: error: {err}", file=sys.stderr, flush=True)
    sys.exit(status)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        check_output_dir(cfg.paths.output_dir)
        if cfg.state_store.backend == "disk":
            check_output_dir(cfg.state_store.dir, "state_store.dir")
    except ConfigError as err:
        _fail(err)
    from flx.faults import RunFailure
    from flx.run import train  # after Hydra has parsed the command line: keeps `--help` fast

    try:
        metrics = train(cfg)
    except ConfigError as err:
        _fail(err)
    except (InstantiationException, OmegaConfBaseException) as err:  # a config value a target rejected
        _fail(ConfigError(one_line(err)))
    except RunFailure as err:  # diverged, or a client fault with fault.policy=stop: not a result
        _fail(err, status=3)
    except OSError as err:
        if err.errno not in DISK_ERRORS:
            raise
        where = f" {err.filename}" if err.filename else ""
        _fail(
            ConfigError(
                f"cannot write{where}: {err.strerror}; files already written are kept (resume with "
                "ckpt_path=<run folder>/checkpoints/last.ckpt once there is room)"
            )
        )
    return metrics.get("test/acc")


if __name__ == "__main__":
    try:
        precheck(sys.argv[1:])
    except ConfigError as err:
        _fail(err)
    main()
