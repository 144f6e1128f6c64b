"""slotctl: a toolkit for llama.cpp server slot files."""

__version__ = "0.1.0"
