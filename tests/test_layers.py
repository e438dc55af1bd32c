"""The package's layers point only down (docs/architecture.md), read from the imports themselves.

Every module of flexfa/ is parsed (ast, nothing imported) and each import it makes, at the top,
inside a function or under `if TYPE_CHECKING:`, is an edge. Three rules:

- a module imports nothing from a layer above its own;
- the parts of one layer (its folders and top-level modules) import each other without a cycle;
- no module imports an underscore name (or module) from another folder.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flexfa"


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    parts: tuple[str, ...]  # dotted prefixes; a module belongs to the longest that names it


# Bottom first. A module no part names belongs to the front door (the package's root).
LAYERS = (
    Layer(
        "foundation",
        (
            "flexfa.config",
            "flexfa.version",
            "flexfa.layout",
            "flexfa.torch_options",
            "flexfa.masks",
            "flexfa.mods",
        ),
    ),
    Layer("runtime", ("flexfa.runtime",)),
    Layer("mod language", ("flexfa.ir", "flexfa.frontend")),
    Layer("plan", ("flexfa.blockmask", "flexfa.spec")),
    Layer("kernel generators", ("flexfa.codegen.triton", "flexfa.codegen.cute", "flexfa.codegen")),
    Layer("backends", ("flexfa.backends",)),
    Layer("front door", ("flexfa",)),
)


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # the module imported (or the module a name is taken from)
    name: str | None  # the name taken from `target`, if any
    line: int

    def __str__(self) -> str:
        what = self.target if self.name is None else f"{self.target}.{self.name}"
        return f"{self.importer} (line {self.line}) imports {what}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str) -> list[Import]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            found += [Import(module, a.name, None, node.lineno) for a in node.names]
        else:
            if node.level:
                base = module.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:
                    found.append(Import(module, sub, None, node.lineno))
                else:
                    found.append(Import(module, source, alias.name, node.lineno))
    return [i for i in found if i.target == "flexfa" or i.target.startswith("flexfa.")]


IMPORTS = [i for m in MODULES for i in _imports(m)]


def _part(module: str) -> str:
    prefixes = [p for layer in LAYERS for p in layer.parts]
    return max((p for p in prefixes if module == p or module.startswith(p + ".")), key=len)


def _layer(module: str) -> int:
    part = _part(module)
    return next(i for i, layer in enumerate(LAYERS) if part in layer.parts)


def _folder(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def test_the_import_reader_sees_the_package():
    assert "flexfa.api" in MODULES and "flexfa.blockmask.build" in MODULES
    assert any(
        i.importer == "flexfa.api" and i.target.startswith("flexfa.blockmask") for i in IMPORTS
    )
    # Imports inside functions count.
    assert any(i.importer == "flexfa.api" and i.target == "flexfa.runtime.launch" for i in IMPORTS)


def test_layers_point_down():
    upward = [
        f"{i}: {LAYERS[_layer(i.importer)].name} -> {LAYERS[_layer(i.target)].name}"
        for i in IMPORTS
        if i.target in MODULES or i.target == "flexfa"
        if _layer(i.target) > _layer(i.importer)
    ]
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _unit(module: str) -> str:
    """The part a module belongs to; in the front door, its top-level folder (or the root)."""
    part = _part(module)
    if part != "flexfa":
        return part
    head = ".".join(module.split(".")[:2])
    return head if head in MODULES and MODULES[head].name == "__init__.py" else "flexfa"


def test_no_cycle_between_parts():
    edges: dict[str, set[str]] = {}
    for i in IMPORTS:
        if i.target in MODULES and _unit(i.importer) != _unit(i.target):
            edges.setdefault(_unit(i.importer), set()).add(_unit(i.target))
    cycles = _cycles(edges)
    assert not cycles, "parts that import each other in a cycle: " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_the_rules_catch_what_they_name():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _private("_Static") and not _private("__version__") and not _private("Static")
    assert _layer("flexfa.codegen.triton.blockmask.fused") > _layer("flexfa.blockmask.build")
    assert _layer("flexfa.api") == len(LAYERS) - 1 and _layer("flexfa.runtime.launch") == 1


def test_no_private_names_across_folders():
    private = [
        str(i)
        for i in IMPORTS
        if (i.target in MODULES and _folder(i.importer) != _folder(i.target))
        and (
            (i.name is not None and _private(i.name))
            or any(_private(p) for p in i.target.split(".")[1:])
        )
    ]
    assert not private, "private names imported from another folder:\n" + "\n".join(private)


@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: layer.name)
def test_every_part_exists(layer):
    for part in layer.parts:
        assert part in MODULES, f"layer {layer.name!r} names {part}, which is not a module"
