"""Hydra entry point: ``python train.py algo=fedprox data=cifar10 model=resnet18 partition.alpha=0.1``."""

from __future__ import annotations

import sys

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from flx.config import CONFIG_DIR, one_line, precheck
from flx.errors import ConfigError


def _fail(err: ConfigError) -> None:
    print(f"flx: error: {err}", file=sys.stderr, flush=True)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> float | None:
    from flx.run import train  # after Hydra has parsed the command line: keeps `--help` fast

    try:
        metrics = train(cfg)
    except ConfigError as err:
        _fail(err)
    except (InstantiationException, OmegaConfBaseException) as err:  # a config value a target rejected
        _fail(ConfigError(one_line(err)))
    return metrics.get("test/acc")


if __name__ == "__main__":
    try:
        precheck(sys.argv[1:])
    except ConfigError as err:
        _fail(err)
    main()
