"""The docs do not drift from the code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cli_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (ROOT / "docs" / "cli.md").read_text() == mod.render(), \
        "docs/cli.md is stale: run python scripts/gen_cli_docs.py"


def test_readme_quick_start_matches_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"```sh\n(.+?)\n```", readme)
    assert commands[0] == "pip install . && slotctl demo"
    # the first command's install (the core: no llama-cpp-python) and its demo, in a fresh venv
    assert '-m pip install -q .\n' in ci and 'slotctl" demo' in ci
    # the second command as written, each half a line of its own, in a fresh venv whose python comes first
    install, run = commands[1].split(" && ")
    lines = ci.splitlines()
    assert install in lines and run in lines and lines.index(install) < lines.index(run), commands[1]
    fresh = lines.index('python3 -m venv "$full"')
    assert fresh < lines.index('PATH="$full/bin:$PATH"') < lines.index(install)
    assert not any(line.startswith("python3 -m pip") or line.startswith("python3 -m pytest") for line in lines)


# -- links and citations -------------------------------------------------------------------------

#: every markdown page a reader of the repository meets
def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "tests" / "data").rglob("README.md"))]


_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (their brackets are not links)."""
    return re.sub(r"`[^`\n]*`", "", _FENCE.sub("", text))


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", _FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _broken_links(page: Path, text: str | None = None) -> list[str]:
    """Links of ``page`` (or of ``text`` read as if it were ``page``) that lead nowhere in the repository."""
    text = page.read_text() if text is None else text
    broken = []
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", _prose(text)):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):          # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if ROOT not in dest.parents or not dest.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text() if path else text):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return broken


def test_doc_links_resolve():
    broken = {str(p.relative_to(ROOT)): b for p in _pages() if (b := _broken_links(p))}
    assert not broken, broken


def test_link_checker_finds_broken_links():
    page = ROOT / "docs" / "format.md"
    good = "[a](format.md) [b](format.md#6-sckp-context-checkpoints) [c](#what-slotctl-answers) [d](../README.md)"
    assert _broken_links(page, "## What slotctl answers\n" + good) == []
    bad = "[x](format.md#no-such-heading) [y](nope.md) [z](../../etc/hostname) [w](#nowhere)"
    assert len(_broken_links(page, "## What slotctl answers\n" + bad)) == 4
    assert _broken_links(page, "`[not](a-link.md)`\n```\n[nor](this.md)\n```\n") == []


#: files and folders that exist only outside the repository (the notes the project started from)
_OUTSIDE = ("FORMAT.md", "seed/", "000_be707a6df623abc0", "../shared", "/work/", "STYLE.md", "shared/vectors")


def _cited_outside(text: str) -> list[str]:
    return [s for s in _OUTSIDE if s in text]


def test_no_doc_cites_files_outside_the_repository():
    files = _pages() + sorted((ROOT / "slotctl").rglob("*.py")) + sorted((ROOT / "scripts").rglob("*.py")) \
        + sorted((ROOT / "benchmarks").rglob("*.py")) \
        + [p for p in sorted((ROOT / "tests").rglob("*.py")) if p.name != "test_docs.py"]
    cited = {str(p.relative_to(ROOT)): c for p in files if (c := _cited_outside(p.read_text()))}
    assert not cited, f"cite docs/format.md (or the llama.cpp function or commit) instead: {cited}"


def test_format_and_troubleshooting_pages_are_linked():
    readme = (ROOT / "README.md").read_text()
    design = (ROOT / "docs" / "design.md").read_text()
    for page in ("format.md", "troubleshooting.md"):
        assert f"(docs/{page})" in readme and f"({page})" in design, page


def _commands() -> set[str]:
    import typer

    from slotctl.cli.app import app
    return set(typer.main.get_command(app).list_commands(None))


def test_docs_name_only_commands_that_exist():
    """Every ``slotctl CMD`` a page shows (in code) is a command the CLI has."""
    commands = _commands()
    unknown = {}
    for page in _pages():
        code = "\n".join(_FENCE.findall(page.read_text()) + re.findall(r"`[^`\n]*`", page.read_text()))
        named = set(re.findall(r"\bslotctl ([a-z][a-z-]*)", code))
        if bad := named - commands:
            unknown[str(page.relative_to(ROOT))] = sorted(bad)
    assert not unknown, unknown


def _example_problems(text: str) -> list[str]:
    """Command lines in ``sh`` blocks (``slotctl CMD ...``) that name a command or an option it lacks."""
    import shlex

    import typer

    from slotctl.cli.app import app
    from slotctl.server.flags import server_arg
    group = typer.main.get_command(app)
    ctx = typer.Context(group)
    problems = []
    for block in re.findall(r"^```(?:sh|console|bash)\n(.*?)^```", text, re.S | re.M):
        for line in block.splitlines():
            line = line.strip().removeprefix("$ ").strip()
            if not line.startswith("slotctl "):
                continue
            line = re.sub(r"\[[^\]]*\]", "", re.sub(r"\s#.*$", "", line))   # comments, [placeholders]
            words = shlex.split(line)
            cmd = group.get_command(ctx, words[1]) if len(words) > 1 else None
            if cmd is None:
                problems.append(f"{line}: no command {words[1:2]}")
                continue
            opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
            pasted = any(p.name == "server_args" for p in cmd.params)   # takes every llama-server flag
            bad = [w for w in words[2:] if w.startswith("-") and w != "-" and w.split("=")[0] not in opts
                   and not (pasted and server_arg(w) is not None)]
            if bad:
                problems.append(f"{line}: {words[1]} has no option {', '.join(bad)}")
    return problems


def test_doc_examples_use_commands_and_options_that_exist():
    problems = {str(p.relative_to(ROOT)): b for p in _pages() if (b := _example_problems(p.read_text()))}
    assert not problems, problems
    assert len(_example_problems("```sh\nslotctl inspect x.bin --no-such-flag  # c\nslotctl nope\n"
                                 "slotctl validate d/ -m m.gguf [flags] -np 4 -ngl 99\n"
                                 "slotctl inspect x.bin -ngl 99\n```\n")) == 3


def test_format_page_agrees_with_the_schemas():
    """docs/format.md's constants and type table are the ones slotctl.format parses with."""
    from slotctl.format import appendix, blob, ggml, header, tokens

    text = (ROOT / "docs" / "format.md").read_text()
    for value in (header.STATE_SEQ_MAGIC, blob.BLOB_MAGIC, appendix.SCKP_MAGIC, appendix.SDFT_MAGIC):
        assert f"`0x{value:08x}`" in text, hex(value)
    assert tuple(header.SUPPORTED_VERSIONS) == (2, 3, 4) and "## 8. State versions 2, 3 and 4" in text
    assert f"version, {appendix.SCKP_VERSION}" in text and f"version, {appendix.SDFT_VERSION}" in text
    assert f"| 4 | u32 | version | 1 (`SERVER_TOKENS_STATE_VERSION`) |" in text and tokens.TOKEN_RECORD_VERSION == 1
    rows = dict((m[0], tuple(map(int, m[1:]))) for m in
                re.findall(r"^\| (\w+) \| (\d+) \| (\d+) \| (\d+) \|$", text, re.M))
    assert set(rows) == set(ggml.CACHE_TYPE_NAMES)
    for name, (type_id, block, block_bytes) in rows.items():
        t = ggml.BY_NAME[name]
        assert (t.id, t.block, t.block_bytes) == (type_id, block, block_bytes), name


def test_every_doc_page_is_reachable_from_the_readme():
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for m in re.finditer(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)\s]*)?\)", _prose(page.read_text())):
            dest = (page.parent / m.group(1)).resolve()
            if dest.suffix == ".md" and dest.is_file() and ROOT in dest.parents:
                todo.append(dest)
    orphans = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in seen)
    assert not orphans, f"docs pages no link from README leads to: {orphans}"
