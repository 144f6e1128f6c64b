"""What the server does with a completion request before it evaluates anything (b11434
tools/server/server-context.cpp, ``update_slots``)."""

from __future__ import annotations


def request_refusal(n_tokens: int, n_ctx_slot: int) -> str | None:
    """The server's error for a request of ``n_tokens`` prompt tokens in a slot of ``n_ctx_slot`` tokens
    (``slot.task->n_tokens() >= slot.n_ctx``: ERROR_TYPE_EXCEED_CONTEXT_SIZE), None when it takes it."""
    if n_tokens >= n_ctx_slot:
        return (f"request ({n_tokens} tokens) exceeds the available context size ({n_ctx_slot} tokens), "
                "try increasing it")
    return None
