"""``slotctl unit NAME``: print a systemd unit file shipped with slotctl (:mod:`slotctl.unattended.systemd`)."""

from __future__ import annotations

from typing import Annotated

import typer

from slotctl.cli.common import handle_errors


def register(app: typer.Typer) -> None:
    app.command("unit")(unit)


@handle_errors
def unit(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The unit: keep (slotctl-keep@.service).")] = "keep",
) -> None:
    """Print a systemd unit file shipped with slotctl: keep's template, one instance per configuration file.

    slotctl unit keep prints slotctl-keep@.service (Type=notify, WatchdogSec), whose instance NAME runs
    slotctl keep --config /etc/slotctl/NAME.toml. Install it with: slotctl unit keep | sudo tee
    /etc/systemd/system/slotctl-keep@.service. Details: docs/fleet.md.

    Exit codes: 0 printed; 2 no such unit.
    """
    import sys

    from slotctl.unattended.systemd import unit_text

    sys.stdout.write(unit_text(name))
