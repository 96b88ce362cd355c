"""Test configuration: the repository root on ``sys.path``.

``examples/`` (runnable programs) and ``pipelines/`` (a checkout's entry to
``cpdata.recipes``) sit beside the package and are not installed; tests import
them from the checkout.
No fixtures are defined here.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
