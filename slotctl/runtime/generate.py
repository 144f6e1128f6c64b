"""Greedy generation on a context, token by token."""

from __future__ import annotations

from slotctl.runtime.context import Context


def generate_greedy(ctx: Context, seq_id: int, n: int, pos: int) -> list[int]:
    """Generate ``n`` tokens greedily in ``seq_id``, continuing from the last ``decode``.

    The last decode must have ended with this sequence's token at position ``pos - 1``, so that
    its logits predict position ``pos``. Each chosen token is decoded at the next position, so
    afterwards the sequence holds them all (up to ``pos + n - 1``) and ``ctx.argmax()`` predicts
    the token after the last one returned. End-of-generation tokens get no special treatment.
    """
    tokens = []
    for i in range(n):
        token = ctx.argmax()
        ctx.decode([token], seq_id, pos + i)
        tokens.append(token)
    return tokens
