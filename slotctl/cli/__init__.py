"""The typer CLI: ``app.py`` wires the commands; each command is a module; ``output.py`` renders."""
