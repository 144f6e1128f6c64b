"""A slot file written by a real llama-server, shipped so that slotctl can be seen at work at once.

``server-slot.bin`` was saved by llama-server b11434 (state version 4) running ``target.gguf`` (the
tiny random-weight llama model of tests/data: 2 layers, n_embd 128, one KV head of 64) started with
``-c 256 -np 1 -fa on``, after ``POST /completion`` of :data:`PROMPT` with ``n_predict`` 8 and
``POST /slots/0?action=save``: 111 tokens, 58,708 bytes (tests/data/srv-np1.bin, same bytes).
``slotctl demo`` inspects and validates it without llama-cpp-python.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
#: the slot file the server wrote
SLOT_FILE = HERE / "server-slot.bin"
#: the model the server ran
MODEL = HERE / "target.gguf"
#: the flags the server was started with (besides -m and --slot-save-path)
SERVER_FLAGS = ("-c", "256", "-np", "1", "-fa", "on")
#: the prompt it evaluated (then it generated 8 tokens)
PROMPT = ("what is the capital of france? paris is the capital of france. the river of paris is north of "
          "the city")
