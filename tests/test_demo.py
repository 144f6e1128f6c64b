"""The README's main job: ``slotctl demo`` runs every command on the built-in default."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_demo_runs_every_step_as_expected(tmp_path):
    r = subprocess.run([sys.executable, "-m", "slotctl", "demo", "--dir", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "120"})
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    d = json.loads(r.stdout)
    assert d["ok"] is True
    steps = {s["step"]: s for s in d["steps"]}
    assert [s["step"] for s in d["steps"]] == ["save", "inspect", "validate", "validate-other-draft", "restore"]
    insp = steps["inspect"]["output"]
    assert insp["version"] == 4 and len(insp["checkpoints"]) == 2 and insp["draft"]["memory"] is not None
    assert steps["validate"]["output"]["files"][0]["verdict"] == "restores"
    other = steps["validate-other-draft"]["output"]["files"][0]
    assert any(f["code"] == "layer_count_mismatch" and f["layer"] == "draft" for f in other["findings"])
    rest = steps["restore"]["output"]
    assert rest["compare"]["agree"] is True
    assert rest["continuation"]["n_accepted"] > 0
    assert (tmp_path / "sample-slot.bin").is_file()
