"""A llama.cpp context built the way llama-server builds its target and draft contexts.

Built on the low-level API rather than ``llama_cpp.Llama``, which has no ``n_seq_max`` or
``kv_unified``, reads ``flash_attn=False`` as "off" where the server's default is "auto", and
turns negative sequence ids into 0.

Everything here guards the calls that would abort the process instead of failing: llama.cpp
asserts (``GGML_ASSERT``) on a sequence id outside ``0 .. n_seq_max - 1`` in its memory calls,
on asking one decode for more outputs than the context reserved, and on a device-side state
blob it did not write itself; and a token outside the vocabulary throws a C++ exception through
the C API. Each is checked here first and raised as a Python exception.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp
import numpy as np

from slotctl.format.blob import BLOB_MAGIC, FLAGS_NONE, FLAGS_ON_DEVICE, FLAGS_PARTIAL_ONLY
from slotctl.format.header import STATE_SEQ_MAGIC
from slotctl.runtime.log import capture_errors
from slotctl.progress import Progress
from slotctl.runtime.model import LlamaError, Model
from slotctl.model.settings import DRAFT_CACHE_TYPE_DEFAULT, FLASH_ATTN_TYPES, ContextSettings

#: ``llama_state_seq_flags`` (one copy, :mod:`slotctl.format.blob`): the whole state of the sequence; only the
#: part that cannot be rolled back (SWA cache, recurrent state); metadata only (tensor data stays on the device)
STATE_FLAGS_NONE = FLAGS_NONE
STATE_FLAGS_PARTIAL_ONLY = FLAGS_PARTIAL_ONLY
STATE_FLAGS_ON_DEVICE = FLAGS_ON_DEVICE
assert (llama_cpp.LLAMA_STATE_SEQ_FLAGS_NONE, llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY,
        llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE) == (FLAGS_NONE, FLAGS_PARTIAL_ONLY, FLAGS_ON_DEVICE)

#: ``LLAMA_STATE_SEQ_VERSION`` of the linked llama.cpp: the only version its state files load with
STATE_VERSION: int = llama_cpp.LLAMA_STATE_SEQ_VERSION
#: first word of a state file (``LLAMA_STATE_SEQ_MAGIC``, "ggsq"; one copy, :mod:`slotctl.format.header`)
STATE_FILE_MAGIC: int = STATE_SEQ_MAGIC
assert llama_cpp.LLAMA_STATE_SEQ_MAGIC == STATE_SEQ_MAGIC
#: first word of an in-memory state blob (llama-context.cpp's ``io_magic``; not in the bindings; one copy,
#: :mod:`slotctl.format.blob`)
STATE_BLOB_MAGIC = BLOB_MAGIC

#: what ``llama_decode`` returns besides 0 (``include/llama.h``)
_DECODE_ERRORS = {
    1: "no room in the cache for the batch (the context is full)",
    2: "decoding was aborted",
    -1: "invalid batch",
}


@dataclass(frozen=True)
class _Outputs:
    """The logits the last ``decode`` left: it took ``count`` tokens, its last batch began at
    token ``start``, and either every token has logits (``every``) or only the last one."""

    start: int
    count: int
    every: bool


def _free(ctx: llama_cpp.llama_context_p, batch: llama_cpp.llama_batch) -> None:
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)


class Context:
    """A context on ``model`` with ``settings``; one sequence per server slot.

    Attributes besides the methods: ``model``, ``settings``, ``last_errors`` (what llama.cpp
    logged when the last state restore failed). Usable as a context manager; ``close()`` frees it.
    """

    def __init__(self, model: Model, settings: ContextSettings = ContextSettings()):
        if model.vocab_only:
            raise ValueError(f"{model.path.name} was loaded without its weights (vocab_only)")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = settings.context_size(model.n_ctx_train)
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_ubatch
        params.n_seq_max = settings.n_parallel
        params.n_outputs_max = settings.n_outputs_max
        params.n_threads = params.n_threads_batch = settings.threads
        params.flash_attn_type = FLASH_ATTN_TYPES[settings.flash_attn]
        params.type_k = settings.type_k_id
        params.type_v = settings.type_v_id
        params.kv_unified = settings.kv_unified
        params.swa_full = settings.swa_full
        with capture_errors() as errors:
            ptr = llama_cpp.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise LlamaError(f"cannot create a context for {model.path.name}", errors)
        self.model = model
        self.settings = settings
        self.last_errors: list[str] = []
        self._ptr = ptr
        self._memory = llama_cpp.llama_get_memory(ptr)
        #: tokens per ``llama_decode`` call (``-b``, capped at n_ctx by llama.cpp)
        self.n_batch: int = llama_cpp.llama_n_batch(ptr)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._finalizer = weakref.finalize(self, _free, ptr, self._batch)
        self._outputs: _Outputs | None = None
        #: cache cells in all, over every stream (``llama_n_ctx``)
        self.n_ctx: int = llama_cpp.llama_n_ctx(ptr)
        #: cells one sequence may use (``llama_n_ctx_seq``): n_ctx with a unified cache, else n_ctx / n_seq_max
        self.n_ctx_seq: int = llama_cpp.llama_n_ctx_seq(ptr)
        #: sequences (server slots)
        self.n_seq_max: int = llama_cpp.llama_n_seq_max(ptr)
        #: the most logits rows one ``decode`` can return
        self.n_outputs_max: int = settings.n_outputs_max or self.n_batch
        model._adopt(self)

    @property
    def n_ctx_slot(self) -> int:
        """The server's ``n_ctx`` of a slot: the tokens a restored prompt may hold.

        ``llama_n_ctx_seq``, capped by ``--kv-unified-per-slot`` and by the model's training
        context (``server_context::n_ctx_slot`` in b11434).
        """
        limits = [self.n_ctx_seq, self.model.n_ctx_train]
        if self.settings.kv_unified_per_slot:
            limits.append(self.settings.kv_unified_per_slot)
        return min(limits)

    def draft_settings(self, type_k: str = DRAFT_CACHE_TYPE_DEFAULT,
                       type_v: str = DRAFT_CACHE_TYPE_DEFAULT) -> ContextSettings:
        """Settings of the draft context llama-server would pair with this (target) context;
        ``type_k`` / ``type_v`` are its ``-ctkd`` / ``-ctvd``."""
        return self.settings.for_draft(self.n_ctx, type_k, type_v)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def ptr(self) -> llama_cpp.llama_context_p:
        """The ``llama_context *`` for the low-level API; ValueError once closed."""
        self._check_open()
        return self._ptr

    def close(self) -> None:
        """Free the context. Idempotent; the model stays open."""
        self._finalizer()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- evaluation --------------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], seq_id: int, pos0: int, *, all_logits: bool = False,
               on_progress: Progress | None = None) -> None:
        """Evaluate ``tokens`` at positions ``pos0, pos0 + 1, ...`` of sequence ``seq_id``.

        Runs in batches of ``n_batch`` tokens, calling ``on_progress(done, len(tokens))`` after
        each. The last token gets logits; with ``all_logits`` every token does (then at most
        ``min(n_batch, n_outputs_max)`` tokens per call). Read them with ``logits_at``.
        LlamaError when llama.cpp refuses a batch; the batches before it stay in the cache.
        """
        self._check_seq(seq_id)
        if len(tokens) == 0:
            raise ValueError("nothing to decode")
        if pos0 < 0:
            raise ValueError(f"position {pos0} is negative")
        if all_logits and len(tokens) > min(self.n_batch, self.n_outputs_max):
            raise ValueError(f"all_logits: at most {min(self.n_batch, self.n_outputs_max)} tokens per call, "
                             f"got {len(tokens)}")
        self.model.check_tokens(tokens)
        batch = self._batch
        self._outputs = None
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            for j, token in enumerate(chunk):
                batch.token[j] = token
                batch.pos[j] = pos0 + start + j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = seq_id
                batch.logits[j] = all_logits or start + j == len(tokens) - 1
            batch.n_tokens = len(chunk)
            with capture_errors() as errors:
                ret = llama_cpp.llama_decode(self.ptr, batch)
            if ret != 0:
                reason = _DECODE_ERRORS.get(ret, f"llama_decode returned {ret}")
                raise LlamaError(f"cannot decode tokens {start}..{start + len(chunk) - 1} of "
                                 f"sequence {seq_id}: {reason}", errors)
            if on_progress is not None:
                on_progress(start + len(chunk), len(tokens))
        self._outputs = _Outputs(start, len(tokens), all_logits)

    def logits_at(self, i: int = -1) -> np.ndarray:
        """A copy of the logits (float32, ``n_vocab``) after token ``i`` of the last ``decode``.

        ``i`` counts like a list index: -1 is the last token, which always has logits.
        """
        out = self._outputs
        if out is None:
            raise ValueError("no logits: nothing decoded since the context was made")
        index = i + out.count if i < 0 else i
        if not 0 <= index < out.count:
            raise IndexError(f"token {i} is not in the last decode ({out.count} tokens)")
        if not out.every and index != out.count - 1:
            raise ValueError(f"token {i} has no logits: only the last token has, unless decoded with all_logits")
        with capture_errors() as errors:
            row = llama_cpp.llama_get_logits_ith(self.ptr, index - out.start)
        if not row:
            raise LlamaError(f"no logits for token {i}", errors)
        return np.ctypeslib.as_array(row, shape=(self.model.n_vocab,)).copy()

    def argmax(self, i: int = -1) -> int:
        """The greedy choice after token ``i`` of the last ``decode``: the most likely next token."""
        return int(np.argmax(self.logits_at(i)))

    # -- memory --------------------------------------------------------------------------------

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions ``[p0, p1)`` of ``seq_id`` (-1 = every sequence; negative bounds are
        open). False when the memory cannot remove part of a sequence (recurrent state)."""
        self._check_seq(seq_id, allow_all=True)
        return bool(llama_cpp.llama_memory_seq_rm(self._mem(), seq_id, p0, p1))

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position ``seq_id`` holds, -1 when empty."""
        self._check_seq(seq_id)
        return llama_cpp.llama_memory_seq_pos_min(self._mem(), seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position ``seq_id`` holds, -1 when empty."""
        self._check_seq(seq_id)
        return llama_cpp.llama_memory_seq_pos_max(self._mem(), seq_id)

    def clear(self) -> None:
        """Empty every sequence, data included."""
        llama_cpp.llama_memory_clear(self._mem(), True)

    # -- state -----------------------------------------------------------------------------------

    def state_seq_get(self, seq_id: int, flags: int = STATE_FLAGS_NONE) -> bytes:
        """The state blob of ``seq_id``: magic 0xaf143cd8, the seq id, then the memory's state.

        ``llama_state_seq_get_size_ext`` + ``llama_state_seq_get_data_ext``, as the server takes
        checkpoints and draft states. An empty sequence still gives a blob (its cell counts are 0).
        """
        self._check_seq(seq_id)
        with capture_errors() as errors:
            size = llama_cpp.llama_state_seq_get_size_ext(self.ptr, seq_id, flags)
            buf = (ctypes.c_uint8 * size)()
            written = llama_cpp.llama_state_seq_get_data_ext(self.ptr, buf, size, seq_id, flags) if size else 0
        if not size or written != size:
            raise LlamaError(f"cannot get the state of sequence {seq_id}", errors)
        return bytes(buf)

    def state_seq_set(self, data: bytes | bytearray, seq_id: int, flags: int = STATE_FLAGS_NONE) -> int:
        """Restore a blob from ``state_seq_get`` into ``seq_id``; the bytes consumed, 0 on failure.

        A ``bytearray`` is handed to llama.cpp as it is; ``bytes`` are copied first (a large state
        is best passed as a bytearray).

        A blob that does not fit this context (wrong magic, stream count, cell count, layer count,
        V transposition, cache types or row sizes, or truncated) returns 0, and ``last_errors``
        then holds llama.cpp's reasons. The sequence is emptied by a failed restore that got as
        far as its cells. Bytes after the blob are ignored, so a success may consume fewer bytes
        than given. ``STATE_FLAGS_ON_DEVICE`` is refused: llama.cpp aborts the process on such a
        blob unless this very context wrote it.

        Not guarded here, because it takes parsing the blob: a recurrent section (recurrent and
        hybrid models) that claims more than one cell for the sequence fails an assertion in
        llama.cpp, aborting the process, whenever the context has more than one slot. A blob from
        untrusted bytes must be checked for that first (a sequence's state holds 0 or 1 cells).
        """
        self._check_seq(seq_id)
        if flags & STATE_FLAGS_ON_DEVICE:
            raise ValueError("state_seq_set: device-side blobs (STATE_FLAGS_ON_DEVICE) cannot be restored safely")
        array = ctypes.c_uint8 * len(data)
        buf = array.from_buffer(data) if isinstance(data, bytearray) else array.from_buffer_copy(data)
        with capture_errors() as errors:
            n = llama_cpp.llama_state_seq_set_data_ext(self.ptr, buf, len(data), seq_id, flags)
        self.last_errors = errors
        return n

    def save_seq_file(self, path: str | os.PathLike[str], seq_id: int, words: Sequence[int]) -> int:
        """Write a state file as the server saves a slot: header, ``words``, then the state of
        ``seq_id``. ``words`` are stored as given (the server stores a packed token record).

        Returns the file's size; LlamaError when it cannot be written.
        """
        self._check_seq(seq_id)
        array = (llama_cpp.llama_token * len(words))(*words)
        with capture_errors() as errors:
            n = llama_cpp.llama_state_seq_save_file(self.ptr, os.fsencode(path), seq_id, array, len(words))
        if not n:
            raise LlamaError(f"cannot save sequence {seq_id} to {os.fspath(path)}", errors)
        return n

    def load_seq_file(self, path: str | os.PathLike[str], seq_id: int) -> tuple[list[int], int]:
        """Restore a state file into ``seq_id`` as the server restores a slot.

        Like b11434's server, first reads the word count (``tokens_out`` NULL), then loads with
        exactly that room. Returns ``(words, bytes read)``; ``([], 0)`` when llama.cpp refuses the
        file (wrong magic or version, a count beyond the file, a state that does not fit), with
        its reasons in ``last_errors``. Bytes after the state are not read.
        """
        self._check_seq(seq_id)
        count = ctypes.c_size_t(0)
        encoded = os.fsencode(path)
        with capture_errors() as errors:
            n = llama_cpp.llama_state_seq_load_file(self.ptr, encoded, seq_id, None, 0, ctypes.byref(count))
            if n:
                words = (llama_cpp.llama_token * max(1, count.value))()
                n = llama_cpp.llama_state_seq_load_file(self.ptr, encoded, seq_id, words, len(words),
                                                        ctypes.byref(count))
        self.last_errors = errors
        if not n:
            return [], 0
        return list(words[:count.value]), n

    # -- helpers ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("context is closed")

    def _mem(self) -> llama_cpp.llama_memory_t:
        """The context's memory (its KV cache or recurrent state); ValueError once closed."""
        self._check_open()
        return self._memory

    def _check_seq(self, seq_id: int, allow_all: bool = False) -> None:
        """ValueError unless ``seq_id`` names a sequence (or is -1 for all, when allowed).

        llama.cpp asserts, killing the process, on any other id.
        """
        if allow_all and seq_id == -1:
            return
        if not 0 <= seq_id < self.n_seq_max:
            expected = f"-1 or 0..{self.n_seq_max - 1}" if allow_all else f"0..{self.n_seq_max - 1}"
            raise ValueError(f"sequence id {seq_id} out of range ({expected})")

    def __repr__(self) -> str:
        if self.closed:
            return "Context(closed)"
        return f"Context(n_ctx={self.n_ctx}, n_seq_max={self.n_seq_max}, {self.settings})"
