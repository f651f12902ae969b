"""``flx-train``: the console entry point (``[project.scripts]``), the same command line as ``python train.py``.

``train.py`` is the composition root and lives at the root of the source checkout, next to ``configs/``; this entry
point runs that very file as ``__main__`` (its exit statuses, signal handling and start-up included), from any working
folder. It finds the checkout as :data:`flx.config.CONFIG_DIR` does, from this package's location, which holds for an
editable install (``pip install -e .``, what ``make`` does); an installed copy of the package alone has no checkout,
and the command stops with one line saying so (exit status 2).
"""

from __future__ import annotations

import os
import runpy
import sys

ENTRY = "train.py"


def checkout_root() -> str:
    """The source checkout this package runs from: ``<root>/src/flx/cli.py`` -> ``<root>`` (as ``CONFIG_DIR``)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def missing(root: str) -> str | None:
    """Why ``root`` is not a checkout ``flx-train`` can run (the one-line error), or None when it is."""
    checks = ((ENTRY, os.path.isfile), ("configs/", os.path.isdir))
    lacks = [name for name, ok in checks if not ok(os.path.join(root, name))]
    if not lacks:
        return None
    return (
        f"flx-train runs the {ENTRY} and configs/ of flx's source checkout, and {root} (the checkout of an editable "
        f"install) has no {' and no '.join(lacks)}: install flx from its checkout with `pip install -e <checkout>` "
        "(make train does), or run `python train.py` in the checkout"
    )


def main() -> None:
    """Runs ``<checkout>/train.py`` with this process's arguments, as ``python train.py`` would."""
    root = checkout_root()
    why = missing(root)
    if why is not None:
        print(f"flx: error: {why}", file=sys.stderr)
        sys.exit(2)
    script = os.path.join(root, ENTRY)
    sys.path.insert(0, root)  # as `python train.py` puts the script's folder first
    sys.argv[0] = script  # DDP ranks started by spawn re-run sys.argv[0]
    runpy.run_path(script, run_name="__main__")
