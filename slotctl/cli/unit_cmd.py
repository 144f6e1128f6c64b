"""``slotctl unit NAME``: print a systemd unit file shipped with slotctl (:mod:`slotctl.unattended.systemd`)."""

from __future__ import annotations

from typing import Annotated

import typer

from slotctl.cli.common import handle_errors
from slotctl.cli.options import JsonOpt
from slotctl.cli.output import Output


def register(app: typer.Typer) -> None:
    app.command("unit")(unit)


@handle_errors
def unit(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The unit: keep (slotctl-keep@.service) or serve "
                                        "(slotctl-serve@.service).")] = "keep",
    user: Annotated[str, typer.Option("--user", metavar="USER", help="The user the unit runs as: the one "
                                      "llama-server runs as (its slot directory). The unit says how to make it "
                                      "when it is missing.")] = "llama",
    json_out: JsonOpt = False,
) -> None:
    """Print a systemd unit file shipped with slotctl: keep's or serve's template, one instance per configuration file.

    slotctl unit keep prints slotctl-keep@.service (Type=notify, WatchdogSec), whose instance NAME runs
    slotctl keep --config /etc/slotctl/NAME.toml with the Python of the install this command runs from, by
    its absolute path (a venv or pipx install: systemd's PATH does not find its slotctl), as --user (a
    missing user: the unit's first lines say how to make it), the catalog in /var/cache/slotctl
    (CacheDirectory=), LimitNOFILE=65536. Install it with: slotctl unit keep | sudo tee
    /etc/systemd/system/slotctl-keep@.service. slotctl unit serve prints slotctl-serve@.service, whose
    instance NAME runs slotctl serve --config /etc/slotctl/NAME.toml. What would keep the unit from
    starting on this machine (the user missing, or unable to read the install; serve's extra missing) is
    said on stderr, one note a line. Details: docs/fleet.md, docs/serve.md.

    Exit codes: 0 printed; 2 no such unit, a bad --user. --json: {name, file, text, python, user, notes,
    exit_code}.
    """
    import sys

    from slotctl.unattended.systemd import UNITS, interpreter, notes, unit_text

    python = interpreter()
    text = unit_text(name, python=python, user=user)
    said = notes(name, python=python, user=user)
    out = Output(json_mode=json_out)
    if json_out:
        out.json({"name": name, "file": UNITS[name], "text": text, "python": python, "user": user, "notes": said,
                  "exit_code": 0})
        return
    sys.stdout.write(text)
    for note in said:
        out.note(note)
