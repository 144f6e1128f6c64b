"""Generate slotctl/server/args_b11434.py, llama-server b11434's argument table, from llama.cpp's own source
(and slotctl/server/args_b11669.py, b11669's, from its --help: ``--b11669-help -``).

    python scripts/gen_server_args.py [ARG_CPP] [-o OUT] [--check]
    python scripts/gen_server_args.py --b11669-help {TEXT|-} [-o OUT] [--check]

ARG_CPP is b11434's ``common/arg.cpp`` (default: found in the cached llama-server build folder or the
unpacked source of ``tests/llama_server.py``; see :func:`tests.llama_server.llama_source_file`). The table
holds, for every ``add_opt(common_arg(...))`` of ``common_params_parser_init``: its spellings, its negated
spellings, how many values it takes (0, 1 or 2: which ``common_arg`` constructor it calls), its environment
variable, and the examples it is set for and excluded from. Which of them llama-server takes is then the
server's own rule (``add_opt``: in ``LLAMA_EXAMPLE_SERVER`` or ``LLAMA_EXAMPLE_COMMON``, and not excluded
from the server), applied in :mod:`slotctl.server.flags`.

``--check``: exit 1 if OUT differs from what the source gives (tests/test_server_args.py runs this).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "slotctl" / "server" / "args_b11434.py"


# -- a C++ reader good enough for arg.cpp: strings, chars, comments and nesting ------------------------------


def _skip_literal(src: str, i: int) -> int:
    """The index after the string or char literal (or comment) that starts at ``i``; ``i`` if none does."""
    if src.startswith("//", i):
        j = src.find("\n", i)
        return len(src) if j < 0 else j
    if src.startswith("/*", i):
        return src.index("*/", i + 2) + 2
    if src.startswith('R"', i) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
        delim = src[i + 2:src.index("(", i)]
        return src.index(")" + delim + '"', i) + len(delim) + 2
    if src[i] in "\"'" and not (src[i] == "'" and i > 0 and src[i - 1].isalnum()):  # 1'000 digit separators
        q, j = src[i], i + 1
        while src[j] != q:
            j += 2 if src[j] == "\\" else 1
        return j + 1
    return i


def _close(src: str, i: int) -> int:
    """The index of the bracket closing the one at ``i``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = [pairs[src[i]]]
    j = i + 1
    while stack:
        k = _skip_literal(src, j)
        if k != j:
            j = k
            continue
        c = src[j]
        if c in pairs:
            stack.append(pairs[c])
        elif c in ")}]":
            if c != stack.pop():
                raise ValueError(f"unbalanced {c!r} at offset {j}")
        j += 1
    return j - 1


def _split_top(src: str) -> list[str]:
    """``src`` split at its top-level commas."""
    parts, depth, start, j = [], 0, 0, 0
    while j < len(src):
        k = _skip_literal(src, j)
        if k != j:
            j = k
            continue
        c = src[j]
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(src[start:j].strip())
            start = j + 1
        j += 1
    parts.append(src[start:].strip())
    return [p for p in parts if p]


def _strings(src: str) -> list[str]:
    """The string literals of a brace list such as ``{"-c", "--ctx-size"}``."""
    return [bytes(m, "utf-8").decode("unicode_escape") for m in re.findall(r'"((?:[^"\\]|\\.)*)"', src)]


def _example_list(src: str, named: dict[str, list[str]]) -> list[str]:
    src = src.strip()
    if src in named:
        return named[src]
    return [e.removeprefix("LLAMA_EXAMPLE_") for e in re.findall(r"LLAMA_EXAMPLE_\w+", src)]


# -- the table ---------------------------------------------------------------------------------------------------


def parse_args_table(src: str) -> list[dict]:
    """Every ``add_opt(common_arg(...))`` of ``src`` (b11434's common/arg.cpp), in order."""
    named = {m.group(1): _example_list(m.group(2), {})
             for m in re.finditer(r"initializer_list<enum llama_example>\s+(\w+)\s*=\s*(\{[^}]*\})", src)}
    # blocks that add options for one example only (``if (ex == LLAMA_EXAMPLE_SERVER) { ... } else { ... }``)
    only, never = [], []
    for m in re.finditer(r"\bif\s*\(\s*ex\s*([=!]=)\s*LLAMA_EXAMPLE_(\w+)\s*\)\s*\{", src):
        then_close = _close(src, m.end() - 1)
        (only if m.group(1) == "==" else never).append((m.end(), then_close, m.group(2)))
        other = re.match(r"\s*else\s*\{", src[then_close + 1:])
        if other:
            start = then_close + 1 + other.end()
            (never if m.group(1) == "==" else only).append((start, _close(src, start - 1), m.group(2)))
    for m in re.finditer(r"\bif\s*\(\s*ex\b", src):
        if not any(a - 200 < m.start() < a for a, _, _ in only + never):
            raise ValueError(f"a condition on the example at offset {m.start()} that this script does not read")
    entries = []
    for m in re.finditer(r"\badd_opt\(\s*common_arg\(", src):
        if src.rfind("\n", 0, m.start()) < src.rfind("//", 0, m.start()):  # commented out
            continue
        open_ = m.end() - 1
        close = _close(src, open_)
        parts = _split_top(src[open_ + 1:close])
        # the constructors of struct common_arg (common/arg.h), told apart by their arguments:
        #   (args, help, void handler)                      -> a switch
        #   (args, args_neg, help, bool handler)             -> a switch and its negation
        #   (args, value_hint, help, string or int handler)  -> one value
        #   (args, value_hint, value_hint_2, help, handler)  -> two values
        args, neg = _strings(parts[0]), []
        if len(parts) == 3:
            values = 0
        elif len(parts) == 4 and parts[1].startswith("{"):
            values, neg = 0, _strings(parts[1])
        elif len(parts) == 4:
            values = 1
        elif len(parts) == 5:
            values = 2
        else:
            raise ValueError(f"common_arg with {len(parts)} arguments at offset {open_}: {parts[0]}")
        end = _close(src, m.start() + len("add_opt"))
        chain = src[close + 1:end]
        examples, excludes = ["COMMON"], []
        for call in re.finditer(r"\.set_(examples|excludes)\(", chain):
            inner = chain[call.end() - 1:_close(chain, call.end() - 1) + 1][1:-1]
            if call.group(1) == "examples":
                examples = _example_list(inner, named)
            else:
                excludes = _example_list(inner, named)
        for a, b, ex in only:  # added only when parsing for ``ex``
            if a <= m.start() < b:
                examples = [ex] if (ex in examples or "COMMON" in examples) and ex not in excludes else []
        for a, b, ex in never:  # never added when parsing for ``ex``
            if a <= m.start() < b and ex not in excludes:
                excludes = [*excludes, ex]
        env = re.search(r'\.set_env\("([^"]*)"\)', chain)
        entries.append({"args": args, "neg": neg, "values": values, "env": env.group(1) if env else None,
                        "examples": examples, "excludes": excludes,
                        "sampling": ".set_sampling()" in chain, "preset_only": ".set_preset_only()" in chain})
    return entries


HEADER = '''"""llama.cpp b11434's command-line arguments, as its ``common/arg.cpp`` declares them. GENERATED by
scripts/gen_server_args.py from that file: do not edit; tests/test_server_args.py checks it against the source.

Each entry of :data:`ARGS`: (spellings, negated spellings, values it takes (0, 1 or 2), environment variable
or None, examples it is set for, examples it is excluded from). Which ones llama-server takes, and what
slotctl does with them: :mod:`slotctl.server.flags`.
"""

# fmt: off
ARGS: tuple[tuple[tuple[str, ...], tuple[str, ...], int, str | None, tuple[str, ...], tuple[str, ...]], ...] = (
'''


def render(entries: list[dict]) -> str:
    lines = [HEADER]
    for e in entries:
        if e["preset_only"]:
            continue
        row = (tuple(e["args"]), tuple(e["neg"]), e["values"], e["env"], tuple(e["examples"]), tuple(e["excludes"]))
        lines.append(f"    {row!r},\n")
    lines.append(")\n")
    return "".join(lines)


# -- another build's table, from its --help ----------------------------------------------------------------------


def parse_help(text: str) -> list[dict]:
    """Every argument ``llama-server --help`` lists (``common_arg::to_string``: the spellings and value hints,
    padded to column 40 or alone on a longer line, then the description, whose ``(env: NAME)`` names its
    environment variable), in order: what a build whose source slotctl does not hold (b11669) takes. A
    spelling ``-no-X`` / ``--no-X`` after others starts the argument's negations (with a short ``-nX`` just
    before it); values: as many as its hints (at most 2)."""
    entries: list[dict] = []
    for line in text.splitlines():
        if line.startswith("-") and not line.startswith("-----"):
            head = line[:40].strip() if len(line) > 40 and line[37:40] == "   " else line.strip()
            *names, last = re.split(r",\s+", head)
            last_name, *hints = last.split(" ")
            spellings = [*names, last_name]
            # common_arg::to_string lists the spellings, then the negated ones: from the first --no-/-no-
            # spelling on, with a short -nX just before it (-nkvo, --no-kv-offload; -nr, --no-repack)
            first = next((i for i, n in enumerate(spellings) if n.startswith(("--no-", "-no-"))), len(spellings))
            if 1 < first < len(spellings) and spellings[first - 1].startswith("-n") \
                    and not spellings[first - 1].startswith("--"):
                first -= 1
            neg = spellings[first:] if first > 0 else []
            entries.append({"args": [n for n in spellings if n not in neg], "neg": neg,
                            "values": min(len([h for h in hints if h]), 2), "env": None,
                            "examples": ["SERVER"], "excludes": [], "preset_only": False})
        elif entries:
            env = re.search(r"\(env: ([A-Z0-9_]+)\)", line)
            if env and entries[-1]["env"] is None:
                entries[-1]["env"] = env.group(1)
    return entries


HEADER_HELP = '''"""llama-server {build}'s command-line arguments, as its ``--help`` lists them ({source}).
GENERATED by scripts/gen_server_args.py from that text: do not edit; tests/test_server_args.py checks it against
{build}'s --help.

Each entry of :data:`ARGS`: (spellings, negated spellings, values it takes (0, 1 or 2), environment variable
or None, examples it is set for (SERVER: --help lists what the server takes), examples it is excluded from).
Which ones llama-server takes, and what slotctl does with them: :mod:`slotctl.server.flags`.
"""
'''


def render_help(entries: list[dict], build: str, source: str) -> str:
    """:func:`render` of a table read from ``--help`` (:func:`parse_help`), with its own header."""
    head = HEADER_HELP.format(build=build, source=source)
    return render(entries).replace(HEADER.split("# fmt: off")[0], head, 1)


#: b11669's table (llama-server --help in the sid chroot of tests/llama_server.py)
OUT_B11669 = ROOT / "slotctl" / "server" / "args_b11669.py"
SOURCE_B11669 = "Debian llama.cpp-tools 1:0.7.0+dfsg-2"


def find_source() -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.llama_server import llama_source_file

    return llama_source_file("common/arg.cpp")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", nargs="?", type=Path, help="b11434's common/arg.cpp")
    ap.add_argument("-o", "--output", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="exit 1 if the output differs from the source's table")
    ap.add_argument("--b11669-help", type=Path, metavar="TEXT",
                    help="write b11669's table (slotctl/server/args_b11669.py unless -o) from this `llama-server "
                         "--help` output; `-` runs it in the chroot of tests/llama_server.py")
    a = ap.parse_args(argv)
    if a.b11669_help is not None:
        out = a.output if a.output != OUT else OUT_B11669
        help_text = b11669_help() if str(a.b11669_help) == "-" else a.b11669_help.read_text(encoding="utf-8")
        text = render_help(parse_help(help_text), "b11669", SOURCE_B11669)
        return _write(out, text, a.check, "b11669's --help")
    source = a.source or find_source()
    text = render(parse_args_table(source.read_text(encoding="utf-8")))
    return _write(a.output, text, a.check, str(source))


def b11669_help() -> str:
    """``llama-server --help`` of b11669, run in its chroot (set up first when missing; root)."""
    import subprocess

    sys.path.insert(0, str(ROOT))
    from tests.llama_server import seed_server

    out = subprocess.run(seed_server().command(["--help"]), capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise SystemExit(f"llama-server --help exited with {out.returncode}: {out.stderr[-500:]}")
    return out.stdout


def _write(output: Path, text: str, check: bool, source: str) -> int:
    a_output, a_check = output, check
    if a_check:
        if a_output.read_text(encoding="utf-8") != text:
            print(f"{a_output} differs from the table of {source}: run scripts/gen_server_args.py", file=sys.stderr)
            return 1
        return 0
    tmp = a_output.with_name(a_output.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(a_output)
    print(f"{a_output}: {text.count(chr(10)) - HEADER.count(chr(10)) - 1} arguments from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
