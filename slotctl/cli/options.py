"""Options shared by several commands, as ``Annotated`` aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

# -- the help panels options are grouped under (``rich_help_panel``); options without one come last --

#: the GGUFs a command reads (-m, -md, --mmproj)
MODEL_PANEL = "Model"
#: what the command prints and how (--json, --verbose, ...)
OUTPUT_PANEL = "Output"
#: llama-server's own flags, as the server takes them
SERVER_PANEL = "Server flags"

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (keys in docs/json.md).",
                                       rich_help_panel=OUTPUT_PANEL)]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Let logs and llama.cpp's own output through to "
                                          "stderr.", rich_help_panel=OUTPUT_PANEL)]
ModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", help="The target model's GGUF.",
                                                  dir_okay=False, rich_help_panel=MODEL_PANEL)]
DraftModelOpt = Annotated[Optional[Path], typer.Option("--draft-model", "-md", "--spec-draft-model", "--model-draft",
                                                       help="The draft model's GGUF.", dir_okay=False,
                                                       rich_help_panel=MODEL_PANEL)]


# -- llama-server's context flags (b11434 common/arg.cpp names), shared by save, restore and validate --

CtxSizeOpt = Annotated[int, typer.Option("--ctx-size", "-c", min=0,
                                         help="Context size in tokens over all slots; 0 = the model's training context "
                                              "per slot, as the server picks.")]
ParallelOpt = Annotated[int, typer.Option("--parallel", "-np", min=1, max=256, help="Number of slots (n_seq_max).")]
KvUnifiedOpt = Annotated[bool, typer.Option("--kv-unified", "-kvu",
                                            help="One KV cache stream shared by all slots.")]
CacheTypeKOpt = Annotated[str, typer.Option("--cache-type-k", "-ctk", help="K cache type (f16, q8_0, ...).")]
CacheTypeVOpt = Annotated[str, typer.Option("--cache-type-v", "-ctv", help="V cache type.")]
DraftCacheTypeKOpt = Annotated[str, typer.Option("--spec-draft-type-k", "-ctkd", "--cache-type-k-draft",
                                                 help="Draft K cache type (the server's default is f16, "
                                                      "whatever -ctk says).")]
DraftCacheTypeVOpt = Annotated[str, typer.Option("--spec-draft-type-v", "-ctvd", "--cache-type-v-draft",
                                                 help="Draft V cache type (default f16).")]
FlashAttnOpt = Annotated[str, typer.Option("--flash-attn", "-fa", help="on, off or auto (auto is on for the CPU).")]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Logical batch size.")]
UBatchOpt = Annotated[int, typer.Option("--ubatch-size", "-ub", min=1, help="Physical batch size.")]
SwaFullOpt = Annotated[bool, typer.Option("--swa-full", help="Full-size SWA cache (off in the server).")]
SlotOpt = Annotated[int, typer.Option("--slot", min=0, help="The slot (sequence id).")]
CtxCheckpointsOpt = Annotated[int, typer.Option("--ctx-checkpoints", "-ctxcp", min=0,
                                                help="Checkpoints the server keeps per slot (server default 32); "
                                                     "the oldest beyond are dropped.")]
DraftNMaxOpt = Annotated[int, typer.Option("--spec-draft-n-max", min=0,
                                           help="Tokens the draft proposes per step (server default 3).")]
ThreadsOpt = Annotated[int, typer.Option("--threads", "-t", min=0, help="CPU threads; 0 = every core. "
                                        "Speed only: nothing saved depends on it.")]


def context_settings(*, ctx_size: int, parallel: int, kv_unified: bool, cache_type_k: str, cache_type_v: str,
                     flash_attn: str, batch_size: int = 2048, ubatch_size: int = 512, swa_full: bool = False):
    """The flags as a :class:`~slotctl.model.settings.ContextSettings`; bad values are usage errors."""
    from slotctl.errors import UsageError
    from slotctl.model.settings import ContextSettings

    try:
        return ContextSettings(n_ctx=ctx_size, n_parallel=parallel, kv_unified=kv_unified, type_k=cache_type_k,
                               type_v=cache_type_v, flash_attn=flash_attn, n_batch=batch_size,
                               n_ubatch=ubatch_size, swa_full=swa_full)
    except ValueError as e:
        raise UsageError(str(e)) from None
