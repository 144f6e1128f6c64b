"""Shared fixtures. Test data copied from real llama-server runs lives in tests/data (see its README)."""

from __future__ import annotations

import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(Path(__file__).parent))

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """The tiny target (2 layers) and draft (1 layer) from slotctl.testing, made once per session."""
    from slotctl.testing import make_models

    return make_models(tmp_path_factory.mktemp("models"))
