"""Test configuration: the repository root on ``sys.path``.

``pipelines/`` and ``examples/`` are folders of recipes beside the package,
not installed; tests import them from the checkout (``import pipelines.sft_thd``).
No fixtures are defined here.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
