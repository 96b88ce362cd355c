"""``cpdata bench``: cpdata measured against the anchors (what trainers do today), side by side, in one run.

Each section module (``runner.SECTIONS``) says in its docstring what it measures and against which anchor.
:func:`run_bench` returns a JSON-ready dict (``cpdata bench --json``); :func:`render_markdown` turns it into the
tables of docs/benchmarks.md. The top layer: it may use every part of cpdata. Helpers: ``cli``, ``runner``,
``targets``, ``report`` / ``table`` (markdown and plain tables), ``timing``, ``distributions`` (seeded inputs),
``anchors`` (in-step sharding as trainers do it), ``schedule_methods``, ``collectives`` (counting collectives),
``ranks`` (forked gloo or spawned NCCL ranks), ``hf_reference`` (documents run alone), and ``gpu_check``
(``make gpu-check``, with ``gpu_attention``, ``gpu_steps``, ``gpu_exchange``: the parts only a GPU runs).
"""

from cpdata.bench.report import render_markdown
from cpdata.bench.runner import SECTIONS, run_bench, write_json

__all__ = ["SECTIONS", "render_markdown", "run_bench", "write_json"]
