"""The package's modules import one another in one direction: no circle, lazy imports (inside a
function, or under ``TYPE_CHECKING``) included, since a lazy import is how a circle hides."""

from __future__ import annotations

import ast
import graphlib
import pathlib

import omniprefix

PACKAGE = pathlib.Path(omniprefix.__file__).parent


def package_imports(source: str, modules: set[str]) -> set[str]:
    """The package's modules that ``source`` imports, by name (``from .x import``, ``from . import x``,
    ``from omniprefix.x import``, ``import omniprefix.x``), wherever the import stands."""
    named: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            named.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("omniprefix."):
            named.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            named.update(a.name.split(".")[1] for a in node.names if a.name.startswith("omniprefix."))
    return named & modules


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    modules = {path.stem for path in package.glob("*.py")} - {"__init__"}
    return {m: package_imports((package / f"{m}.py").read_text(), modules) - {m} for m in modules}


def test_the_package_has_no_import_circle():
    graph = import_graph(PACKAGE)
    assert {"fleet", "edge", "speech_route", "router_weights"} <= graph.keys()
    assert "edge" in graph["fleet"]  # the graph is read, not empty
    graphlib.TopologicalSorter(graph).prepare()  # CycleError names the circle


def test_a_lazy_import_that_closes_a_circle_is_found():
    modules = {"a", "b"}
    lazy = "def f():\n    from .a import x\n"
    assert package_imports(lazy, modules) == {"a"}
    graph = {"a": {"b"}, "b": package_imports(lazy, modules)}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError:
        return
    raise AssertionError("a -> b -> a was not reported")
