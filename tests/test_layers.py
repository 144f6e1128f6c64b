"""The import rules of docs/design.md, read from the source: imports point down the table of layers, only
the runtime and validate's worker import llama.cpp, nothing outside the CLI imports it, and no command
module imports another."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "slotctl"

#: docs/design.md's table, top to bottom: a unit may import units below it (or its own modules) only
LAYERS = [
    {"__main__"},
    {"cli"},
    {"remote"},
    {"prune"},
    {"catalog"},
    {"validate", "identify"},
    {"runtime"},
    {"describe", "strip", "convert", "diff"},
    {"tensors"},
    {"server"},
    {"model", "slotfile"},
    {"format"},
    {"sources"},
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
