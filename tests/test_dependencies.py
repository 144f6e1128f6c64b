"""Every module slotctl, its tests, benchmarks, fuzzers and scripts import is declared in pyproject.toml, in
the part of it that installs it where it is needed: slotctl's own code in the core dependencies or one of
its optional extras (llama.cpp in ``[llama]``, obstore in ``[s3]``), never in ``[test]``; everything else in
the core or the ``[test]`` extra.

A package that only this machine has would pass every other test here and fail on a fresh machine (typer
0.29 vendors its own click, so ``import click`` works only where someone installed click by hand). The
imports are read with ``ast`` (the modules are not imported); each one is mapped to the distribution that
installs it by the installed distributions' own file lists (``importlib.metadata``).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: where code lives, and the parts of pyproject.toml that must install what it imports there ("extras": the
#: core and every extra but test's: slotctl's optional parts, llama.cpp, the object store, ...)
SCOPES = {
    "slotctl": ("extras",),
    "tests": ("core", "test"),
    "benchmarks": ("core", "test"),
    "fuzz": ("core", "test"),
    "scripts": ("core", "test"),
}


#: where a module's name is not its distribution's, for a machine that has not installed it (when it is
#: installed, its own file list says)
NOT_INSTALLED_ALIASES = {"llama_cpp": "llama-cpp-python", "yaml": "pyyaml"}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: dict) -> dict[str, set[str]]:
    """The distributions each part installs ("core" and every extra; ``slotctl[x]`` inside an extra
    brings in the core and extra ``x``)."""
    project = pyproject["project"]
    own = normalize(project["name"])
    raw = {"core": list(project.get("dependencies", [])), **project.get("optional-dependencies", {})}

    def names(part: str, seen: frozenset = frozenset()) -> set[str]:
        out: set[str] = set()
        for req in raw.get(part, []):
            m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", req)
            assert m, f"pyproject.toml: cannot read the requirement {req!r}"
            name = normalize(m.group(1))
            if name == own:  # slotctl[llama]: the core and the extras named
                for extra in ["core", *(e.strip() for e in (m.group(2) or "").split(",") if e.strip())]:
                    if extra not in seen:
                        out |= names(extra, seen | {part})
            else:
                out.add(name)
        return out

    parts = {part: names(part) for part in raw}
    parts["core"] = names("core")
    parts["extras"] = set().union(*(d for p, d in parts.items() if p != "test"))
    return {part: (dists | parts["core"]) for part, dists in parts.items()}


def local_modules(root: Path) -> set[str]:
    """Top-level names that are the project's own: slotctl and the modules beside the tests, benchmarks..."""
    local = {"slotctl"}
    for scope in SCOPES:
        d = root / scope
        if d.is_dir() and scope != "slotctl":
            local.add(scope)  # from tests.llama_server import ...
            local |= {p.stem for p in d.rglob("*.py")} | {p.name for p in d.iterdir() if p.is_dir()}
    return local


def imports(source: str, filename: str) -> list[tuple[str, int]]:
    """The absolute imports of a source file: (top-level module, line)."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            out += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module.split(".")[0], node.lineno))
    return out


def undeclared(files: dict[str, str], pyproject: dict, providers: dict[str, list[str]],
               local: set[str]) -> list[str]:
    """One line per import (file: line) that no part of pyproject.toml for its scope installs.

    ``files``: path relative to the project -> source; ``providers``: top-level module -> the
    distributions that install it (``importlib.metadata.packages_distributions()``)."""
    parts = declared(pyproject)
    problems = []
    for rel, source in sorted(files.items()):
        scope = rel.split("/", 1)[0]
        allowed = set().union(*(parts.get(p, set()) for p in SCOPES[scope]))
        for top, line in imports(source, rel):
            if top in sys.stdlib_module_names or top in local or top == "__future__":
                continue
            dists = {normalize(d) for d in providers.get(top, [])}
            if not dists:  # not installed here: then its name must be a declared distribution's
                dists = {normalize(NOT_INSTALLED_ALIASES.get(top, top))}
            if dists.isdisjoint(allowed):
                where = " or ".join({"core": "the core dependencies", "extras": "the core or an extra but [test]"}
                                    .get(p, f"[{p}]") for p in SCOPES[scope])
                installed = (f"installed here by {', '.join(sorted(dists))}" if providers.get(top)
                             else "not installed here")
                problems.append(f"{rel}:{line}: imports {top} ({installed}), which pyproject.toml does not "
                                f"declare in {where}")
    return problems


def project_files() -> dict[str, str]:
    files = {}
    for scope in SCOPES:
        for p in sorted((ROOT / scope).rglob("*.py")) if (ROOT / scope).is_dir() else ():
            files[str(p.relative_to(ROOT))] = p.read_text()
    return files


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_import_is_declared_where_it_is_needed():
    problems = undeclared(project_files(), _pyproject(), importlib.metadata.packages_distributions(),
                          local_modules(ROOT))
    assert not problems, "\n".join(problems)


def test_the_check_catches_what_a_fresh_machine_lacks():
    """The check itself: click (installed by hand on some machine, declared nowhere), llama.cpp imported by
    slotctl is the [llama] extra's, hypothesis in slotctl's own code is the test extra's (not the core's),
    a module not installed at all; and declared ones pass."""
    pyproject = _pyproject()
    providers = {"numpy": ["numpy"], "click": ["click"], "llama_cpp": ["llama_cpp_python"],
                 "hypothesis": ["hypothesis"], "_pytest": ["pytest"], "yaml": ["PyYAML"]}
    files = {
        "tests/test_a.py": "import click\nimport numpy\nfrom _pytest import fixtures\nimport llama_cpp\n",
        "slotctl/x.py": "import numpy\nfrom hypothesis import given\nimport llama_cpp.llama_cpp\n"
                        "from . import y\nfrom slotctl import z\nimport os.path\n",
        "benchmarks/b.py": "import yaml\nimport no_such_module_anywhere\nimport conftest\n",
    }
    problems = undeclared(files, pyproject, providers, {"slotctl", "conftest"})
    assert [p.split(" (")[0] for p in problems] == [
        "benchmarks/b.py:1: imports yaml", "benchmarks/b.py:2: imports no_such_module_anywhere",
        "slotctl/x.py:2: imports hypothesis", "tests/test_a.py:1: imports click"], problems
    assert "installed here by click" in problems[-1] and "not installed here" in problems[1]


def test_the_test_extra_installs_the_core_and_llama():
    parts = declared(_pyproject())
    assert {"typer", "numpy", "construct", "llama-cpp-python", "pytest", "jsonschema"} <= parts["test"]
    assert "llama-cpp-python" not in parts["core"] and "pytest" not in parts["core"]
