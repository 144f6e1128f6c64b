"""Plain conversion of command-line values, so that a command's start-up does not import pydantic.

typer 0.29 converts every value through a pydantic ``TypeAdapter``, text included (its ``parser=`` hook
builds one too); importing pydantic (and through pydantic-core, asyncio and ssl) costs more than the rest of
``slotctl inspect FILE``. slotctl's parameters are plain: text, whole numbers and numbers with bounds,
flags and paths, alone or in lists. :func:`lighten` reads each parameter's annotation and its
``typer.Option``/``typer.Argument`` settings from the command function's own signature and gives the
parameter click's public ``process_value`` hook, converting and checking the same things without pydantic
(:class:`Plain`).

What this relies on from typer beyond its documented API, here and nowhere else in slotctl (the one place;
tests/test_typer_seam.py fails, naming the fact, when a typer release changes one of them):

- ``typer.models.ParameterInfo``: the class of what ``typer.Option(...)``/``typer.Argument(...)`` return,
  with the settings read here (``min``, ``max``, ``clamp``, ``parser``, ``exists``, ``file_okay``,
  ``dir_okay``, ``readable``, ``writable``, ``resolve_path``, ``allow_dash``); typer documents the
  arguments, not the object;
- the parameter objects a command holds are instances of plain classes whose ``process_value(ctx, value)``
  click calls for every value: :func:`lighten_param` gives each a subclass overriding it (``__class__``
  swapped in place: the subclass adds no slots, so the instance's layout stays the same).

tests/test_startup.py checks that every parameter of every command is plain, the conversions, and the
modules each command imports.
"""

from __future__ import annotations

import inspect
import os
import stat
from dataclasses import dataclass
from pathlib import PurePath
from typing import Annotated, Any, Callable, Union, get_args, get_origin

import typer
from typer.models import ParameterInfo

#: the attribute a plain parameter carries its :class:`Plain` in
SPEC = "slotctl_plain"


#: the longest number a value may be written as: every number slotctl takes fits in 64 bits (20 digits); a
#: float may have more digits, never thousands. Longer text is refused by its length, not converted
MAX_NUMBER_CHARS = 64


class MissingValue(typer.BadParameter):
    """A required argument or option was not given (raised by a plain parameter)."""


@dataclass(frozen=True)
class Plain:
    """How one parameter converts: its leaf type, whether it takes many values, its typer settings."""

    leaf: type
    many: bool = False
    info: ParameterInfo | None = None

    def convert(self, value: Any, param, ctx) -> Any:
        if value is None:
            return () if self.many else None
        if self.many:
            if isinstance(value, str):
                raise typer.BadParameter("expected several values", ctx=ctx, param=param)
            items = value if isinstance(value, (list, tuple)) else [value]
            return [self.one(v, param, ctx) for v in items]
        return self.one(value, param, ctx)

    def one(self, value: Any, param, ctx) -> Any:
        leaf, info = self.leaf, self.info
        if leaf is str:
            return value if isinstance(value, str) else str(value)
        if leaf is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on", "y", "t"):
                return True
            if text in ("", "0", "false", "no", "off", "n", "f"):
                return False
            raise typer.BadParameter(f"expected a flag value, got {value!r}", ctx=ctx, param=param)
        if leaf in (int, float):
            if isinstance(value, str) and len(value.strip()) > MAX_NUMBER_CHARS:   # refused before any conversion
                raise typer.BadParameter(f"expected {'a whole number' if leaf is int else 'a number'}, got "
                                         f"{len(value.strip()):,} characters", ctx=ctx, param=param)
            try:
                n = leaf(value) if not isinstance(value, str) or leaf is float else int(value.strip(), 10)
            except (TypeError, ValueError):
                raise typer.BadParameter("expected a whole number" if leaf is int else "expected a number",
                                         ctx=ctx, param=param) from None
            lo, hi = (info.min, info.max) if info is not None else (None, None)
            if info is not None and info.clamp:
                return leaf(min(max(n, lo if lo is not None else n), hi if hi is not None else n))
            if lo is not None and n < lo:
                raise typer.BadParameter(f"expected {lo} or more", ctx=ctx, param=param)
            if hi is not None and n > hi:
                raise typer.BadParameter(f"expected {hi} or less", ctx=ctx, param=param)
            return n
        if isinstance(value, str):
            _check_url(value, param, ctx)
        return self.path(value if isinstance(value, leaf) else leaf(os.fspath(value)), param, ctx)

    def path(self, value: PurePath, param, ctx) -> PurePath:
        """typer's checks of a path option (exists, file_okay, dir_okay, readable, writable, resolve_path,
        allow_dash), said the same way."""
        info = self.info
        if info is None or (info.file_okay and info.allow_dash and str(value) == "-"):
            return value
        real = os.path.realpath(value) if info.resolve_path else os.fspath(value)
        label = path_kind(info)
        try:
            st = os.stat(real)
        except OSError:
            if info.exists:
                raise typer.BadParameter(f"{label} {str(value)!r} does not exist", ctx=ctx, param=param) from None
            return type(value)(real)
        where = repr(str(value))
        if not info.file_okay and stat.S_ISREG(st.st_mode):
            raise typer.BadParameter(f"{label} {where} is a file", ctx=ctx, param=param)
        if not info.dir_okay and stat.S_ISDIR(st.st_mode):
            raise typer.BadParameter(f"{label} {where} is a directory", ctx=ctx, param=param)
        if info.readable and not os.access(real, os.R_OK):
            raise typer.BadParameter(f"{label} {where} is not readable", ctx=ctx, param=param)
        if info.writable and not os.access(real, os.W_OK):
            raise typer.BadParameter(f"{label} {where} is not writable", ctx=ctx, param=param)
        return type(value)(real)


def _check_url(text: str, param, ctx) -> None:
    """A usage error for a store URL without a bucket (``s3:///x.bin``): a path collapses its slashes
    (``s3:/x.bin``), which would read as bucket ``x.bin``."""
    scheme, sep, rest = text.partition("://")
    if sep and rest.startswith("/") and scheme.isalnum():
        from slotctl.sources import SCHEMES

        if scheme in SCHEMES:
            raise typer.BadParameter(f"{text}: no bucket (expected {scheme}://BUCKET/KEY)", ctx=ctx, param=param)


def path_kind(info: ParameterInfo | None) -> str:
    """``file``, ``dir`` or ``path``: what a path parameter takes."""
    if info is None:
        return "path"
    if info.file_okay and not info.dir_okay:
        return "file"
    if info.dir_okay and not info.file_okay:
        return "dir"
    return "path"


def plain_of(annotation: Any, info: ParameterInfo | None = None) -> Plain | None:
    """The :class:`Plain` of a parameter annotated ``annotation`` (``Annotated``, ``Optional`` and
    ``list`` unwrapped), or None when it is not plain."""
    if get_origin(annotation) is Annotated:
        annotation, *meta = get_args(annotation)
        info = next((m for m in meta if isinstance(m, ParameterInfo)), info)
    if get_origin(annotation) is Union:
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            return None
        (annotation,) = args
    many = get_origin(annotation) is list
    if many:
        (annotation,) = get_args(annotation) or (None,)
    if info is not None and info.parser is not None:
        return None
    if annotation in (str, int, float, bool) or (isinstance(annotation, type) and issubclass(annotation, PurePath)):
        return Plain(annotation, many, info)
    return None


def signature_plains(fn: Callable) -> dict[str, Plain]:
    """Each parameter of the command function ``fn`` that is plain, by name (the name typer gives it)."""
    plains = {}
    for p in inspect.signature(fn, eval_str=True).parameters.values():
        info = p.default if isinstance(p.default, ParameterInfo) else None
        plain = plain_of(p.annotation, info)
        if plain is not None:
            plains[p.name] = plain
    return plains


def _process_value(self, ctx, value: Any) -> Any:
    """click's public ``Parameter.process_value``, for a plain parameter: convert with its :class:`Plain`,
    then the required check and the callback, as click's own does."""
    value = getattr(self, SPEC).convert(value, self, ctx)
    if self.required and (value is None or value in ((), [])):
        raise MissingValue("missing", ctx=ctx, param=self)
    if self.callback is not None:
        value = self.callback(ctx, self, value)
    return value


#: typer's parameter class -> its plain subclass (one base, no slots: the instance's layout stays the same,
#: so a parameter typer built can take it in place)
_CLASSES: dict[type, type] = {}


def lighten(cmd, fn: Callable | None = None):
    """Give every plain parameter of ``cmd`` (a command built from function ``fn``) the pydantic-free
    converter, in place; a flag needs no signature. Returns ``cmd``."""
    plains = signature_plains(fn) if fn is not None else {}
    for p in cmd.params:
        lighten_param(p, plains.get(p.name))
    return cmd


def lighten_param(p, plain: Plain | None = None):
    """One parameter given the pydantic-free converter (in place): ``plain``, or for a flag (typer's help,
    completion and version options) a bool. Returns ``p``."""
    if plain is None and getattr(p, "is_flag", False) and not getattr(p, "count", False):
        plain = Plain(bool)
    if plain is None or type(p) in _CLASSES.values():
        return p
    cls = type(p)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls,), {"process_value": _process_value})
    p.__class__ = _CLASSES[cls]
    setattr(p, SPEC, plain)
    return p


def plain(p) -> Plain | None:
    """The :class:`Plain` a parameter converts with, or None (typer's own converter, pydantic)."""
    return getattr(p, SPEC, None) if type(p) in _CLASSES.values() else None
