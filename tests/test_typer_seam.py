"""The facts about typer that slotctl relies on beyond its documented API, all used in one place
(slotctl/cli/params.py, its docstring lists them): each test fails, naming the fact, when a typer release
changes it."""

from __future__ import annotations

import inspect

import pytest
import typer
from typer.models import ParameterInfo

from slotctl.cli.params import MissingValue, lighten, plain

SETTINGS = ("min", "max", "clamp", "parser", "exists", "file_okay", "dir_okay", "readable", "writable",
            "resolve_path", "allow_dash")


def test_option_and_argument_return_parameter_infos_with_the_settings_read():
    for made in (typer.Option("--x", min=1, max=3, clamp=True), typer.Argument(exists=True, allow_dash=True)):
        assert isinstance(made, ParameterInfo), "typer.Option/Argument no longer return a typer.models.ParameterInfo"
        missing = [s for s in SETTINGS if not hasattr(made, s)]
        assert not missing, f"ParameterInfo lost settings params.py reads: {missing}"
    o = typer.Option("--x", min=1, max=3, clamp=True)
    assert (o.min, o.max, o.clamp) == (1, 3, True)


def _command():
    app = typer.Typer(add_completion=False)

    @app.command()
    def cmd(n: int = typer.Option(1, "--n", min=1, max=5), name: str = typer.Option(..., "--name")):
        print(n * 2, name)

    return app, cmd


def test_the_swapped_parameter_class_converts_every_value(capsys):
    """A parameter's class replaced in place by a subclass overriding process_value: click calls it, and
    the instance keeps working (no slots added)."""
    app, fn = _command()
    cmd = lighten(typer.main.get_command(app), fn)
    params = {p.name: p for p in cmd.params}
    assert plain(params["n"]) is not None and plain(params["name"]) is not None, \
        "the parameter classes can no longer be swapped for plain ones"
    assert all(type(p).process_value is not type(p).__mro__[1].process_value for p in params.values())
    assert "process_value" in {n for n, _ in inspect.getmembers(type(params["n"]).__mro__[1])}, \
        "click's Parameter no longer has process_value"
    cmd.main(["--n", "4", "--name", "x"], standalone_mode=False)
    assert capsys.readouterr().out == "8 x\n"
    with pytest.raises(typer.BadParameter, match="expected 5 or less"):   # the plain converter's words
        cmd.main(["--n", "9", "--name", "x"], standalone_mode=False)
    with pytest.raises(typer.BadParameter):
        cmd.main(["--n", "2"], standalone_mode=False)
    assert issubclass(MissingValue, typer.BadParameter)
