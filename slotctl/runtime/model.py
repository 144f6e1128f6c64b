"""A GGUF model loaded by llama.cpp on the CPU: its vocabulary and weights."""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import llama_cpp
import numpy as np

from slotctl.progress import Progress
from slotctl.errors import SlotctlError, UsageError
from slotctl.paths import check_readable
from slotctl.runtime.log import capture_errors, ensure_backend


class Freeable(Protocol):
    """What a model frees before itself: a context built on it (``slotctl.runtime.context.Context``, which
    imports this module: named here only by what the model calls, so that imports point one way)."""

    def close(self) -> None: ...


#: the steps model loading reports its progress in
LOAD_STEPS = 1000


class LlamaError(SlotctlError):
    """llama.cpp refused to do something: load a model, build a context, decode a batch.

    The message ends with the errors llama.cpp logged for it, when it logged any.
    """

    def __init__(self, what: str, log_lines: Sequence[str] = ()):
        self.what = what
        self.log_lines = list(log_lines)
        detail = "; ".join(self.log_lines)
        super().__init__(f"{what}: {detail}" if detail else what)


class Model:
    """A model loaded from a GGUF file, usable as a context manager.

    ``close()`` (or leaving the ``with`` block) frees the weights and every context still open
    on the model; a model that is only garbage collected is freed then.
    """

    def __init__(self, path: str | os.PathLike[str], *, vocab_only: bool = False,
                 on_progress: Progress | None = None):
        """Load ``path``; with ``vocab_only`` just its vocabulary and hyperparameters (no weights,
        so no context can be built on it). ``on_progress(done, LOAD_STEPS)`` follows the loading
        of the tensors; an exception it raises cancels loading and propagates."""
        self.path = Path(path)
        try:
            check_readable(self.path)   # a FIFO would hang the loader; a loop is named as one
        except UsageError as e:
            raise LlamaError(f"cannot load model {e}") from None
        ensure_backend()
        #: loaded without weights
        self.vocab_only = vocab_only
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = vocab_only
        raised: list[BaseException] = []

        def report(progress: float, user_data: ctypes.c_void_p) -> bool:
            try:
                on_progress(round(progress * LOAD_STEPS), LOAD_STEPS)
            except BaseException as exc:  # cancel loading; re-raised once llama.cpp has returned
                raised.append(exc)
                return False
            return True

        if on_progress is not None:
            # the ctypes object lives in ``callback`` until loading returns, which is all llama.cpp needs
            callback = llama_cpp.llama_progress_callback(report)
            params.progress_callback = callback
        with capture_errors() as errors:
            ptr = llama_cpp.llama_model_load_from_file(os.fsencode(self.path), params)
        if raised:
            if ptr:
                llama_cpp.llama_model_free(ptr)
            raise raised[0]
        if not ptr:
            raise LlamaError(f"cannot load model {self.path}", errors)
        self._ptr = ptr
        self._contexts: weakref.WeakSet[Freeable] = weakref.WeakSet()
        self._finalizer = weakref.finalize(self, llama_cpp.llama_model_free, ptr)
        self._vocab = llama_cpp.llama_model_get_vocab(ptr)
        #: tokens in the vocabulary; valid token ids are ``0 .. n_vocab - 1``
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self._vocab)
        #: the context length the model was trained with (``{arch}.context_length``)
        self.n_ctx_train: int = llama_cpp.llama_model_n_ctx_train(ptr)
        #: transformer blocks
        self.n_layer: int = llama_cpp.llama_model_n_layer(ptr)
        #: whether tokenizing with ``add_special`` puts BOS in front (``tokenizer.ggml.add_bos_token``)
        self.add_bos: bool = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def ptr(self) -> llama_cpp.llama_model_p:
        """The ``llama_model *`` for the low-level API; ValueError once the model is closed."""
        self._check_open()
        return self._ptr

    def close(self) -> None:
        """Free the contexts still open on this model, then the model. Idempotent."""
        for context in list(self._contexts):
            context.close()
        self._finalizer()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _adopt(self, context: Freeable) -> None:
        """Register a context built on this model, so that ``close()`` frees it first."""
        self._contexts.add(context)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Tokenize ``text`` the way llama-server tokenizes a string prompt.

        The server calls ``common_tokenize(vocab, prompt, add_special=true, parse_special=true)``:
        BOS goes in front when the model's ``add_bos`` says so (EOS at the end when ``add_eos``
        does), and special-token text such as ``<s>`` becomes the special token.
        """
        data = text.encode("utf-8")
        capacity = len(data) + 2 * add_special
        while True:
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab_ptr(), data, len(data), buf, capacity, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            if n == -(2**31):
                raise LlamaError("cannot tokenize: the text is too large")
            capacity = -n

    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        """The bytes of one token; special tokens are rendered when ``special``.

        Bytes, not text: a token may hold part of a multi-byte UTF-8 character.
        """
        self.check_tokens([token])
        capacity = 32
        while True:
            buf = ctypes.create_string_buffer(capacity)
            n = llama_cpp.llama_token_to_piece(self._vocab_ptr(), token, buf, capacity, 0, special)
            if n >= 0:
                return buf.raw[:n]
            capacity = -n

    def detokenize(self, tokens: Sequence[int], special: bool = True) -> str:
        """The text of ``tokens`` (a sequence or a numpy array), special tokens rendered when ``special``;
        bad UTF-8 is replaced. The ids reach llama.cpp as one int32 array, never a list of Python ints (a
        prompt of millions of tokens costs its 4 bytes a token, not 36)."""
        array = np.ascontiguousarray(tokens, dtype=np.int32)
        self.check_tokens(array)
        ptr = array.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        capacity = max(16, 8 * len(array))
        while True:
            buf = ctypes.create_string_buffer(capacity)
            n = llama_cpp.llama_detokenize(self._vocab_ptr(), ptr, len(array), buf, capacity, False, special)
            if n >= 0:
                return ctypes.string_at(buf, n).decode("utf-8", errors="replace")
            capacity = -n

    def check_tokens(self, tokens: Sequence[int]) -> None:
        """ValueError unless every token is a valid id of this vocabulary.

        llama.cpp's vocabulary lookups throw a C++ exception on a bad id, which aborts the process.
        """
        ids = np.asarray(tokens, dtype=np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= self.n_vocab))
        if len(bad):
            raise ValueError(f"token {int(ids[bad[0]])} is outside the vocabulary (0..{self.n_vocab - 1})")

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"model {self.path} is closed")

    def _vocab_ptr(self) -> llama_cpp.llama_vocab_p:
        """The model's vocabulary; ValueError once the model is closed."""
        self._check_open()
        return self._vocab

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"n_vocab={self.n_vocab}, n_layer={self.n_layer}"
        if self.vocab_only:
            state += ", vocab_only"
        return f"Model({str(self.path)!r}, {state})"
