"""Every option shared by several commands, as ``Annotated`` aliases or option factories, defined once with its
default from its home: the panels options are grouped under, output and model options, live mode's (defaults
in :mod:`slotctl.live`), state versions (:mod:`slotctl.format`, :mod:`slotctl.server.flags`), and llama-server's
flags as slotctl takes them (:data:`SERVER_OPTIONS`, :func:`flag_option`; shown as one panel by
:mod:`slotctl.cli.server_panel`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from slotctl.format import SUPPORTED_VERSIONS
from slotctl.format.ggml import CACHE_TYPE_NAMES
from slotctl.live import API_KEY_ENV

# -- the help panels options are grouped under (``rich_help_panel``); options without one come last --

#: the GGUFs a command reads (-m, -md, --mmproj)
MODEL_PANEL = "Model"
#: what the command prints and how (--json, --verbose, ...)
OUTPUT_PANEL = "Output"
#: llama-server's own flags, as the server takes them
SERVER_PANEL = "Server flags"

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (docs/json.md); a failure "
                                                     "is one too.", rich_help_panel=OUTPUT_PANEL)]
JsonlOpt = Annotated[bool, typer.Option("--jsonl", help="Print one JSON object per file, one per line, as each is "
                                                       "done, then a summary line (docs/json.md).",
                                        rich_help_panel=OUTPUT_PANEL)]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Show only the files that are not fine, and the "
                                                              "summary.", rich_help_panel=OUTPUT_PANEL)]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Let logs and llama.cpp's own output through to "
                                          "stderr.", rich_help_panel=OUTPUT_PANEL)]
ModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", help="The target model's GGUF.",
                                                  dir_okay=False, rich_help_panel=MODEL_PANEL)]
DraftModelOpt = Annotated[Optional[Path], typer.Option("--draft-model", "-md", "--spec-draft-model", "--model-draft",
                                                       help="The draft model's GGUF.", dir_okay=False,
                                                       rich_help_panel=MODEL_PANEL)]


SlotOpt = Annotated[int, typer.Option("--slot", min=0, help="The slot (sequence id).")]
StoreTimeoutOpt = Annotated[Optional[float], typer.Option("--timeout", min=0.001, metavar="SECONDS",
                                                          help="With s3:// paths: the whole command's time for its "
                                                               "requests to the store; past it, one error, exit 2 "
                                                               "(docs/store.md).")]

#: ls and validate: the state version of the server the files are judged for (default
#: :data:`slotctl.server.flags.SERVER_STATE_VERSION`)
ServerStateVersionOpt = Annotated[int, typer.Option("--state-version", min=min(SUPPORTED_VERSIONS),
                                                    max=max(SUPPORTED_VERSIONS),
                                                    help="The server's state version: its loader accepts no other "
                                                         "(4: llama.cpp b11434 and later).")]
#: validate, inspect and save: the llama-server build whose rules apply (default
#: :data:`slotctl.server.builds.NEWEST`; live mode learns it from the server's /props)
ServerBuildOpt = Annotated[str, typer.Option("--server-build", metavar="BUILD",
                                             help="The llama-server build whose rules apply: b11669 (reads and "
                                                  "writes the checkpoint and draft-state appendices) or b11434 "
                                                  "(ignores them). With --server, the server's own.")]
#: save: the state version to write (default :data:`slotctl.server.flags.SERVER_STATE_VERSION`)
SaveStateVersionOpt = Annotated[int, typer.Option("--state-version", help="4: what current llama-server reads; "
                                                  "3: what this llama-cpp-python reads.")]
#: convert: the state version to write (default: the file's own)
ConvertStateVersionOpt = Annotated[Optional[int], typer.Option("--state-version", min=min(SUPPORTED_VERSIONS),
                                                               max=max(SUPPORTED_VERSIONS),
                                                               help="Write this state version (exact, or "
                                                                    "refused).")]


def store_option(help: str) -> Any:
    """``--store``: a directory or an ``s3://`` prefix where slot files are kept (keep, migrate; docs/store.md)."""
    return typer.Option("--store", metavar="DIR|s3://BUCKET/PREFIX/", help=help)


# -- live mode: a running llama-server (docs/live.md); defaults in :mod:`slotctl.live` ----------------------

#: the live commands (slots, erase, keep, migrate): the server is the point
ServerOpt = Annotated[str, typer.Option("--server", metavar="URL",
                                        help="The llama-server's base URL, e.g. http://127.0.0.1:8080.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option("--api-key", envvar=API_KEY_ENV, show_envvar=True,
                                                  help="The server's API key (sent as Authorization: Bearer).")]
#: default :data:`slotctl.live.DEFAULT_TIMEOUT`, or :data:`slotctl.live.SLOT_FILE_TIMEOUT` where a request
#: moves a whole slot file
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.001, metavar="SECONDS",
                                           help="Give up on a request after this many seconds.")]
ServerSlotOpt = Annotated[int, typer.Option("--slot", min=0, help="The slot id (0, 1, ...).")]
#: the model a router URL stands for (slotctl.live.router): slot reads and actions name it as the router routes
RouterModelOpt = Annotated[Optional[str], typer.Option("--router-model", metavar="NAME",
                                                       help="The --server is llama-server's router (router mode): "
                                                            "act on this model of it (its name in the router's GET "
                                                            "/models; never loaded by slotctl; docs/fleet.md).")]
#: keep and slots: a TOML configuration file (slotctl.unattended.config)
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", dir_okay=False, metavar="FILE",
                                                  help="A TOML configuration file (docs/fleet.md); flags given here "
                                                       "override it.")]

# ... and their forms for commands that also work without a server (save, restore, validate, ls)

LiveServerOpt = Annotated[Optional[str], typer.Option("--server", metavar="URL",
                                                      help="Act through a running llama-server at this base URL "
                                                           "(live mode, docs/live.md).")]
#: validate and ls: judge the files for a running server (its model and flags) instead of flags given
JudgeServerOpt = Annotated[Optional[str], typer.Option("--server", metavar="URL",
                                                       help="Judge the files for the running llama-server at this "
                                                            "URL: its model, -c and -np from GET /props and /slots "
                                                            "(flags given here win; docs/live.md).")]
LiveTimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.001, metavar="SECONDS",
                                               help="With --server: give up on a request after this many seconds. "
                                                    "Given with s3:// paths: the whole command's time for its "
                                                    "requests to the store (docs/store.md).")]
LiveApiKeyOpt = Annotated[Optional[str], typer.Option("--api-key", envvar=API_KEY_ENV, show_envvar=True,
                                                      help="With --server: the server's API key (sent as "
                                                           "Authorization: Bearer).")]
LocalModelOpt = Annotated[Optional[Path], typer.Option("--model", "-m", dir_okay=False,
                                                       help="The target model's GGUF (llama-server -m); needed "
                                                            "unless --server.")]
ProveOpt = Annotated[bool, typer.Option("--prove", help="With --server: after the restore, send the file's own "
                                        "prompt (nothing generated) and check the server's own counts (timings "
                                        "cache_n, prompt_n) against validate's predicted reuse; needs --slot-dir.")]
SlotDirOpt = Annotated[Optional[Path], typer.Option("--slot-dir", file_okay=False, metavar="DIR",
                                                    help="With --server: the server's --slot-save-path as this "
                                                         "machine sees it (the file is read there: validated "
                                                         "for the server before it is sent; --prove needs it).")]
ForceSendOpt = Annotated[bool, typer.Option("--force", help="With --server --slot-dir: send the file even when "
                                            "validate says the server refuses it or aborts on it.")]
ProveAnywayOpt = Annotated[bool, typer.Option("--prove-anyway", help="With --prove: send the proving request even "
                                              "where it makes the server evaluate the prompt again (recurrent, "
                                              "hybrid, SWA files b11434 keeps no checkpoint of): it spends the "
                                              "restore it proves.")]

# -- llama-server's flags (b11434 names): the server panel's options (save, restore, validate, ls, prune), and
# -- the same flags taken with another meaning (convert's targets) or alone (keep, serve, migrate)


def values_of(field: str) -> Callable[[str], list[str]]:
    """Shell completion for the flag of ``field``: the values it takes
    (:func:`slotctl.server.flags.flag_values`) that begin as typed."""

    def complete(incomplete: str) -> list[str]:
        from slotctl.server.flags import flag_values

        return [v for v in flag_values(field) if v.startswith(incomplete)]

    return complete


#: the server panel's options, one per :class:`~slotctl.server.flags.ServerFlags` field: its type and typer's
#: settings (:func:`slotctl.cli.server_panel.server_flag_params`)
SERVER_OPTIONS: dict[str, tuple[type, dict]] = {
    "ctx_size": (int, dict(min=0, metavar="N", help="Context size in tokens over all slots; 0 = the model's "
                                                     "training context per slot, as the server picks.")),
    "parallel": (int, dict(min=1, max=256, metavar="N", help="Number of slots (n_seq_max).")),
    "kv_unified": (bool, dict(help="One KV cache stream shared by all slots.")),
    "kv_unified_per_slot": (int, dict(min=0, metavar="N", help="Context limit per slot (0 = unset); without -c "
                                                               "the cache holds -np x N.")),
    "cache_type_k": (str, dict(autocompletion=values_of("cache_type_k"), metavar="TYPE",
                               help="K cache type: " + ", ".join(CACHE_TYPE_NAMES) + ".")),
    "cache_type_v": (str, dict(autocompletion=values_of("cache_type_v"), metavar="TYPE",
                               help="V cache type.")),
    "spec_draft_type_k": (str, dict(autocompletion=values_of("spec_draft_type_k"), metavar="TYPE",
                                    help="Draft K cache type (f16 whatever -ctk says).")),
    "spec_draft_type_v": (str, dict(autocompletion=values_of("spec_draft_type_v"), metavar="TYPE",
                                    help="Draft V cache type (f16 whatever -ctv says).")),
    "flash_attn": (str, dict(autocompletion=values_of("flash_attn"), metavar="[on|off|auto]",
                             help="Flash attention (auto is on for the CPU).")),
    "batch_size": (int, dict(min=1, metavar="N", help="Logical batch size.")),
    "ubatch_size": (int, dict(min=1, metavar="N", help="Physical batch size.")),
    "swa_full": (bool, dict(help="Full-size SWA cache (off in the server).")),
    "ctx_checkpoints": (int, dict(min=0, metavar="N", help="Checkpoints the server keeps per slot; the oldest "
                                                           "beyond are dropped.")),
    "checkpoint_min_step": (int, dict(min=0, metavar="N", help="The server's least spacing of the checkpoints it "
                                                               "takes, in tokens.")),
    "spec_draft_n_max": (int, dict(min=0, metavar="N", help="Tokens the draft proposes per step (restore).")),
    "spec_type": (Optional[str], dict(metavar="TYPES", help="Speculative types, comma-separated (draft-simple, "
                                      "draft-eagle3, draft-mtp, ngram-mod, ...; default none). With -md and "
                                      "none of them the server loads the draft model and builds no draft "
                                      "context (only MTP heads, dflash and dspark are inferred from the GGUF).")),
    "threads": (int, dict(min=0, metavar="N", help="CPU threads; 0 = every core. Speed only: nothing saved "
                                                   "depends on it.")),
}


def flag_option(field: str, **opts: Any) -> Any:
    """A typer option spelled as llama-server spells the :class:`~slotctl.server.flags.ServerFlags` field
    ``field`` (every spelling of :data:`~slotctl.server.flags.FLAGS`, the long one shown first): the server
    panel and a command that takes some of the same flags with another meaning (``convert``'s targets)."""
    from slotctl.server.flags import FLAGS, NEGATED_FLAGS

    spellings = FLAGS[field]
    long = spellings[1] if len(spellings) > 1 else spellings[0]
    decls = [long, *[x for x in spellings if x != long]]
    negated = NEGATED_FLAGS.get(field, ())
    if negated:  # each spelling with its negation, as b11434 pairs them (-kvu/-no-kvu), the long one first
        decls = sorted((f"{a}/{b}" for a, b in zip(spellings, negated)), key=lambda d: not d.startswith("--"))
    return typer.Option(*decls, **opts)


# -- the long-running commands (keep, serve: docs/fleet.md, docs/serve.md) -----------------------------------

#: keep: the server kept; serve: the server served (each, or the configuration file's)
KeepServerOpt = Annotated[Optional[str], typer.Option("--server", metavar="URL",
                                                      help="The llama-server's base URL, e.g. http://127.0.0.1:8080 "
                                                           "(or the configuration's).")]
UpstreamOpt = Annotated[Optional[str], typer.Option("--upstream", metavar="URL",
                                                    help="The llama-server (or llama-swap) to serve, e.g. "
                                                         "http://127.0.0.1:8080 (or the configuration's).")]
KeptSlotDirOpt = Annotated[Optional[Path], typer.Option("--slot-dir", file_okay=False, metavar="DIR",
                                                        help="The server's --slot-save-path as this machine sees "
                                                             "it.")]
KeptStoreOpt = Annotated[Optional[str], store_option("Where the states are kept: a directory or an s3:// prefix "
                                                     "(docs/store.md; default: --slot-dir itself).")]
#: the store's budget (default: the configuration file's max_size)
StoreBudgetOpt = Annotated[Optional[str], typer.Option("--max-size", metavar="SIZE",
                                                       help="Keep the store under SIZE (20G, 500M) by prune's rules, "
                                                            "least recently used first.")]
#: the store's catalog: its verdicts and the stored states' tokens (slotctl.keeping.states)
StoreCatalogOpt = Annotated[bool, typer.Option("--no-cache", help="Do not use the store's catalog (its SQLite index "
                                               "of the stored states' tokens and verdicts): read and judge every "
                                               "stored state again.")]
LeaseOpt = Annotated[Optional[float], typer.Option("--lease", min=2.0, max=86400.0, metavar="SECONDS",
                                                   help="With an s3:// store: seconds the process's lease holds "
                                                        "without a renewal [default: 60].")]
#: default :data:`slotctl.live.SLOT_FILE_TIMEOUT` (a save or restore moves a whole slot file)
KeptTimeoutOpt = Annotated[Optional[float], typer.Option("--timeout", min=0.001, max=86400.0, metavar="SECONDS",
                                                         help="Give up on a request to the server (a save, a "
                                                              "restore) after this many seconds [default: 600].")]
EventsJsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON line per event on stdout (docs/json.md) "
                                             "instead of log lines on stderr.")]
#: the server's flags it does not report, as given (its saves say them and win: slotctl.server.saved)
UnreportedKvuOpt = Annotated[bool, typer.Option("--kv-unified", "-kvu", help="The server runs with -kvu (not "
                                                "reported by the server; learnt from its saves, which win): "
                                                "states are judged, and converted, for it.")]
#: ``UnreportedCtkOpt``, ``UnreportedCtvOpt``: -ctk/-ctv spelled as the server spells them (:func:`flag_option`),
#: made on first use (:func:`__getattr__`: the flag tables are read only by the commands that take them)
_UNREPORTED_TYPES = {"UnreportedCtkOpt": ("cache_type_k", "-ctk"), "UnreportedCtvOpt": ("cache_type_v", "-ctv")}
ServerDraftModelOpt = Annotated[Optional[Path], typer.Option(
    "--draft-model", "-md", dir_okay=False, metavar="GGUF",
    help="The server's draft model (-md; no server reports it): a state that carries a draft state is restored "
         "only into a server whose draft model is this one's content.")]
# keep's own
EveryOpt = Annotated[Optional[float], typer.Option("--every", min=0.05, max=86400.0, metavar="SECONDS",
                                                   help="Seconds between two looks at the server [default: 30].")]
MinTokensOpt = Annotated[Optional[int], typer.Option("--min-tokens", min=1, max=1 << 24, metavar="N",
                                                     help="Save only slots whose last prompt had at least N tokens "
                                                          "[default: 1].")]
KeepNewestOpt = Annotated[Optional[int], typer.Option("--keep-newest", min=1, max=1 << 20, metavar="N",
                                                      help="Keep only the newest N states of each slot and model "
                                                           "(older ones deleted after each new state).")]
ProveRestoresOpt = Annotated[Optional[bool], typer.Option("--prove/--no-prove", help="Prove each restore with the "
                                                          "server's own counts [default: --prove].")]
KeepListenOpt = Annotated[Optional[str], typer.Option("--listen", metavar="HOST:PORT",
                                                      help="Serve /metrics, /livez, /readyz and the slots' page /ui "
                                                           "there (loopback unless a host is given).")]
SaveAllOpt = Annotated[bool, typer.Option("--save-all", help="One pass, then exit: save every idle slot whose state "
                                          "the store does not have (llama-swap's cmdStop).")]
RestoreAllOpt = Annotated[bool, typer.Option("--restore-all", help="One pass, then exit: restore (and prove) every "
                                             "empty slot from the store.")]
ForceRestoreOpt = Annotated[bool, typer.Option("--force", help="Restore a stored state even when validate says the "
                                               "server now running refuses it or aborts on it.")]
AllowLossyOpt = Annotated[bool, typer.Option("--allow-lossy", help="Re-encode a stored state's cache rows when the "
                                             "server's cache types changed (lossy).")]
# serve's own
ServeListenOpt = Annotated[Optional[str], typer.Option("--listen", metavar="HOST:PORT",
                                                       help="Where serve listens (port 0: any free port, said on "
                                                            "the first line) [default: 127.0.0.1:8081].")]
MetricsListenOpt = Annotated[Optional[str], typer.Option("--metrics-listen", metavar="HOST:PORT",
                                                         help="Serve /metrics, /livez and /readyz there, apart from "
                                                              "the proxy (loopback unless a host is given).")]
MinGainOpt = Annotated[Optional[int], typer.Option("--min-gain", min=1, metavar="N",
                                                   help="Restore a stored state only when it keeps at least N "
                                                        "prompt tokens more than the slot holds [default: 16].")]
RestorePolicyOpt = Annotated[Optional[str], typer.Option("--restore-policy", metavar="POLICY",
                                                         help="cost: restore a stored state only when the restore "
                                                              "is predicted faster than the prefill it spares "
                                                              "(measured); tokens: whenever it keeps --min-gain "
                                                              "tokens more [default: cost].")]
MaxConnectionsOpt = Annotated[Optional[int], typer.Option("--max-connections", min=1, max=1 << 20, metavar="N",
                                                          help="Clients' connections at once (fewer when the "
                                                               "descriptor limit cannot hold them); at the limit the "
                                                               "one idle the longest is closed [default: 4096].")]
IdleTimeoutOpt = Annotated[Optional[float], typer.Option("--idle-timeout", min=0.1, max=86400.0, metavar="SECONDS",
                                                         help="Close a client's connection that has no request in "
                                                              "progress for this long, or that stops sending its "
                                                              "headers or body [default: 30].")]
MaxBodyOpt = Annotated[Optional[str], typer.Option("--max-body", metavar="SIZE",
                                                   help="Read a completion's body to cache it up to this size; a "
                                                        "larger one goes to the server as it comes, uncached "
                                                        "[default: 8M].")]

# -- directories: ls and prune ----------------------------------------------------------------------------

FileCatalogOpt = Annotated[bool, typer.Option("--no-cache", help="Read every file: do not use the catalog (what "
                                              "reading each unchanged file found, kept by ls and prune under the "
                                              "user's cache directory).")]
PruneMaxSizeOpt = Annotated[Optional[str], typer.Option("--max-size", metavar="SIZE",
                                                        help="Delete least recently used files until the directory "
                                                             "holds at most SIZE (20G, 500M, bytes).")]


def __getattr__(name: str) -> Any:
    """The aliases made on first use (:data:`_UNREPORTED_TYPES`)."""
    if name in _UNREPORTED_TYPES:
        field, said = _UNREPORTED_TYPES[name]
        alias = Annotated[Optional[str], flag_option(field, help=f"The server's {said} (not reported; learnt from "
                                                                 f"its saves, which win; default f16).")]
        globals()[name] = alias
        return alias
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
