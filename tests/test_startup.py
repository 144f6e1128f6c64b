"""Start-up: each command imports what it needs and nothing heavier (checked in a fresh process).

No timing here (benchmarks/bench_startup.py times whole processes): which modules a command loads is what
decides its start-up, and that is deterministic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slotctl.cli.app import COMMANDS
from slotctl.sample import MODEL, SLOT_FILE

#: modules no command loads unless it needs them: llama.cpp, HTTP (and ssl), pydantic (typer's converter)
HEAVY = ("llama_cpp", "ssl", "http.client", "urllib.request", "pydantic", "asyncio", "gguf", "numpy", "construct",
         "rich")

_PROBE = """
import json, sys
from slotctl.cli.app import main
code = 0
try:
    main(sys.argv[2:])
except SystemExit as e:
    code = e.code
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def loaded(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[int, set[str]]:
    """The exit code of ``slotctl ARGS`` in a fresh interpreter and which of HEAVY it imported."""
    out = tmp_path / "modules.json"
    r = subprocess.run([sys.executable, "-c", _PROBE, str(out), *args], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **(env or {})})
    assert out.exists(), r.stderr
    d = json.loads(out.read_text())
    return d["code"], {m for m in d["modules"] if m in HEAVY}


@pytest.mark.parametrize("args", [["--help"], ["--version"], []])
def test_slotctl_help_imports_no_command(tmp_path, args):
    code, heavy = loaded(tmp_path, *args)
    assert code in ((0, None) if args else (2,))
    assert heavy == set()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_command_help_loads_no_llama_cpp_and_no_http(tmp_path, command):
    code, heavy = loaded(tmp_path, command, "--help")
    assert code in (0, None)
    assert heavy.isdisjoint({"llama_cpp", "ssl", "http.client", "urllib.request", "pydantic", "asyncio"})


def test_inspect_without_model_reads_the_file_and_nothing_more(tmp_path):
    """rich only where it draws styles: not for --json, not on a pipe (the view's plain lines are written
    without it: tests/test_layout.py), on a terminal (TTY_COMPATIBLE=1: rich takes stdout for one) it draws."""
    for extra, env, drawn in (([], None, set()), (["--json"], None, set()), ([], {"TTY_COMPATIBLE": "1"}, {"rich"})):
        code, heavy = loaded(tmp_path, "inspect", str(SLOT_FILE), *extra, env=env)
        assert code in (0, None)
        assert heavy == {"numpy", "construct"} | drawn, (extra, env)


def test_inspect_file_imports_no_flag_tables_and_no_json(tmp_path):
    """``inspect FILE`` (a file without checkpoints or a draft state, shown for people) reads no server flags
    (their tables, ServerFlags, the context settings), no speculative state and writes no JSON: the modules
    it does not need are not imported (docs/design.md, "Imports and start-up")."""
    out = tmp_path / "modules.txt"
    probe = ("import sys\nfrom slotctl.cli.app import main\ntry:\n    main(sys.argv[2:])\nexcept SystemExit:\n    pass\n"
             "open(sys.argv[1], 'w').write('\\n'.join(sorted(sys.modules)))\n")   # _PROBE's own json aside
    subprocess.run([sys.executable, "-c", probe, str(out), "inspect", str(SLOT_FILE)], capture_output=True,
                   timeout=120)
    mods = set(out.read_text().split("\n"))
    assert {"slotctl.slotfile", "slotctl.server.findings", "slotctl.server.reuse", "slotctl.cli.inspect_view"} <= mods
    unneeded = {"slotctl.server.flags", "slotctl.server.args_b11434", "slotctl.model.settings",
                "slotctl.server.speculative", "slotctl.server.restore", "json", "rich.console", "rich.table"}
    assert mods.isdisjoint(unneeded), sorted(mods & unneeded)


def test_validate_and_strip_draft_run_no_llama_cpp_and_no_http(tmp_path):
    code, heavy = loaded(tmp_path, "validate", str(SLOT_FILE), "-c", "256", "-fa", "on")
    assert code in (0, None)
    assert heavy.isdisjoint({"llama_cpp", "ssl", "http.client", "urllib.request", "pydantic"})
    code, heavy = loaded(tmp_path, "validate", str(SLOT_FILE), "-m", str(MODEL), "-c", "256", "-fa", "on",
                         "--no-load")
    assert code in (0, None)
    assert "gguf" in heavy and heavy.isdisjoint({"llama_cpp", "ssl", "http.client", "urllib.request", "pydantic"})
    code, heavy = loaded(tmp_path, "strip-draft", "--dry-run", "--grace", "0", str(SLOT_FILE))
    assert code in (0, None)
    assert heavy.isdisjoint({"llama_cpp", "ssl", "http.client", "urllib.request", "pydantic"})


def test_live_mode_loads_http_but_not_llama_cpp(tmp_path):
    code, heavy = loaded(tmp_path, "slots", "--server", "http://127.0.0.1:9", "--timeout", "2")
    assert code == 2  # nothing listens on port 9
    assert {"http.client", "urllib.request"} <= heavy
    assert heavy.isdisjoint({"llama_cpp", "numpy", "gguf", "pydantic"})


def test_a_usage_error_imports_no_runtime(tmp_path):
    code, heavy = loaded(tmp_path, "save", "-m", str(tmp_path / "missing.gguf"), "--prompt", "x", "-o",
                         str(tmp_path / "x.bin"))
    assert code == 2
    assert heavy.isdisjoint({"llama_cpp", "ssl", "http.client", "pydantic"})


def test_summaries_match_the_commands():
    """``slotctl --help`` lists commands from COMMANDS without importing them: the summaries must be what
    each command says of itself."""
    from slotctl.cli.app import COMMANDS, load_command

    for name, entry in COMMANDS.items():
        cmd = load_command(name)
        assert cmd.name == name
        assert " ".join((cmd.help or "").split("\n\n")[0].split()) == entry.summary, name


def test_every_parameter_converts_without_pydantic():
    """Every parameter of every command gets slotctl's plain converter (else pydantic is imported on use)."""
    from slotctl.cli.app import COMMANDS, load_command
    from slotctl.cli.params import plain

    for name in COMMANDS:
        for p in load_command(name).params:
            if p.name == "ctx":
                continue
            assert plain(p) is not None, f"{name} {p.name}: not plain, typer would convert it through pydantic"


def test_only_an_s3_path_loads_the_object_store(tmp_path):
    """obstore (and the store module) load when a command is given an s3:// path, never for local files."""
    out = tmp_path / "m.json"
    code = ("import json, sys\nfrom slotctl.cli.app import main\ntry:\n    main(sys.argv[2:])\nexcept SystemExit:\n"
            "    pass\njson.dump(sorted(m for m in sys.modules if m.startswith(('obstore', 'slotctl.store'))), "
            "open(sys.argv[1], 'w'))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    for args, want in ((["inspect", str(SLOT_FILE)], []),
                       (["ls", str(SLOT_FILE.parent)], []),
                       (["inspect", "s3://bucket/key.bin"], ["obstore", "slotctl.store.s3"])):
        subprocess.run([sys.executable, "-c", code, str(out), *args], capture_output=True, timeout=120, env=env)
        mods = json.loads(out.read_text())
        assert [m for m in mods if m in ("obstore", "slotctl.store.s3")] == want, args


def test_prometheus_client_only_when_metrics_are_served(tmp_path):
    """keep (one pass against a server that is down) imports prometheus_client only with --listen, where it
    serves /metrics; serve only with --metrics-listen (stopped by SIGTERM once it listens)."""
    import signal

    out = tmp_path / "m.json"
    code = ("import json, sys\nfrom slotctl.cli.app import main\ntry:\n    main(sys.argv[2:])\nexcept SystemExit:\n"
            "    pass\njson.dump(sorted(m for m in sys.modules if m.split('.')[0] == 'prometheus_client'), "
            "open(sys.argv[1], 'w'))\n")
    down = "http://127.0.0.1:9"
    for extra, want in (([], False), (["--listen", "127.0.0.1:0"], True)):
        r = subprocess.run([sys.executable, "-c", code, str(out), "keep", "--server", down, "--slot-dir",
                            str(tmp_path), "--save-all", "--timeout", "2", *extra],
                           capture_output=True, text=True, timeout=120)
        assert "did not answer" in r.stderr, r.stderr
        assert bool(json.loads(out.read_text())) == want, (extra, r.stderr)
    pytest.importorskip("aiohttp")
    for extra, want in (([], False), (["--metrics-listen", "127.0.0.1:0"], True)):
        out.unlink(missing_ok=True)
        p = subprocess.Popen([sys.executable, "-c", code, str(out), "serve", "--upstream", down, "--slot-dir",
                              str(tmp_path), "--listen", "127.0.0.1:0", "--json", *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = json.loads(p.stdout.readline())
            assert first["event"] == "listening", first
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert bool(json.loads(out.read_text())) == want, (extra, first)
