"""The JSON Schemas of docs/schemas, for tests: every ``--json`` document a command prints is checked.

``check(command, doc)`` validates a document against ``docs/schemas/<command>.schema.json``;
``check_jsonl(command, text)`` validates ``--jsonl`` output line by line. conftest.py installs
:func:`watch_output`, so every document a command prints through ``Output`` during the test suite is
checked against its command's schema. Adding a command: add its schema file, nothing else.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from referencing import Registry, Resource

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "docs" / "schemas"


@functools.cache
def registry() -> Registry:
    resources = []
    for p in sorted(SCHEMA_DIR.glob("*.schema.json")):
        resources.append((p.name, Resource.from_contents(json.loads(p.read_text()))))
    return Registry().with_resources(resources)


def schema_names() -> list[str]:
    """The commands that have a schema (``strip-draft`` for ``strip-draft.schema.json``)."""
    return sorted(p.name.removesuffix(".schema.json") for p in SCHEMA_DIR.glob("*.schema.json")
                  if p.name != "common.schema.json")


@functools.cache
def validator(command: str, part: str | None = None) -> Draft202012Validator:
    name = f"{command}.schema.json"
    if not (SCHEMA_DIR / name).is_file():
        raise AssertionError(f"no JSON Schema for `slotctl {command}`: add docs/schemas/{name}")
    ref = name + (f"#/$defs/{part}" if part else "")
    return Draft202012Validator({"$ref": ref}, registry=registry())


def errors(command: str, doc, part: str | None = None) -> list[str]:
    """Every way ``doc`` breaks its schema, one line each (empty when it conforms)."""
    v = validator(command, part)
    out = []
    for e in v.iter_errors(doc):
        best = best_match([e])  # in a oneOf, the error of the branch that came closest
        where = "/".join(map(str, best.absolute_path)) or "(top)"
        out.append(f"{command}{'#' + part if part else ''} at {where}: {best.message[:300]}")
    return out


def check(command: str, doc, part: str | None = None) -> None:
    problems = errors(command, doc, part)
    assert not problems, "\n".join(problems)


def check_jsonl(command: str, text: str) -> list[dict]:
    """``--jsonl`` output: every line one object (a file, or the final summary line); returns them."""
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert lines, "no JSON lines"
    for line in lines[:-1]:
        check(command, line, "file")
    if "error" not in lines[-1] or "summary" in lines[-1]:
        check(command, lines[-1], "summary_line")
    else:
        check("common", lines[-1], "error_document")
    return lines


def command_name() -> str | None:
    """The slotctl command running now, or None."""
    from slotctl.cli.app import running_command

    return running_command()
