"""docs/privacy.md's coverage table: for every ``algo=``, what its clients send beyond the model update and whether
``privacy=central`` / ``privacy=local`` run with it, generated from the parts' declarations (``PartTraits``) by the
composition rules (:mod:`flx.composition`).

    python scripts/privacy_coverage.py            # print the table
    python scripts/privacy_coverage.py --write    # rewrite it in docs/privacy.md (between its markers)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flx import composition
from flx.config import group_options, precheck
from flx.errors import instantiate

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "privacy.md"
BEGIN, END = "<!-- coverage: scripts/privacy_coverage.py -->", "<!-- /coverage -->"


def _compose(*overrides: str):  # noqa: ANN202
    return precheck([*overrides, "paths.output_dir=outputs/privacy_coverage"])  # composed only: nothing is written


def table() -> str:
    """The markdown table, one row per ``configs/algo/*.yaml``."""
    guards = [instantiate(_compose(f"privacy={mode}", "privacy.noise_multiplier=1.0").privacy) for mode in
              ("central", "local")]  # fmt: skip
    rows = ["| `algo=` | what clients send besides the model update | `privacy=central` | `privacy=local` |",
            "|---|---|---|---|"]  # fmt: skip
    for algo in group_options("algo"):
        cfg = _compose(f"algo={algo}")
        parts = [instantiate(p) for p in (cfg.algo.get("parts") or {}).values() if p is not None]
        cells = [composition.sends(parts), *(composition.verdict(parts, g) for g in guards)]
        rows.append(f"| {algo} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def block() -> str:
    return f"{BEGIN}\n{table()}\n{END}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/privacy.md")
    args = parser.parse_args()
    if not args.write:
        print(table())
        return
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"{DOC}: no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    DOC.write_text(head + block() + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
