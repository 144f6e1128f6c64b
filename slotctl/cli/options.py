"""Options shared by several commands, as ``Annotated`` aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (keys in docs/json.md).")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Let logs and llama.cpp's own output through to stderr.")]
ModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", help="The target model's GGUF.",
                                                  dir_okay=False)]
DraftModelOpt = Annotated[Optional[Path], typer.Option("--draft-model", "-md", "--spec-draft-model", "--model-draft",
                                                       help="The draft model's GGUF.", dir_okay=False)]
