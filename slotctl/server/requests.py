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


#: the completion endpoints (b11434 tools/server/server.cpp's routes) and how each gives its prompt:
#: "prompt" (``/completion``, ``/completions``, ``/v1/completions``: the request's ``prompt``) or "chat"
#: (``/chat/completions``, ``/v1/chat/completions``: ``messages`` through the chat template, the text
#: ``POST /apply-template`` answers)
COMPLETION_PATHS = {"/completion": "prompt", "/completions": "prompt", "/v1/completions": "prompt",
                    "/chat/completions": "chat", "/v1/chat/completions": "chat"}

#: how the server tokenizes a completion's prompt text (``tokenize_input_prompts(..., add_special=true,
#: parse_special=true)`` in ``handle_completions_impl``); ``POST /tokenize`` defaults to add_special false
TOKENIZE_FLAGS = {"add_special": True, "parse_special": True}


def _is_token(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def prompt_form(prompt) -> str | None:
    """How the server makes the one prompt of a completion request from its ``prompt`` field
    (``tokenize_input_prompts`` / ``tokenize_input_subprompt``): "tokens" for an array of numbers (taken
    as they are, nothing added), "text" for a string or an array mixing strings and numbers
    (``tokenize_mixed`` with :data:`TOKENIZE_FLAGS`: what ``POST /tokenize`` does with them), None for
    anything else: an array of strings or arrays (several prompts, one task each), an object (a
    multimodal prompt), an empty array, another type (the server's error)."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, list) and prompt and any(_is_token(v) for v in prompt):
        if all(_is_token(v) for v in prompt):
            return "tokens"
        if all(_is_token(v) or isinstance(v, str) for v in prompt):
            return "text"
    return None
