"""``cpdata bench``: cpdata measured against the anchors, side by side, in one run.

| section      | module                   | anchor                                              |
|--------------|--------------------------|-----------------------------------------------------|
| ``step_shard`` | :mod:`~cpdata.bench.step_shard` | in-step sharding of the full batch (NeMo Automodel style) |
| ``worker``   | :mod:`~cpdata.bench.worker_throughput` | ``np.copyto`` of the same output bytes     |
| ``packing``  | :mod:`~cpdata.bench.packing_quality` | next-fit, first-fit (8 bins), FFD, a lower bound |
| ``balance``  | :mod:`~cpdata.bench.balance` | contiguous, round-robin and THD layouts           |
| ``gather``   | :mod:`~cpdata.bench.gather_collectives` | all-gather + index all-gather + argsort (NeMo style) |
| ``schedule`` | :mod:`~cpdata.bench.schedule_balance` | NeMo-RL FFD, verl Karmarkar-Karp, Megatron ``dp_balanced``, cpdata 0.1 |
| ``attention`` | :mod:`~cpdata.bench.attention` | every layout's kernel tiles and K/V needs against ``tiled``'s |
| ``world``    | :mod:`~cpdata.bench.world` | Megatron-core's ``BalancedCPScheduler`` (hybrid CP) against the ``world`` deal |
| ``integrity`` | :mod:`~cpdata.bench.integrity` | the token store's reader without chunk checks |

:func:`run_bench` returns a JSON-ready dict (``cpdata bench --json``);
:func:`render_markdown` turns it into the tables of docs/benchmarks.md.

Role: the top layer; it may use every part of cpdata. Modules besides the
sections above: ``cli`` (``cpdata bench``), ``runner`` (runs sections, collects
results), ``targets`` (the targets checked against a result), ``report`` and
``table`` (markdown and plain tables), ``timing`` (timers, machine description),
``distributions`` (seeded length distributions), ``anchors`` (in-step sharding
as trainers do it), ``schedule_methods`` (trainers' DP placement),
``collectives`` (counting collectives), ``ranks`` (forked gloo ranks, or spawned NCCL ones),
``hf_reference`` (a HF model's documents run alone, the reference of the HF checks), ``gpu_check``
(``make gpu-check``: ``gpu_attention``, ``gpu_steps``, ``gpu_exchange``, the parts only a GPU runs), plus the
``handoff`` (worker-to-trainer receive cost) and ``long_document`` (a very long
document, online and offline) sections.
"""

from cpdata.bench.report import render_markdown
from cpdata.bench.runner import SECTIONS, run_bench, write_json

__all__ = ["SECTIONS", "render_markdown", "run_bench", "write_json"]
