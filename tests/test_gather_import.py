"""``import cpdata.gather`` loads nothing beyond what ``import torch`` loads (stdlib allowed).

Model code imports the gather alone; it must not drag numpy-level worker code,
torchdata or the rest of cpdata into every process. ``import torch`` may load
numpy itself, so the check compares module sets in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import torch
before = set(sys.modules)
import cpdata.gather
added = sorted(set(sys.modules) - before)
print(json.dumps({"added": added, "stdlib": sorted(sys.stdlib_module_names)}))
"""


def test_import_gather_adds_only_cpdata_gather_and_stdlib():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    stdlib = set(report["stdlib"])
    added = report["added"]
    assert "cpdata.gather" in added  # the probe really imported it
    # cpdata.errors: the package's lazy exports, standard library only (its imports are checked here too)
    own = ("cpdata", "cpdata.errors", "cpdata.gather")
    foreign = [m for m in added if m not in own and m.split(".")[0] not in stdlib]
    assert not foreign, f"import cpdata.gather loaded modules beyond torch and the stdlib: {foreign}"
