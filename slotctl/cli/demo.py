"""``slotctl demo``: placeholder replaced below."""
import typer
def register(app: typer.Typer) -> None:
    pass
