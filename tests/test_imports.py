"""The import graph of ``flx``: the core never imports a part, and no two modules import each other in a circle, not
even for annotations; nor do any two Python files of the repository (scripts, benchmarks, tests, ``train.py``).

Parts are the modules of ``flx.parts``; everything else is the core (the process callbacks of ``flx.callbacks``
too). Imports under ``if TYPE_CHECKING:`` are annotations only: the run-time graph leaves them out, the whole graph
(``annotations=True``) counts them too. Parts name the federation by its door, :class:`flx.context.FederationView`,
so neither graph has a circle.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _module(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, package: str, annotations: bool = False) -> set[str]:
    """``flx`` modules imported anywhere in ``tree``, outside ``if TYPE_CHECKING:`` blocks unless ``annotations``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not annotations and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flx"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base.startswith("flx"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)  # `from flx import autodiff` names a module
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(annotations: bool = False) -> dict[str, set[str]]:
    files = {_module(p): p for p in sorted((SRC / "flx").rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = _imports(ast.parse(path.read_text()), package, annotations)
        graph[name] = {m for m in imported if m in files and m != name}
    return graph


def test_the_core_never_imports_a_part() -> None:
    graph = import_graph()
    arrows = [
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if not a.startswith("flx.parts") and b.startswith("flx.parts")
    ]
    assert not arrows, f"core -> part imports: {arrows}"


def _circle(graph: dict) -> list | None:
    """One import circle of ``graph`` (its nodes, the first repeated at the end), or None."""
    state: dict = {}  # 1: on the current path, 2: done
    path: list = []

    def visit(node: object) -> list | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    return next((found for node in sorted(graph) if node not in state and (found := visit(node))), None)


@pytest.mark.parametrize("annotations", [False, True], ids=["run-time", "with-annotations"])
def test_no_import_circle(annotations: bool) -> None:
    circle = _circle(import_graph(annotations))
    assert circle is None, "import circle: " + " -> ".join(circle or [])


REPO = SRC.parent
NOT_SOURCE = ("bench_results", "data", "logs", "multirun", "outputs", "wandb")  # run outputs at the top (.gitignore)


def repo_files() -> list[Path]:
    """Every Python file of the repository, outside hidden folders (the virtual environment) and run outputs."""
    found = []
    for folder, dirs, names in os.walk(REPO):
        top = Path(folder) == REPO
        dirs[:] = sorted(d for d in dirs if not (d.startswith(".") or d == "__pycache__" or top and d in NOT_SOURCE))
        found += [Path(folder, n) for n in sorted(names) if n.endswith(".py")]
    return found


def _find(root: Path, dotted: str) -> Path | None:
    base = root.joinpath(*dotted.split("."))
    return next((p for p in (base.with_name(base.name + ".py"), base / "__init__.py") if p.is_file()), None)


def repo_import_graph() -> dict[Path, set[Path]]:
    """File -> the repository's files it imports, anywhere in it (in functions, under ``TYPE_CHECKING``).

    A name resolves as a script that runs from its own folder finds it: its own folder, then ``src/``, then the
    repository's root; else every folder that scripts and tests put on ``sys.path`` (one with Python files and no
    ``__init__.py``: ``scripts/bench``, ``tests/parts``, ...) where the name exists, each one counted.
    """
    files = repo_files()
    roots = sorted({p.parent for p in files if not (p.parent / "__init__.py").is_file()})
    graph: dict[Path, set[Path]] = {}
    for path in files:
        names: list[tuple[int, str]] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names += [(0, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                names += [(node.level, mod), *((node.level, f"{mod}.{a.name}".lstrip(".")) for a in node.names)]
        found: set[Path] = set()
        for level, dotted in names:
            if not dotted:
                continue
            first = [path.parents[level - 1]] if level else [path.parent, SRC, REPO]
            hit = next(filter(None, (_find(r, dotted) for r in first)), None)
            found |= {hit} if hit or level else {t for r in roots if (t := _find(r, dotted))}
        graph[path] = found & set(files) - {path, None}
    return graph


def test_no_import_circle_in_the_repository() -> None:
    graph = repo_import_graph()
    scripts = REPO / "scripts"
    assert {scripts / "gpu_check_common.py", scripts / "gpu_check_speed.py"} <= graph[scripts / "gpu_check.py"]
    assert REPO / "scripts/bench/harness.py" in graph[REPO / "scripts/gpu_check_speed.py"]
    assert REPO / "tests/helpers.py" in graph[REPO / "tests/parts/least_squares.py"]
    assert REPO / "src/flx/hooks.py" in graph[REPO / "src/flx/federation.py"]
    circle = _circle(graph)
    assert circle is None, "import circle: " + " -> ".join(str(p.relative_to(REPO)) for p in circle or [])


FLOORS = (
    # 0: tools and maths that know no round
    "flx errors choices console determinism threads resume resource_spec checkpoint_spec server state systems sampling"
    " local_sgd autodiff simplex regularizers losses metrics aggregation checkpoint_io wandb_files wandb_logging launch"
    " signals run_folder loggers privacy clipping",
    # 1: data, models, tasks, and the types of the round protocol
    "models datamodules task_spec tasks resources context traits",
    # 2: the round's pieces, and the parts that plug into them
    "hooks composition faults round_buffer probe services evaluation clients vectorized parts",
    # 3: the orchestrator
    "federation",
    # 4: Lightning: the loop, the module, the process callbacks
    "loop module module_eval module_logging callbacks",
    # 5: composition: the pre-run check, the composition root, the command line
    "config checks run cli",
)
"""docs/architecture.md, "The floors": a module imports only from its own floor or below (a package: all its modules
on one floor)."""


def floor_of(module: str) -> int:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "flx"
    for level, names in enumerate(FLOORS):
        if name in names.split():
            return level
    raise AssertionError(f"{module}: on no floor of tests/test_imports.py FLOORS")


def test_no_import_runs_up_a_floor() -> None:
    graph = import_graph()
    up = sorted((a, b) for a, targets in graph.items() for b in targets if floor_of(b) > floor_of(a))
    assert not up, f"imports that run up a floor at run time: {up}"


def test_the_graph_sees_known_arrows() -> None:
    """The parser finds the imports it must (a guard against a test that passes by seeing nothing)."""
    graph = import_graph()
    assert {"flx.hooks", "flx.aggregation", "flx.services"} <= graph["flx.federation"]
    assert "flx.probe" in graph["flx.services"]
    assert "flx.hooks" in graph["flx.parts.proximal.prox"]
    assert "flx.parts.systems.whale_utility" in graph["flx.parts.systems.subnetwork"]  # within a family's subpackage
    assert "flx.federation" not in graph["flx.hooks"]
    assert "flx.federation" in import_graph(annotations=True)["flx.loop"]  # only for annotations
    assert "flx.federation" not in graph["flx.loop"]
    prox = floor_of("flx.parts.proximal.prox")
    assert prox == 2 < floor_of("flx.federation") < floor_of("flx.module") < floor_of("flx.run")
