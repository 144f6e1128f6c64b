"""What a human view draws, as slotctl's own small renderables (text, tables, panels, groups): drawn by rich
on a terminal, and written as plain lines without rich where rich would draw no styles (a pipe, a file).

rich's console, table and panel modules cost start-up (about 100 M instructions, docs/design.md "Imports
and start-up"), and on a pipe what rich draws is plain text. :func:`plain_lines` lays that text out itself,
the same bytes as rich, for the shapes it knows: printable ASCII (one cell a character), tables at their
natural widths, rounded panels that fit their titles. For anything else it answers None and rich draws
(:meth:`slotctl.cli.output.Output.show`, which makes rich's renderables of them). tests/test_layout.py compares the two, byte for byte, at many
widths, on every slot file of tests/data.
"""

from __future__ import annotations

import re
from typing import Iterable

#: what rich reads in a string it renders (a table's cell, header or title, a panel's title): a markup tag
#: or an emoji code (``:name:``). A string with either is left to rich.
_READ_BY_RICH = re.compile(r"\[|:\S*?:")
#: rich's word: spaces, a run of non-spaces, the spaces after it (rich._wrap.re_word)
_WORD = re.compile(r"\s*\S+\s*")


class Text:
    """Text in spans, each a ``str`` or ``(str, style)``, and a style for all of it (rich's
    ``Text.assemble``): shown as it is (no markup read), wrapped between words at the width."""

    __slots__ = ("spans", "style")

    def __init__(self, *spans: str | tuple[str, str], style: str = ""):
        self.spans = spans
        self.style = style

    @property
    def plain(self) -> str:
        return "".join(s if isinstance(s, str) else s[0] for s in self.spans)


class Table:
    """A table of string cells (read as rich markup, as rich reads a cell given as a string).

    ``boxed``: a table of its own (rich's default box without its outer edge, ``title`` above it, aligned
    left), else bare as nested in a panel (no box, one space either side of a cell). ``right``: the columns
    aligned right. ``keep``: the columns never wrapped or cut (all of them when None)."""

    __slots__ = ("columns", "right", "title", "boxed", "keep", "rows")

    def __init__(self, columns: Iterable[str], *, right: Iterable[str] = (), title: str | None = None,
                 boxed: bool = True, keep: Iterable[str] | None = None):
        self.columns = list(columns)
        self.right = set(right)
        self.title = title
        self.boxed = boxed
        self.keep = None if keep is None else tuple(keep)
        self.rows: list[tuple[str, ...]] = []

    def add_row(self, *cells: str) -> None:
        self.rows.append(cells)


class Panel:
    """A rounded box around ``children`` (one under the other), as wide as they need, ``title`` in its top
    edge at the left."""

    __slots__ = ("title", "children")

    def __init__(self, title: str, *children):
        self.title = title
        self.children = children


class Group:
    """Renderables one under the other."""

    __slots__ = ("children",)

    def __init__(self, *children):
        self.children = children


# -- plain --------------------------------------------------------------------------------------
def plain_lines(node, width: int) -> list[str] | None:
    """The lines rich prints for ``node`` on a console of ``width`` cells that draws no styles, or None when
    ``node`` has a shape this layout leaves to rich (text that is not printable ASCII, markup or emoji codes
    where rich reads them, a table wider than the width, a panel too narrow for its title)."""
    if width < 1:
        return None
    if isinstance(node, Text):
        return _text(node.plain, width)
    if isinstance(node, Table):
        return _table(node, width)
    if isinstance(node, Panel):
        return _panel(node, width)
    if isinstance(node, Group):
        return _group(node.children, width, pad=False)
    return None


def _ascii(text: str) -> bool:
    """Every line of ``text`` printable ASCII: one terminal cell a character, nothing rich expands."""
    return text.isascii() and all(line.isprintable() for line in text.split("\n"))


def _literal(text: str) -> bool:
    """Printable ASCII with nothing rich reads as markup or an emoji code."""
    return _ascii(text) and not _READ_BY_RICH.search(text)


def _wrap(line: str, width: int) -> list[str]:
    """One line (printable ASCII) wrapped between words at ``width`` as rich wraps it (rich._wrap.divide_line:
    a word longer than a line is folded), each piece's spaces past the width dropped."""
    breaks: list[int] = []
    offset = 0
    for m in _WORD.finditer(line):
        start, word = m.start(), m.group()
        length = len(word.rstrip())
        if width - offset >= length:
            offset += len(word)
        elif length > width:
            chunks = [word[i:i + width] for i in range(0, len(word), width)]
            for i, chunk in enumerate(chunks):
                if start:
                    breaks.append(start)
                if i == len(chunks) - 1:
                    offset = len(chunk)
                else:
                    start += len(chunk)
        elif offset and start:
            breaks.append(start)
            offset = len(word)
    ends = [0, *breaks, len(line)]
    out = []
    for a, b in zip(ends, ends[1:]):
        piece = line[a:b]
        if len(piece) > width:      # rich's rstrip_end, then its truncate
            spaces = len(piece) - len(piece.rstrip())
            piece = piece[:len(piece) - min(spaces, len(piece) - width)][:width]
        out.append(piece)
    return out


def _text(text: str, width: int, justify: str = "default") -> list[str] | None:
    if not _ascii(text):
        return None
    out = []
    for line in text.split("\n"):
        for piece in _wrap(line, width):
            if justify == "left":
                piece = piece.ljust(width)
            elif justify == "right":
                piece = piece.rstrip().rjust(width)
            out.append(piece)
    return out


def _natural(node) -> int | None:
    """The width ``node`` takes when nothing limits it (rich's maximum measurement), None when it is left to
    rich."""
    if isinstance(node, Text):
        text = node.plain
        return max(map(len, text.split("\n"))) if _ascii(text) else None
    if isinstance(node, Table):
        widths = _column_widths(node)
        if widths is None:
            return None
        return sum(widths) + (len(widths) - 1 if node.boxed else 0)
    if isinstance(node, Group):
        got = [_natural(c) for c in node.children]
        return None if None in got else max(got, default=0)
    return None


def _column_widths(t: Table) -> list[int] | None:
    """Each column's natural width, its padding (a space either side) included."""
    widths = []
    for i, head in enumerate(t.columns):
        cells = [head, *(row[i] for row in t.rows)]
        if not all(_literal(c) for c in cells):
            return None
        widths.append(max(len(line) for c in cells for line in c.split("\n")) + 2)
    if t.title is not None and not _literal(t.title):
        return None
    return widths


def _table(t: Table, width: int) -> list[str] | None:
    """A table at its natural widths (rich shrinks and wraps a table wider than ``width``: left to it)."""
    widths = _column_widths(t)
    if widths is None or not widths:
        return None
    total = sum(widths) + (len(widths) - 1 if t.boxed else 0)
    if total > width:
        return None
    out = []
    if t.boxed and t.title is not None:
        out += _text(t.title, total, "left")
    for n, row in enumerate([tuple(t.columns), *t.rows]):
        cells = [_text(cell, w - 2, "right" if head in t.right else "left")
                 for cell, w, head in zip(row, widths, t.columns)]
        height = max(map(len, cells))
        divider = ("┃" if n == 0 else "│") if t.boxed else ""
        for k in range(height):
            out.append(divider.join(" " + cell[k] + " " if k < len(cell) else " " * w
                                    for cell, w in zip(cells, widths)))
        if n == 0 and t.boxed:
            out.append("╇".join("━" * w for w in widths))
    return out


def _group(children, width: int, *, pad: bool) -> list[str] | None:
    out = []
    for child in children:    # a table wider than the width is left to rich (plain_lines: None)
        lines = _group(child.children, width, pad=pad) if isinstance(child, Group) else plain_lines(child, width)
        if lines is None:
            return None
        out += [line.ljust(width) for line in lines] if pad else lines
    return out


def _panel(p: Panel, width: int) -> list[str] | None:
    """rich's Panel(Group(children), title, title_align="left", expand=False), box ROUNDED, padding (0, 1)."""
    title = p.title
    if "\n" in title or not _literal(title):
        return None
    inner = _natural(Group(*p.children))
    if inner is None or width - 4 < 1:
        return None
    child = min(inner + 2, width - 2)
    child = min(width - 2, max(child, len(title) + 4))
    outer = child + 2
    if outer <= 4 or len(title) + 2 > outer - 4 or child - 2 < 1:
        return None
    body = _group(p.children, child - 2, pad=True)
    if body is None:
        return None
    return (["╭─" + f" {title} ".ljust(outer - 4, "─") + "─╮"]
            + ["│ " + line + " │" for line in body]
            + ["╰" + "─" * (outer - 2) + "╯"])
