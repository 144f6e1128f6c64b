"""Plain conversion of command-line values, so that a command's start-up does not import pydantic.

typer 0.29 converts every value through a pydantic ``TypeAdapter``; importing pydantic (and through
pydantic-core, asyncio and ssl) costs more than the rest of ``slotctl inspect FILE``. slotctl's
parameters are plain: text, whole numbers with bounds, numbers, flags and paths, alone or in lists.
:func:`lighten` gives each such parameter a converter that checks the same things without pydantic;
any other parameter keeps typer's own. typer is pinned below 0.30 in pyproject.toml, and
tests/test_startup.py checks both the conversions and the modules each command imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, get_args, get_origin

from typer import _click as click
from typer._coercion import RuntimeParam
from typer._param_types import coerce_cli_path

_BadParameter = click.exceptions.BadParameter


def lighten(cmd: click.Command) -> click.Command:
    """Give every plain parameter of ``cmd`` a pydantic-free converter (in place); returns ``cmd``."""
    for p in cmd.params:
        lighten_param(p)
    return cmd


def lighten_param(p: click.Parameter) -> click.Parameter:
    """One parameter given a pydantic-free converter when it is plain (in place); returns ``p``."""
    desc = getattr(p, "type_descriptor", None)
    if desc is None or getattr(p, "_runtime_param", None) is not None or desc.file_annotation is not None:
        return p
    info = desc.parameter_info
    if getattr(info, "parser", None) is not None or getattr(info, "click_type", None) is not None:
        return p
    ann = desc.annotation
    if get_origin(ann) is list:
        (ann,) = get_args(ann) or (None,)
    if _leaf(ann) is not None:
        p._runtime_param = _PlainParam(parameter_info=info, annotation=desc.annotation, leaf=ann)
    return p


def _leaf(ann: Any):
    if ann in (str, int, float, bool):
        return ann
    if isinstance(ann, type) and issubclass(ann, PurePath):
        return ann
    return None


@dataclass(frozen=True)
class _PlainParam(RuntimeParam):
    leaf: Any = None

    def _coerce_value(self, value: Any, param, ctx) -> Any:
        if get_origin(self.annotation) is list:
            items = value if isinstance(value, (list, tuple)) else [value]
            return [self._one(v, param, ctx) for v in items]
        return self._one(value, param, ctx)

    def _one(self, value: Any, param, ctx) -> Any:
        leaf, info = self.leaf, self.parameter_info
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
            raise _BadParameter(f"expected a flag value, got {value!r}", ctx=ctx, param=param)
        if leaf in (int, float):
            try:
                n = leaf(value) if not isinstance(value, str) or leaf is float else int(value.strip(), 10)
            except (TypeError, ValueError):
                raise _BadParameter("expected a whole number" if leaf is int else "expected a number",
                                    ctx=ctx, param=param) from None
            lo, hi = info.min, info.max
            if getattr(info, "clamp", False):
                return leaf(min(max(n, lo if lo is not None else n), hi if hi is not None else n))
            if lo is not None and n < lo:
                raise _BadParameter(f"expected {lo} or more", ctx=ctx, param=param)
            if hi is not None and n > hi:
                raise _BadParameter(f"expected {hi} or less", ctx=ctx, param=param)
            return n
        # a path: typer's own checks (exists, file_okay, dir_okay, ...) once the value is a Path
        return coerce_cli_path(value if isinstance(value, leaf) else leaf(value), info, path_type=leaf,
                               param=param, ctx=ctx)
