"""One JSON style for every command: schemas, failures as documents, --jsonl, many files, pipes and terminals.

conftest.py checks every --json document printed in the suite against docs/schemas; these tests cover
what only the JSON style itself promises.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from typer.testing import CliRunner

import json_schemas
from slotctl.cli.app import app

DATA = Path(__file__).parent / "data"
SLOT = DATA / "srv-draft.bin"
runner = CliRunner()


def cli(*args, stdin=None):
    return runner.invoke(app, [str(a) for a in args], input=stdin)


def slotctl(*args, env=None, stdin=None):
    """The real console entry point in a process (usage errors are handled there)."""
    return subprocess.run([sys.executable, "-m", "slotctl", *map(str, args)], capture_output=True, text=False,
                          env={**os.environ, **(env or {})}, input=stdin, timeout=120)


# -- the schemas themselves ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(json_schemas.SCHEMA_DIR.glob("*.schema.json")), ids=lambda p: p.name)
def test_every_schema_is_a_valid_draft_2020_12_schema(path):
    Draft202012Validator.check_schema(json.loads(path.read_text()))


def test_every_command_has_a_schema():
    from slotctl.cli.app import COMMANDS

    names = set(COMMANDS)
    assert names <= set(json_schemas.schema_names()), f"commands without docs/schemas: {names - set(json_schemas.schema_names())}"


def test_the_schemas_reject_what_the_conventions_forbid():
    doc = json.loads(cli("inspect", SLOT, "--json").stdout)
    json_schemas.check("inspect", doc)
    bad = json.loads(json.dumps(doc))
    bad["files"][0]["checkpoints"] = None   # a list is always a list
    assert json_schemas.errors("inspect", bad)
    bad = json.loads(json.dumps(doc))
    del bad["exit_code"]
    assert json_schemas.errors("inspect", bad)
    bad = json.loads(json.dumps(doc))
    bad["files"][0]["version"] = 4          # one name for one thing: state_version
    assert json_schemas.errors("inspect", bad)


# -- failures are documents ------------------------------------------------------------------------------


def test_a_missing_file_alone_is_a_per_file_error_and_exit_2():
    res = cli("inspect", "nope.bin", "--json")
    assert res.exit_code == 2
    doc = json.loads(res.stdout)
    assert doc["exit_code"] == 2 and doc["files"] == [
        {"path": "nope.bin", "exit_code": 2, "error": {"code": "no_such_file",
                                                       "message": "nope.bin: no such file or directory"}}]


def test_a_missing_path_among_many_is_one_entry_not_the_loss_of_the_run(tmp_path):
    for name in ("a.bin", "b.bin"):
        shutil.copy(SLOT, tmp_path / name)
    for command in ("inspect", "validate"):
        res = cli(command, tmp_path, "nope.bin", "--json")
        assert res.exit_code == 2, res.output
        doc = json.loads(res.stdout)
        assert [f["path"] for f in doc["files"]] == [str(tmp_path / "a.bin"), str(tmp_path / "b.bin"), "nope.bin"]
        assert [f["exit_code"] for f in doc["files"]] == [0, 0, 2]
        assert doc["files"][2]["error"]["code"] == "no_such_file"
    doc = json.loads(cli("strip-draft", tmp_path, "nope.bin", "--dry-run", "--grace", "0", "--json").stdout)
    assert [f["exit_code"] for f in doc["files"]] == [0, 0, 2] and doc["exit_code"] == 2


def test_a_whole_command_failure_is_the_error_document():
    res = cli("validate", SLOT, "-m", "nope.gguf", "--json")
    assert res.exit_code == 2
    doc = json.loads(res.stdout)
    assert set(doc) == {"error", "exit_code"} and doc["exit_code"] == 2 and doc["error"]["message"]
    res = cli("slots", "--server", "http://127.0.0.1:9", "--timeout", "2", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 2 and doc["error"]["code"] == "server_unreachable"


@pytest.mark.parametrize("args", [["inspect", "--nope", "--json"], ["validate", "--json"],
                                  ["validate", str(SLOT), "-c", "x", "--json"]])
def test_usage_errors_are_documents_too(args):
    r = slotctl(*args)
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    assert doc["error"]["code"] == "usage" and doc["exit_code"] == 2
    json_schemas.check(args[0], doc)
    assert r.stderr.decode().startswith("error: ") and r.stderr.decode().count("\n") == 1


# -- many files, directories, stdin ----------------------------------------------------------------------


def test_a_directory_holds_slot_files_by_their_magic_and_counts_the_rest():
    doc = json.loads(cli("validate", DATA, "--json").stdout)
    names = sorted(Path(f["path"]).name for f in doc["files"])
    assert names == sorted(p.name for p in DATA.glob("*.bin"))
    assert doc["summary"]["skipped"] == len([p for p in DATA.iterdir() if p.is_file() and p.suffix != ".bin"])
    assert doc["exit_code"] == 0
    doc = json.loads(cli("inspect", DATA, "--json").stdout)
    assert len(doc["files"]) == len(names) and doc["summary"]["parsed"] == len(names)


def test_a_gguf_given_as_a_slot_file_is_named_as_such():
    res = cli("inspect", DATA / "target.gguf", "--json")
    f = json.loads(res.stdout)["files"][0]
    assert res.exit_code == 1 and f["findings"][0]["code"] == "gguf_model"
    assert "this is a GGUF model, not a slot file" in f["findings"][0]["message"]
    res = cli("validate", DATA / "target.gguf")
    assert "this is a GGUF model, not a slot file" in " ".join(res.output.split())   # wrapped at 80


def test_stdin_is_read_for_dash():
    data = SLOT.read_bytes()
    for command in ("inspect", "validate"):
        res = cli(command, "-", "--json", stdin=data)
        doc = json.loads(res.stdout)
        assert res.exit_code == 0 and doc["files"][0]["path"] == "-" and doc["files"][0]["size"] == len(data)


def test_jsonl_streams_one_object_per_file_then_the_summary(tmp_path):
    for name in ("a.bin", "b.bin"):
        shutil.copy(SLOT, tmp_path / name)
    for command in ("inspect", "validate", "strip-draft"):
        res = cli(command, tmp_path, "nope.bin", "--jsonl", *(["--dry-run", "--grace", "0"] if command == "strip-draft" else []))
        lines = json_schemas.check_jsonl(command, res.stdout)
        assert [line.get("path") for line in lines] == [str(tmp_path / "a.bin"), str(tmp_path / "b.bin"),
                                                        "nope.bin", None]
        assert lines[-1]["summary"]["files"] == 3 and lines[-1]["exit_code"] == 2 == res.exit_code


def test_checkpoints_are_a_list_even_without_an_appendix():
    f = json.loads(cli("inspect", SLOT, "--json").stdout)["files"][0]
    assert f["checkpoints"] == [] and f["sckp"] is None and f["target_candidates"] == []


# -- output for people -----------------------------------------------------------------------------------


def test_quiet_shows_only_the_files_that_are_not_fine_and_the_summary(tmp_path):
    for i in range(5):
        shutil.copy(SLOT, tmp_path / f"good{i}.bin")
    (tmp_path / "bad.bin").write_bytes(SLOT.read_bytes()[:100])
    res = cli("validate", tmp_path, "-q")
    lines = res.stdout.splitlines()
    assert res.exit_code == 1
    assert not any("good" in line for line in lines)
    assert lines[0].startswith(str(tmp_path / "bad.bin")) and lines[-1].startswith("6 file(s): 5 restoring completely")


def test_on_a_pipe_lines_fit_columns_and_no_value_is_cut(tmp_path):
    """On a pipe the output is laid out for COLUMNS (else 80): no line is longer; a path or a message
    longer than a line wraps (folds), whole."""
    deep = tmp_path / ("a-very-long-directory-name-" * 4)
    deep.mkdir()
    for i in range(2):
        (deep / f"damaged-slot-file-{i}.bin").write_bytes(SLOT.read_bytes()[:1000])
    for env, width in (({"COLUMNS": "60"}, 60), ({"COLUMNS": ""}, 80)):
        r = slotctl("validate", deep, "-m", DATA / "target.gguf", "--no-load", env=env)
        lines = r.stdout.decode().splitlines()
        assert r.returncode == 1 and max(map(len, lines)) <= width, lines
        flat = "".join("".join(lines).split())     # every value whole once the wrapping is undone
        for i in range(2):
            assert "".join(str(deep / f"damaged-slot-file-{i}.bin").split()) in flat
        assert flat.count("restoringthisfilecrashestheserver") == 2 and flat.count("notcertain") == 2
        # stderr: one line per message, whole (grep finds it)
        assert all(len(x.split("error:")) <= 2 for x in r.stderr.decode().splitlines())
