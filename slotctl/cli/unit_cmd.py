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
    json_out: JsonOpt = False,
) -> None:
    """Print a systemd unit file shipped with slotctl: keep's or serve's template, one instance per configuration file.

    slotctl unit keep prints slotctl-keep@.service (Type=notify, WatchdogSec), whose instance NAME runs
    slotctl keep --config /etc/slotctl/NAME.toml. Install it with: slotctl unit keep | sudo tee
    /etc/systemd/system/slotctl-keep@.service. slotctl unit serve prints slotctl-serve@.service, whose
    instance NAME runs slotctl serve --config /etc/slotctl/NAME.toml. Details: docs/fleet.md,
    docs/serve.md.

    Exit codes: 0 printed; 2 no such unit. --json: {name, file, text, exit_code}.
    """
    import sys

    from slotctl.unattended.systemd import UNITS, unit_text

    text = unit_text(name)
    if json_out:
        Output(json_mode=True).json({"name": name, "file": UNITS[name], "text": text, "exit_code": 0})
        return
    sys.stdout.write(text)
