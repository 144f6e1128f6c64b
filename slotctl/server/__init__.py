"""The server's side: what llama-server does with a slot file, written once, read by every command.

- ``flags``: :class:`~slotctl.server.flags.ServerFlags`, the server's flags and defaults (b11434 names), the
  checks its own parsers make, the environment switches it reads;
- ``restore``: each step of ``POST /slots/ID?action=restore`` as a function returning a typed outcome
  (restored / absent / ignored / dropped / refused / aborts, bytes consumed, the server's message), with the
  llama.cpp function it follows; the token-validity rule;
- ``checkpoints``: what a context checkpoint is, how many the server keeps, where it takes them and which
  one it rolls back to;
- ``requests``: what it refuses of a completion request before evaluating it;
- ``findings``: what the server refuses, drops or ignores in a file, found from its structure alone;
- ``reuse``: how many prompt tokens a restored slot keeps for the next request;
- ``speculative``: the draft model's live state;
- ``filenames``: the slot file names the server accepts (``fs_validate_filename``).

Talking to a running server (its HTTP API, what slotctl learns from it) is :mod:`slotctl.live`, above
this package: these are the server's rules, that is how slotctl reaches one.

The rule for where a server rule goes: here, once, in the module of the step it belongs to, with a comment
naming the llama.cpp function (or upstream change) it follows. :mod:`slotctl.runtime` executes these
rules in real contexts, :mod:`slotctl.validate` predicts them, the CLI only passes flags in and results
out. Nothing here imports llama.cpp, the runtime, validate or the CLI. Importing this package imports none
of its modules.
"""
