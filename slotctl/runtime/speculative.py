"""A llama-server slot answering a completion request: prompt reuse, then greedy generation, speculative
when the server has a draft model.

llama-cpp-python has no two-model speculative decoding, so the server's loop is written here on
:class:`~slotctl.runtime.context.Context`, step by step as llama.cpp b11434 runs it
(``tools/server/server-context.cpp`` ``update_slots`` / ``post_decode``, ``common/speculative.cpp``
``common_speculative_impl_draft_simple``), at temperature 0:

* **prompt** — the request is tokenized as the server tokenizes a string prompt; the longest common
  prefix with the tokens the slot holds is reused (``n_past``), at least one token is evaluated, the
  rest of both contexts is removed from ``n_past`` on, and the new tokens are decoded in the target
  and then, the same batch at the same positions, in the draft (``common_speculative_process``: the
  draft-simple drafter mirrors every target batch into its own context). Memories that cannot be
  rolled back (SWA, recurrent) go back to a context checkpoint first, or start over.
* **draft** — from the last sampled token, the draft decodes that token at the next position and
  proposes its argmax, up to ``--spec-draft-n-max`` tokens (``p_min`` 0, ``n_min`` 0: the server's
  defaults), fewer when the slot's context or the request's budget is short; then the draft context
  drops everything past the target's last position again.
* **verify** — the target decodes the sampled token and the draft in one batch (logits for each), the
  draft mirrors that batch, the target's argmax is compared with the draft token by token
  (``common_sampler_sample_and_accept_n``: the first disagreement ends acceptance, an end-of-generation
  token accepted mid-draft too), and both contexts drop the rejected positions.

What the draft context holds is therefore whatever was mirrored into it: after a restore without a
usable draft state it holds nothing of the restored prompt, only what was evaluated since, and the
draft-simple drafter never re-evaluates the missing prefix (b11434 and the runtime's own tree
agree; older llama.cpp drafters kept a prompt copy and re-evaluated it). Its drafts then rest on a
short context, which shows as fewer accepted tokens: the cost the seed change's SDFT appendix removes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import llama_cpp

from slotctl.errors import ExitStatus, SlotctlError, UsageError
from slotctl.runtime.context import STATE_FLAGS_PARTIAL_ONLY, Context
from slotctl.runtime.model import LlamaError, Model
from slotctl.runtime.slot import Checkpoint, ServerContexts

Progress = Callable[[int, int], None]

#: ``--spec-draft-n-max`` default (``common_params_speculative_draft::n_max``, b11434)
DEFAULT_DRAFT_N_MAX = 3
#: memory kinds whose tail can be removed (``seq_rm``) after a rejected draft; the server needs
#: speculative checkpoints and replay for the others, which slotctl does not model
ROLLBACK_KINDS = ("kv", "iswa")


class RequestRefused(SlotctlError):
    """The server would answer the request with an error (the message is the server's)."""

    exit_status = ExitStatus.FAILED


@dataclass
class Completion:
    """What one request did, with the server's ``timings`` counters.

    ``n_prompt``: tokens of the request; ``n_reused``: of those, taken from the slot's cache
    (``prompt_n`` is ``n_evaluated``); ``n_draft_reused``: positions the draft context held before
    the new tokens were evaluated; ``checkpoint``: ``n_tokens`` of the context checkpoint restored
    for the prompt, if any. ``tokens``/``text``: what was generated (``text`` as the server sends it,
    special tokens not rendered); ``stop``: "limit" (``-n`` reached), "eos", "context" (the slot is
    full) or "none" (``-n 0``). ``n_drafted``/``n_accepted``/``n_verify_steps``: ``draft_n``,
    ``draft_n_accepted`` and verification batches.
    """

    n_prompt: int
    n_reused: int
    n_evaluated: int
    n_draft_reused: int | None
    checkpoint: int | None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop: str = "none"
    speculative: bool = False
    n_draft_max: int = DEFAULT_DRAFT_N_MAX
    n_drafted: int = 0
    n_accepted: int = 0
    n_verify_steps: int = 0
    prompt_ms: float = 0.0
    generate_ms: float = 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["n_generated"] = len(self.tokens)
        return d


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (``server_tokens::get_common_prefix`` for text tokens)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompt_text(model: Model, tokens: Sequence[int]) -> str:
    """The text a client would send back to continue from ``tokens``.

    The detokenized tokens with special tokens rendered (so that the server's ``parse_special`` reads
    them back), without the leading BOS the tokenizer adds to every prompt, which the server adds again.
    """
    added = model.tokenize("")  # what add_special puts in front of any text: BOS, when add_bos
    tokens = list(tokens)
    if added and tokens[:len(added)] == added:
        tokens = tokens[len(added):]
    return model.detokenize(tokens, special=True) if tokens else ""


def request_tokens(model: Model, cached: Sequence[int], text: str) -> list[int]:
    """The tokens of a request continuing ``cached`` with ``text``, tokenized as the server does.

    The server tokenizes the whole new prompt (the saved text followed by the new text) and reuses the
    longest common prefix with the tokens it holds: so does this, starting from :func:`prompt_text`.
    """
    return model.tokenize(prompt_text(model, cached) + text)


def fresh_contexts(sc: ServerContexts) -> ServerContexts:
    """New, empty contexts with the settings of ``sc``'s (which may be closed already) on the same
    models, still owned by ``sc``: a server that never saw the slot.

    Close them with :func:`close_contexts`; closing the result does not free the models.
    """
    target = Context(sc.target_model, sc.target.settings)
    draft = Context(sc.draft_model, sc.draft.settings) if sc.draft is not None else None
    return ServerContexts(sc.target_model, target, sc.draft_model, draft, sc.target_info, sc.draft_info)


def close_contexts(sc: ServerContexts) -> None:
    for ctx in sc.contexts():
        ctx.close()


class ServerSlot:
    """One slot: its sequence in the target (and draft) context, the tokens the target holds for it,
    and its context checkpoints.

    ``tokens`` must be what the target context holds at positions ``0 .. len(tokens) - 1`` (after a
    restore: the file's tokens; after :func:`~slotctl.runtime.slot.evaluate_prompt`: the prompt).
    """

    def __init__(self, sc: ServerContexts, slot: int, tokens: Sequence[int] = (),
                 checkpoints: Sequence[Checkpoint] = (), *, n_draft_max: int = DEFAULT_DRAFT_N_MAX):
        if n_draft_max < 0:
            raise ValueError("n_draft_max must not be negative")
        self.sc = sc
        self.id = slot
        self.tokens: list[int] = list(tokens)
        self.checkpoints: list[Checkpoint] = list(checkpoints)
        self.n_draft_max = n_draft_max
        #: the server's ``n_ctx`` of a slot
        self.n_ctx = sc.target.n_ctx_slot
        self._vocab = llama_cpp.llama_model_get_vocab(sc.target_model.ptr)
        self._n_swa = int(llama_cpp.llama_model_n_swa(sc.target_model.ptr))

    @property
    def speculative(self) -> bool:
        return self.sc.draft is not None

    def _contexts(self) -> list[Context]:
        return self.sc.contexts()

    def _is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    # -- the prompt ------------------------------------------------------------------------------

    def _reuse(self, request: Sequence[int]) -> tuple[int, int | None]:
        """``n_past`` for ``request`` and the checkpoint restored for it (``update_slots``, SLOT_STATE_STARTED)."""
        n = len(request)
        n_past = common_prefix(self.tokens, request)
        pos_next = n_past
        has_new = n_past < n
        pos_min_thold = max(0, pos_next - self._n_swa - (0 if has_new else 1))
        used = None
        if 0 < n_past <= len(self.tokens):
            pos_min = self.sc.target.seq_pos_min(self.id)
            if pos_min == -1:
                raise RequestRefused(f"the slot's target context is empty but {len(self.tokens)} tokens are cached")
            if pos_min >= pos_min_thold:
                # the memory no longer holds what n_past needs (SWA window, recurrent state): go back to
                # the last checkpoint that is early enough, or start over
                found = None
                for cp in reversed(self.checkpoints):
                    if cp.pos_max > pos_next:
                        continue
                    if cp.pos_min < pos_min_thold or cp.pos_min == 0:
                        found = cp
                        break
                if found is not None and not self.sc.target.state_seq_set(found.tgt, self.id,
                                                                          STATE_FLAGS_PARTIAL_ONLY):
                    # a checkpoint the context does not take (it was converted and checked at restore,
                    # so this is not expected): start over rather than decode onto a half-cleared slot
                    self.sc.target.seq_rm(self.id, -1, -1)
                    found = None
                if found is not None:
                    if self.sc.draft is not None and found.dft and \
                            not self.sc.draft.state_seq_set(found.dft, self.id, STATE_FLAGS_PARTIAL_ONLY):
                        self.sc.draft.seq_rm(self.id, -1, -1)  # the draft goes on from nothing, as after a drop
                    pos_next = min(pos_next, max(found.pos_min + 1, found.pos_max))
                    n_past = min(pos_next, found.n_tokens)
                    used = found.n_tokens
                else:
                    pos_next = n_past = 0
        # checkpoints past the reused prompt are stale
        self.checkpoints = [cp for cp in self.checkpoints if cp.pos_max <= pos_next]
        # [TAG_PROMPT_LOGITS]: at least one token is evaluated, for its logits
        if n_past == n and n_past > 0:
            n_past -= 1
        return n_past, used

    def evaluate(self, request: Sequence[int], on_progress: Progress | None = None) -> tuple[int, int | None, int | None]:
        """Take ``request`` into the slot as the server processes a prompt.

        Returns ``(n_past, checkpoint used, draft positions held before the new tokens)``. The
        target's logits for the last token are then ready (``ctx.argmax()``).
        """
        n = len(request)
        if n == 0:
            raise UsageError("empty prompt: the server releases the slot without evaluating anything")
        if n >= self.n_ctx:
            raise RequestRefused(f"request ({n} tokens) exceeds the available context size ({self.n_ctx} tokens), "
                                 "try increasing it")
        n_past, used = self._reuse(request)
        self.tokens = self.tokens[:n_past]
        for ctx in self._contexts():
            ctx.seq_rm(self.id, n_past, -1)
        held = None
        if self.sc.draft is not None:
            lo, hi = self.sc.draft.seq_pos_min(self.id), self.sc.draft.seq_pos_max(self.id)
            held = hi - lo + 1 if hi >= 0 else 0
        new = list(request[n_past:])
        total = len(new) * len(self._contexts())
        try:
            self.sc.target.decode(new, self.id, n_past,
                                  on_progress=(lambda d, _t: on_progress(d, total)) if on_progress else None)
        except LlamaError as e:  # e.g. the file's tokens claim more than its payload holds
            raise RequestRefused(f"Invalid input batch: {e}") from None
        if self.sc.draft is not None:
            self._mirror(new, n_past, on_progress=(lambda d, _t: on_progress(len(new) + d, total))
                         if on_progress else None)
        self.tokens = list(request)
        return n_past, used, held

    def _mirror(self, tokens: Sequence[int], pos0: int, on_progress: Progress | None = None) -> None:
        """``common_speculative_process``: the draft decodes the target's batch at the same positions."""
        try:
            self.sc.draft.decode(tokens, self.id, pos0, on_progress=on_progress)
        except LlamaError as e:
            raise RequestRefused(f"failed to process speculative batch: {e}") from None

    # -- generation ----------------------------------------------------------------------------

    def _draft(self, id_last: int, pos0: int, n_max_slot: int) -> list[int]:
        """draft-simple's ``draft()`` at temperature 0: the draft's argmax, token by token."""
        dft = self.sc.draft
        try:
            dft.decode([id_last], self.id, pos0)
        except LlamaError:
            return []  # the server logs the failure and goes on without a draft
        result: list[int] = []
        i = 0
        while True:
            token = dft.argmax()
            result.append(token)
            if self.n_draft_max <= len(result) or (n_max_slot > 0 and n_max_slot <= len(result)):
                break
            try:
                dft.decode([token], self.id, pos0 + i + 1)
            except LlamaError:
                break
            i += 1
        return result

    def _verify(self, draft: list[int]) -> list[int]:
        """``common_sampler_sample_and_accept_n`` at temperature 0 over the verification batch."""
        tgt = self.sc.target
        accepted = []
        for i, d in enumerate(draft):
            token = tgt.argmax(i)
            accepted.append(token)
            if token != d or (self._is_eog(token) and i + 1 < len(draft)):
                return accepted
        accepted.append(tgt.argmax(len(draft)))
        return accepted

    def complete(self, request: Sequence[int], n_predict: int, *, on_prompt: Progress | None = None,
                 on_token: Progress | None = None) -> Completion:
        """Answer a completion request: evaluate what the slot lacks of ``request``, then generate
        up to ``n_predict`` tokens greedily (speculatively with a draft context)."""
        comp = self.begin(request, on_prompt)
        self.generate(comp, n_predict, on_token)
        return comp

    def begin(self, request: Sequence[int], on_prompt: Progress | None = None) -> Completion:
        """The prompt half of :meth:`complete`: returns the completion so far (nothing generated)."""
        if self.speculative:
            for role, info in (("target", self.sc.target_info), ("draft", self.sc.draft_info)):
                if info is not None and info.memory_kind not in ROLLBACK_KINDS:
                    raise UsageError(f"speculative decoding with a {info.memory_kind} {role} model: the server "
                                     "rolls such memory back with speculative checkpoints and replay, which "
                                     "slotctl does not model; restore without -md")
        t0 = time.perf_counter()
        n_past, used, held = self.evaluate(request, on_prompt)
        return Completion(n_prompt=len(request), n_reused=n_past, n_evaluated=len(request) - n_past,
                          n_draft_reused=held, checkpoint=used, speculative=self.speculative,
                          n_draft_max=self.n_draft_max, prompt_ms=(time.perf_counter() - t0) * 1000)

    def generate(self, comp: Completion, n_predict: int, on_token: Progress | None = None) -> None:
        """The generation half of :meth:`complete`, right after :meth:`begin`; fills ``comp``."""
        if n_predict < 0:
            raise ValueError("n_predict must not be negative")
        t0 = time.perf_counter()
        if n_predict > 0:
            self._generate(comp, n_predict, on_token)
        comp.text = b"".join(self.sc.target_model.token_to_piece(t, special=False)
                             for t in comp.tokens).decode("utf-8", errors="replace")
        comp.generate_ms = (time.perf_counter() - t0) * 1000

    def _generate(self, comp: Completion, n_predict: int, on_token: Progress | None) -> None:
        tgt, dft = self.sc.target, self.sc.draft
        out = comp.tokens

        def process_token(token: int) -> bool:
            """The server's ``process_token``: keep the token, say whether generation goes on."""
            out.append(token)
            if on_token:
                on_token(len(out), n_predict)
            if self._is_eog(token):
                comp.stop = "eos"
            elif len(self.tokens) + 1 >= self.n_ctx:  # no context shift (the server's default)
                comp.stop = "context"
            elif len(out) >= n_predict:
                comp.stop = "limit"
            else:
                return True
            return False

        sampled = tgt.argmax()
        if not process_token(sampled):
            return
        while True:
            pos0 = len(self.tokens)
            draft: list[int] = []
            if dft is not None:
                n_draft_max = self.n_ctx - len(self.tokens) - 2
                n_remaining = n_predict - len(out)
                if n_remaining > 0:
                    n_draft_max = min(n_draft_max, n_remaining - 1)
                if n_draft_max > 0:
                    pos_max = tgt.seq_pos_max(self.id)
                    draft = self._draft(sampled, pos0, n_draft_max)
                    comp.n_drafted += len(draft)
                    dft.seq_rm(self.id, pos_max + 1, -1)
            batch = [sampled] + draft
            self.tokens += batch
            tgt.decode(batch, self.id, pos0, all_logits=bool(draft))
            if dft is not None:
                self._mirror(batch, pos0)
            if not draft:
                sampled = tgt.argmax()
                if not process_token(sampled):
                    return
                continue
            accepted = self._verify(draft)
            comp.n_accepted += len(accepted) - 1
            comp.n_verify_steps += 1
            self.tokens = self.tokens[:len(self.tokens) - len(draft)] + accepted[:-1]
            sampled = accepted[-1]
            for ctx in self._contexts():
                ctx.seq_rm(self.id, len(self.tokens), -1)
            for token in accepted:
                if not process_token(token):
                    return
