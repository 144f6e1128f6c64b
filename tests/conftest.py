"""Shared fixtures. Test data copied from real llama-server runs lives in tests/data (see its README)."""

from __future__ import annotations

import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(Path(__file__).parent))
