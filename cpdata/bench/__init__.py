"""``cpdata bench``: cpdata measured against the anchors (what trainers do today), side by side, in one run.

Role: the top layer; it may use every part of cpdata. Sections (``runner.SECTIONS``; each module's docstring
says what it measures against which anchor): ``step_shard``, ``worker_throughput``, ``handoff``,
``packing_quality``, ``balance``, ``gather_collectives``, ``long_document``, ``schedule_balance``,
``attention``, ``world``, ``integrity``. Helpers: ``cli``, ``runner``, ``targets``, ``report`` / ``table``
(markdown and plain tables), ``timing``, ``distributions`` (seeded inputs), ``corpus`` (a user's document
lengths, ``--lengths``), ``anchors`` (in-step sharding as trainers do it), ``world_megatron`` (Megatron's
hybrid-CP scheduler as the world section reads it), ``ranks`` (forked gloo or spawned
NCCL ranks), ``hf_reference`` (documents run alone), and ``gpu_check`` (``make gpu-check``, with
``gpu_attention``, ``gpu_linear``, ``gpu_steps``, ``gpu_exchange``: the parts only a GPU runs).
:func:`run_bench` returns a JSON-ready dict; :func:`render_markdown` turns it into the tables of
docs/benchmarks.md.
"""

from cpdata.bench.report import render_markdown
from cpdata.bench.runner import SECTIONS, run_bench, write_json

__all__ = ["SECTIONS", "render_markdown", "run_bench", "write_json"]
