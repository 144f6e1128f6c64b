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

* **speculative checkpoints** — a target whose memory removes only whole sequences (recurrent and
  hybrid models) cannot drop rejected positions. Before it decodes the verification batch the server
  snapshots it (``spec_ckpt``, PARTIAL_ONLY); when a draft is only partly accepted it restores the
  snapshot, removes the batch's positions from the attention caches, and decodes the accepted tokens
  again as the next batch (the "replay", verified like a draft at temperature 0), which adds one more
  token. A draft context of such a memory is snapshotted before it drafts and restored after. Where the
  server itself would abort (``llama_memory_seq_rm`` refused: a recurrent draft paired with a target
  that rolls back by removing positions), :class:`ServerAborts` says so.

What the draft context holds is therefore whatever was mirrored into it: after a restore without a
usable draft state it holds nothing of the restored prompt, only what was evaluated since, and the
draft-simple drafter never re-evaluates the missing prefix (b11434 and the runtime's own tree
agree; older llama.cpp drafters kept a prompt copy and re-evaluated it). Its drafts then rest on a
short context, which shows as fewer accepted tokens: the cost the SDFT appendix (llama.cpp ea736c1d5) removes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import llama_cpp

from slotctl.progress import Progress
from slotctl.errors import ExitStatus, SlotctlError, UsageError
from slotctl.format.blob import BLOB_HEADER_SIZE
from slotctl.runtime.context import STATE_FLAGS_PARTIAL_ONLY, Context
from slotctl.runtime.model import LlamaError, Model
from slotctl.runtime.slot import ServerContexts, process_prompt
from slotctl.server.checkpoints import (SEQ_RM_FULL, Checkpoint, CheckpointPolicy, pos_min_threshold,
                                        rollback_checkpoint)
from slotctl.server.requests import request_refusal


#: ``--spec-draft-n-max`` default (``common_params_speculative_draft::n_max``, b11434)
DEFAULT_DRAFT_N_MAX = 3


class RequestRefused(SlotctlError):
    """The server would answer the request with an error (the message is the server's)."""

    exit_status = ExitStatus.FAILED


class ServerAborts(RequestRefused):
    """llama-server would abort here (a ``GGML_ABORT`` in b11434), not answer."""


@dataclass
class Completion:
    """What one request did, with the server's ``timings`` counters.

    ``n_prompt``: tokens of the request; ``n_common``: of those, the tokens the slot held (the request
    diverges from the slot's tokens after them); ``n_reused``: of those, taken from the slot's cache
    (``prompt_n`` is ``n_evaluated``); ``n_reevaluated``: tokens the slot held that were evaluated again
    (``n_common - n_reused``: a memory that cannot roll back went back to a checkpoint, or started
    over); ``n_draft_reused``: positions the draft context held before the new tokens were evaluated;
    ``checkpoint``: ``n_tokens`` of the context checkpoint restored for the prompt, if any;
    ``n_checkpoints``: the checkpoints the slot holds after the prompt (the server takes new ones while
    it processes it). ``n_replayed``: tokens decoded again after a speculative checkpoint restore.
    ``tokens``/``text``: what was generated (``text`` as the server sends it, special tokens not rendered); ``stop``: "limit" (``-n`` reached), "eos", "context" (the slot is
    full) or "none" (``-n 0``). ``n_drafted``/``n_accepted``/``n_verify_steps``: ``draft_n``,
    ``draft_n_accepted`` and verification batches.
    """

    n_prompt: int
    n_reused: int
    n_evaluated: int
    n_draft_reused: int | None
    checkpoint: int | None
    n_common: int = 0
    n_reevaluated: int = 0
    n_checkpoints: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop: str = "none"
    speculative: bool = False
    n_draft_max: int = DEFAULT_DRAFT_N_MAX
    n_drafted: int = 0
    n_accepted: int = 0
    n_verify_steps: int = 0
    n_replayed: int = 0
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
    ``policy``: how the server takes checkpoints while it processes a request's prompt (by default
    where b11434 does, keeping 32); ``user_starts`` of a request are given to :meth:`begin`.
    """

    def __init__(self, sc: ServerContexts, slot: int, tokens: Sequence[int] = (),
                 checkpoints: Sequence[Checkpoint] = (), *, n_draft_max: int = DEFAULT_DRAFT_N_MAX,
                 policy: CheckpointPolicy | None = None):
        if n_draft_max < 0:
            raise ValueError("n_draft_max must not be negative")
        self.sc = sc
        self.id = slot
        self.tokens: list[int] = list(tokens)
        self.checkpoints: list[Checkpoint] = list(checkpoints)
        self.n_draft_max = n_draft_max
        self.policy = policy if policy is not None else CheckpointPolicy(server=True)
        #: the server's ``n_ctx`` of a slot
        self.n_ctx = sc.target.n_ctx_slot
        self._vocab = llama_cpp.llama_model_get_vocab(sc.target_model.ptr)
        self._n_swa = sc.n_swa
        self._tgt_full = sc.target_seq_rm == SEQ_RM_FULL
        self._dft_full = sc.draft_seq_rm == SEQ_RM_FULL
        self._task = 0

    @property
    def speculative(self) -> bool:
        return self.sc.draft is not None

    def _contexts(self) -> list[Context]:
        return self.sc.contexts()

    def _is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def _seq_rm(self, p0: int, contexts: Sequence[Context] | None = None) -> None:
        """``common_memory::seq_rm(slot, p0, -1)``: the server aborts when a context refuses."""
        for ctx in contexts if contexts is not None else self._contexts():
            if not ctx.seq_rm(self.id, p0, -1):
                role = "target" if ctx is self.sc.target else "draft"
                raise ServerAborts(
                    f"llama-server aborts here: failed to remove sequence {self.id} with p0={p0}, p1=-1 from the "
                    f"{role} context (GGML_ABORT in common_context_seq_rm): its {role} memory cannot drop "
                    f"positions {p0} and later, and the server only restores checkpoints of the draft when "
                    "the target needs them too")

    # -- the prompt ------------------------------------------------------------------------------

    def _reuse(self, request: Sequence[int]) -> tuple[int, int | None, int]:
        """``n_past`` for ``request``, the checkpoint restored for it and the common prefix
        (``update_slots``, SLOT_STATE_STARTED)."""
        n = len(request)
        n_past = n_common = common_prefix(self.tokens, request)
        pos_next = n_past
        has_new = n_past < n
        pos_min_thold = pos_min_threshold(pos_next, self._n_swa, has_new)
        used = None
        if 0 < n_past <= len(self.tokens):
            pos_min = self.sc.target.seq_pos_min(self.id)
            if pos_min == -1:
                raise RequestRefused(f"the slot's target context is empty but {len(self.tokens)} tokens are cached")
            if pos_min >= pos_min_thold:
                # the memory no longer holds what n_past needs (SWA window, recurrent state): go back to
                # the last checkpoint that is early enough, or start over
                found = rollback_checkpoint(self.checkpoints, pos_next, pos_min_thold)
                if found is not None and not _set_partial(self.sc.target, found.tgt, self.id):
                    # a checkpoint the context does not take (it was converted and checked at restore,
                    # so this is not expected): the server aborts ("checkpoint size mismatch")
                    raise ServerAborts(f"llama-server aborts here: the checkpoint at {found.n_tokens} tokens does "
                                       "not fit the target context (GGML_ABORT checkpoint size mismatch)")
                if found is not None:
                    if self.sc.draft is not None and found.dft and not _set_partial(self.sc.draft, found.dft, self.id):
                        raise ServerAborts(f"llama-server aborts here: the checkpoint at {found.n_tokens} tokens "
                                           "does not fit the draft context (GGML_ABORT checkpoint size mismatch)")
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
        return n_past, used, n_common

    def evaluate(self, request: Sequence[int], on_progress: Progress | None = None,
                 user_starts: Sequence[int] = ()) -> tuple[int, int | None, int | None]:
        """Take ``request`` into the slot as the server processes a prompt.

        Returns ``(n_past, checkpoint used, draft positions held before the new tokens)``; the common
        prefix is then in ``last_common``. Checkpoints are taken on the way by ``policy`` (with the
        request's ``user_starts``). The target's logits for the last token are then ready
        (``ctx.argmax()``).
        """
        n = len(request)
        if n == 0:
            raise UsageError("empty prompt: the server releases the slot without evaluating anything")
        refusal = request_refusal(n, self.n_ctx)
        if refusal:
            raise RequestRefused(refusal)
        self._task += 1
        n_past, used, self.last_common = self._reuse(request)
        self.tokens = self.tokens[:n_past]
        self._seq_rm(n_past)
        held = None
        if self.sc.draft is not None:
            lo, hi = self.sc.draft.seq_pos_min(self.id), self.sc.draft.seq_pos_max(self.id)
            held = hi - lo + 1 if hi >= 0 else 0
        p = self.policy
        policy = CheckpointPolicy(p.server, p.n_ctx_checkpoints, p.min_step, tuple(user_starts))
        try:
            process_prompt(self.sc, self.id, request, n_past, self.checkpoints, policy, task=self._task,
                           on_progress=on_progress, decode_draft=self._mirror if self.sc.draft is not None else None)
        except LlamaError as e:  # e.g. the file's tokens claim more than its payload holds
            raise RequestRefused(f"Invalid input batch: {e}") from None
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

    def begin(self, request: Sequence[int], on_prompt: Progress | None = None,
              user_starts: Sequence[int] = ()) -> Completion:
        """The prompt half of :meth:`complete`: returns the completion so far (nothing generated)."""
        t0 = time.perf_counter()
        n_past, used, held = self.evaluate(request, on_prompt, user_starts)
        n_common = self.last_common
        return Completion(n_prompt=len(request), n_reused=n_past, n_evaluated=len(request) - n_past,
                          n_draft_reused=held, checkpoint=used, n_common=n_common,
                          n_reevaluated=max(0, n_common - n_past), n_checkpoints=len(self.checkpoints),
                          speculative=self.speculative, n_draft_max=self.n_draft_max,
                          prompt_ms=(time.perf_counter() - t0) * 1000)

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
        spec_draft: list[int] = []   # the server's slot.spec_draft: a draft, or after a restore the replay
        replay = False               # slot.spec_is_replay
        ckpt: Checkpoint | None = None   # slot.spec_ckpt
        while True:
            pos0 = len(self.tokens)
            if dft is not None:
                n_draft_max = self.n_ctx - len(self.tokens) - 2
                n_remaining = n_predict - len(out)
                if n_remaining > 0:
                    n_draft_max = min(n_draft_max, n_remaining - 1)
                if n_draft_max > 0 and not spec_draft:
                    ckpt = Checkpoint(pos0, tgt.seq_pos_min(self.id), tgt.seq_pos_max(self.id), b"")
                    if self._dft_full:
                        ckpt.dft = dft.state_seq_get(self.id, STATE_FLAGS_PARTIAL_ONLY)
                    spec_draft = self._draft(sampled, pos0, n_draft_max)
                    comp.n_drafted += len(spec_draft)
                    # the draft context drops its drafted tokens again (restoring its snapshot first
                    # when it cannot drop positions)
                    if self._dft_full:
                        dft.state_seq_set(ckpt.dft, self.id, STATE_FLAGS_PARTIAL_ONLY)
                    self._seq_rm(ckpt.pos_max + 1, [dft])
                    if spec_draft and self._tgt_full:
                        ckpt.tgt = tgt.state_seq_get(self.id, STATE_FLAGS_PARTIAL_ONLY)
            draft = spec_draft
            batch = [sampled] + draft
            self.tokens += batch
            tgt.decode(batch, self.id, pos0, all_logits=bool(draft))
            if dft is not None:
                self._mirror(batch, pos0)
            if replay:
                comp.n_replayed += len(batch)
            if not draft:
                sampled = tgt.argmax()
                if not process_token(sampled):
                    return
                continue
            accepted = self._verify(draft)
            if len(accepted) < len(draft) + 1 and self._tgt_full:
                # partial acceptance and a target that cannot drop positions: back to the snapshot, and
                # decode the accepted tokens again in the next batch
                replay = True
                spec_draft = accepted
                if not tgt.state_seq_set(ckpt.tgt, self.id, STATE_FLAGS_PARTIAL_ONLY):
                    raise ServerAborts("llama-server aborts here: the speculative checkpoint does not fit the "
                                       "target context (GGML_ABORT checkpoint size mismatch)")
                if dft is not None and ckpt.dft:
                    dft.state_seq_set(ckpt.dft, self.id, STATE_FLAGS_PARTIAL_ONLY)
                self._seq_rm(ckpt.pos_max + 1)
                self.tokens = self.tokens[:ckpt.n_tokens]
                continue
            n_accepted = len(accepted) - 1
            if replay and n_accepted > 0:
                n_accepted -= 1
            replay = False
            spec_draft = []
            comp.n_accepted += n_accepted
            comp.n_verify_steps += 1
            self.tokens = self.tokens[:len(self.tokens) - len(draft)] + accepted[:-1]
            sampled = accepted[-1]
            self._seq_rm(len(self.tokens))
            for token in accepted:
                if not process_token(token):
                    return


def _set_partial(ctx: Context, blob: bytes, seq_id: int) -> int:
    """A checkpoint's PARTIAL_ONLY blob loaded into ``ctx``; the bytes read. The blob header alone (8 bytes: a
    plain KV cache's state as libllama b11434 and later write it, :mod:`slotctl.server.builds`) is read as that
    libllama reads it: the header, nothing restored (a KV cache drops positions itself)."""
    if len(blob) == BLOB_HEADER_SIZE:
        return BLOB_HEADER_SIZE
    return ctx.state_seq_set(blob, seq_id, STATE_FLAGS_PARTIAL_ONLY)
