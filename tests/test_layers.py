"""The import rules of docs/design.md, read from the source: imports point down the table of layers, no two
modules import each other (directly or around a circle, inside a room too), only the runtime and validate's
worker import llama.cpp, nothing outside the CLI imports it, and no command module imports another."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "slotctl"

#: docs/design.md's table, top to bottom: a unit may import units below it (or its own modules) only
LAYERS = [
    {"__main__"},
    {"cli"},
    {"serve", "fleet"},
    {"unattended"},
    {"keeping"},
    {"prune"},
    {"catalog"},
    {"live"},
    {"validate", "identify"},
    {"runtime"},
    {"store"},
    {"describe", "strip", "convert", "diff"},
    {"tensors", "inputs", "rewrite"},
    {"server"},
    {"model", "slotfile"},
    {"format"},
    {"sources", "seal"},
    {"atomic", "paths", "progress", "tinymodels", "sample"},
    {"errors"},
]
RANK = {u: i for i, layer in enumerate(LAYERS) for u in layer}


def _modules():
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        yield name, ast.parse(p.read_text())


def _imports(tree) -> set[str]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module)
            out |= {f"{n.module}.{a.name}" for a in n.names}
    return out


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "slotctl" and len(parts) > 1 else None


def _registers_commands(tree) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == "register" for n in tree.body)


def test_every_unit_has_a_place_in_the_table():
    units = {_unit(name) for name, _ in _modules()} - {None}
    assert units <= set(RANK), f"add to docs/design.md and LAYERS: {sorted(units - set(RANK))}"


def test_imports_point_down():
    up = []
    for name, tree in _modules():
        u = _unit(name)
        for imported in _imports(tree):
            v = _unit(imported)
            if u and v and v != u and v in RANK and RANK[v] <= RANK[u]:
                up.append(f"{name} imports {imported}")
    assert not up, "\n".join(sorted(set(up)))


def _module_graph(mods: dict) -> dict[str, set[str]]:
    """module -> the slotctl modules it imports, anywhere in it (inside a function, under TYPE_CHECKING: a
    lazy import is still an import). ``from a.b import c`` is an edge to ``a.b.c`` when that is a module,
    else to ``a.b``; a package's ``__init__`` run on the way to a submodule is Python's, not an edge."""
    graph = {}
    for name, tree in mods.items():
        out = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                out |= {a.name for a in n.names if a.name in mods}
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                for a in n.names:
                    full = f"{n.module}.{a.name}"
                    if full in mods:
                        out.add(full)
                    elif n.module in mods:
                        out.add(n.module)
        graph[name] = out - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that reach each other through their imports (strongly connected components of
    more than one module, Tarjan's algorithm), each sorted; none when imports point one way only."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_circle_between_modules():
    """No slotctl module reaches itself through imports, lazy ones included: within a room too (a layer of
    the table orders packages, this orders modules), so that every module can be read, and imported, above
    the ones it uses."""
    found = circles(_module_graph(dict(_modules())))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)
    # the check itself: a circle of two, one of three through a lazy import, and a line that is none
    mods = {n: ast.parse(src) for n, src in {
        "slotctl.a": "from slotctl import b\n",
        "slotctl.b": "def f():\n    import slotctl.a\n",
        "slotctl.c": "from slotctl.d import x\n",
        "slotctl.d": "from slotctl.e import y\n",
        "slotctl.e": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from slotctl.c import z\n",
        "slotctl.f": "import slotctl.g\n",
        "slotctl.g": "import slotctl.errors\n",
    }.items()}
    assert circles(_module_graph(mods)) == [["slotctl.a", "slotctl.b"], ["slotctl.c", "slotctl.d", "slotctl.e"]]


#: slotctl.keeping's modules, top to bottom (docs/design.md): the one object per server and store over its parts,
#: each part with one reason to change and none importing another, over the records and steps they share
KEEPING = [
    {"states"},
    {"identity", "judging", "placing", "storing", "housekeeping"},
    {"judged"},
    {"conversion"},
    {"store"},
    {"names"},
]


def test_keepings_modules_import_down_their_order():
    """Inside slotctl.keeping a module imports only the ones below it in :data:`KEEPING` (lazy imports too):
    ``states`` composes the parts, and no part reaches into another."""
    rank = {f"slotctl.keeping.{m}": i for i, row in enumerate(KEEPING) for m in row}
    mods = dict(_modules())
    here = {n for n in mods if n.startswith("slotctl.keeping.")}
    assert here == set(rank), f"add to KEEPING and docs/design.md: {sorted(here ^ set(rank))}"
    graph = _module_graph(mods)
    up = [f"{m} imports {o}" for m in sorted(here) for o in sorted(graph[m]) if o in rank and rank[o] <= rank[m]]
    assert not up, "\n".join(up)


def test_only_the_runtime_and_validates_worker_run_llama_cpp():
    bad = [name for name, tree in _modules()
           if any(i == "llama_cpp" or i.startswith("llama_cpp.") for i in _imports(tree))
           and not name.startswith("slotctl.runtime") and name != "slotctl.validate.worker"]
    assert not bad


def test_command_modules_import_no_other_command_module():
    mods = dict(_modules())
    commands = {n for n, t in mods.items() if n.startswith("slotctl.cli.") and _registers_commands(t)}
    assert {"slotctl.cli.save", "slotctl.cli.restore", "slotctl.cli.validate_cmd"} <= commands
    bad = [f"{n} imports {i}" for n in sorted(commands) for i in _imports(mods[n])
           if any(i == c or i.startswith(c + ".") for c in commands - {n})]
    assert not bad


def private_imports(tree) -> list[str]:
    """Imports of a private module or name of typer (``typer._click``, ``from typer import _click``), and of
    click itself (typer 0.29 vendors its own: slotctl declares no click)."""
    bad = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            mods = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            mods = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
        else:
            continue
        for m in mods:
            parts = m.split(".")
            if parts[0] == "click" or (parts[0] == "typer" and any(p.startswith("_") for p in parts[1:])):
                bad.append(f"line {n.lineno}: {m}")
    return bad


def test_typer_is_used_through_its_public_api_only():
    """No module of slotctl, the tests, scripts or benchmarks imports a private part of typer (any typer
    release may change it) or click (not declared: typer vendors its own)."""
    files = [p for d in ("slotctl", "tests", "scripts", "benchmarks", "fuzz") if (ROOT / d).is_dir()
             for p in sorted((ROOT / d).rglob("*.py"))]
    bad = {str(p.relative_to(ROOT)): b for p in files if (b := private_imports(ast.parse(p.read_text())))}
    assert not bad, bad
    assert private_imports(ast.parse("from typer import _click as click\nimport typer._coercion\n"
                                     "from typer._param_types import x\nimport click\nimport typer.core\n"
                                     "from typer import Option\n")) == [
        "line 1: typer._click", "line 2: typer._coercion", "line 3: typer._param_types",
        "line 3: typer._param_types.x", "line 4: click"]


def test_typer_is_not_capped():
    """pyproject.toml admits every typer from 0.29 on (public API only: nothing a release may break in
    private modules); tests/test_startup.py and test_cli_usage.py show what any release must keep."""
    import re

    text = (ROOT / "pyproject.toml").read_text()
    (spec,) = re.findall(r'"typer([^"]*)"', text)
    assert spec == ">=0.29", spec
