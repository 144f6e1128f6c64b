"""slotctl.tensors: gguf's block formats, called on all blocks at once, give exactly what gguf.quants gives;
the Hadamard rotation is llama.cpp's (orthonormal, its own inverse)."""

from __future__ import annotations

import gguf
import gguf.quants as q
import numpy as np
import pytest

from slotctl import tensors


@pytest.mark.parametrize("tid", [0, 1, 30, 8, 2, 3, 6, 7])
def test_same_bytes_and_values_as_gguf(tid):
    x = np.random.default_rng(tid).standard_normal((300, 128)).astype(np.float32)
    qt = gguf.GGMLQuantizationType(tid)
    ours = tensors.quantize(x, tid)
    assert ours == np.asarray(q.quantize(x, qt)).tobytes()
    raw = np.frombuffer(ours, np.uint8).reshape(300, -1)
    assert np.array_equal(tensors.dequantize(ours, tid, 128), np.asarray(q.dequantize(raw, qt)).reshape(300, 128))


def test_hadamard_is_orthonormal_and_its_own_inverse():
    for n in (64, 128, 256):
        h = tensors.hadamard(n)
        assert np.allclose(h @ h, np.eye(n), atol=1e-5) and np.allclose(h, h.T)
        assert np.allclose(np.abs(h), 1 / np.sqrt(n))
    x = np.random.default_rng(0).standard_normal((5, 128)).astype(np.float32)
    assert np.allclose(tensors.rotate(tensors.rotate(x, 64), 64), x, atol=1e-5)
    assert tensors.rotate(x, 0) is x
    with pytest.raises(ValueError):
        tensors.rotate(x, 96)


def test_what_gguf_can_read_and_write():
    assert tensors.can_write(8) and tensors.can_write(2) and tensors.can_read(20) and not tensors.can_write(20)
