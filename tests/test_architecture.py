"""The layout of `distill/` keeps one direction: commands -> train -> report -> sample -> data ->
models -> config -> ops (toy beside sample, read only by report). See docs/architecture.md.

Imports are read with `ast`, including those inside functions: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "distill"

# subpackage -> the subpackages its modules may import (besides their own)
MAY_IMPORT: dict[str, set[str]] = {
    "ops": set(),
    "config": {"ops"},
    "models": {"ops", "config"},
    "data": {"ops", "config", "models"},
    "sample": {"ops", "config", "models", "data"},
    "toy": {"ops", "models"},
    "report": {"ops", "config", "models", "data", "sample", "toy"},
    "train": {"ops", "config", "models", "data", "sample", "report"},
}
# Command modules (`python -m ...`): thin entry points that may import anything and that no library
# module imports.
COMMANDS = {
    "distill.__main__",
    "distill.bench",
    "distill.demo",
    "distill.doctor",
    "distill.evaluate",
    "distill.generate",
    "distill.gpu_check",
    "distill.stress",
    "distill.toy.stage_one",
    "distill.toy.i2v_students",
    "distill.toy.i2v_ship",
    "distill.toy.t2v_ship",
    "distill.toy.t2v_students",
    "distill.toy.user_lora",
    "distill.toy.user_table",
    "distill.toy.proofs",
    "distill.toy.causal_students",
    "distill.toy.causal_ship",
    "distill.toy.chained_judge",
    "distill.toy.shipping",  # what the ship commands share; only they import it
}
# The package itself, which every `python -m distill...` command imports first, checks the
# requirements there (distill/ops/requirements.py): the bottom layer only.
ROOT_MAY_IMPORT = {"ops"}
MAX_LINES = 500
LONG_MODULE_REASON = "Longer than 500 lines because"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The distill modules `path` imports (`from distill.x import y` counts y when y is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("distill."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("distill"):
                continue
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in known else node.module)
    return {name for name in found if name in known and name != "distill"}


def import_graph() -> dict[str, set[str]]:
    known = set(modules())
    return {name: imports_of(path, known) for name, path in modules().items()}


def command_of(name: str) -> str | None:
    return next((c for c in COMMANDS if name == c or name.startswith(c + ".")), None)


def subpackage(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in MAY_IMPORT) else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_there_are_no_import_circles() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_import_goes_down_the_layers() -> None:
    wrong = []
    for name, deps in import_graph().items():
        if command_of(name):
            continue
        home = subpackage(name)
        for dep in deps:
            if name == "distill" and subpackage(dep) in ROOT_MAY_IMPORT:
                continue
            if command_of(dep):
                wrong.append(f"{name} imports the command module {dep}")
                continue
            there = subpackage(dep)
            if home is None or there is None:
                wrong.append(f"{name} -> {dep}: every library module belongs to a subpackage")
            elif there != home and there not in MAY_IMPORT[home]:
                wrong.append(f"{name} ({home}) imports {dep} ({there})")
    assert wrong == []


def test_every_module_is_placed() -> None:
    loose = [
        name for name in modules() if not command_of(name) and name != "distill" and not subpackage(name)
    ]
    assert loose == []


def test_every_subpackage_says_what_lives_there() -> None:
    for package in MAY_IMPORT:
        doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text())) or ""
        assert len(doc.split()) >= 20, f"distill/{package}/__init__.py needs a docstring paragraph"


def test_long_modules_say_why() -> None:
    unexplained = []
    for name, path in modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_LINES and LONG_MODULE_REASON not in text[:3000]:
            unexplained.append(f"{name}: {text.count(chr(10))} lines")
    assert unexplained == []
