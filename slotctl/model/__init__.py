"""The model's side: what a GGUF says about a model's memory, and what it predicts a slot file to hold.

- ``info``: :func:`~slotctl.model.info.read_model_info` reads a GGUF's header into a
  :class:`~slotctl.model.info.ModelInfo` (per-architecture rules of ``llama_model::load_hparams``) and its
  memory layout;
- ``settings``: :class:`~slotctl.model.settings.ContextSettings`, the options a llama.cpp context is built
  with (the server derives them from its flags: :class:`slotctl.server.flags.ServerFlags`);
- ``predict``: :func:`~slotctl.model.predict.predict`, the memory a context built with those settings
  writes and its loader checks.

Pure Python (gguf's reader, no llama.cpp), and imports nothing above it: not the server, the runtime or
the CLI. Importing this package imports none of its modules.
"""
