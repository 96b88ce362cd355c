"""Plan a whole dataset ahead of training and write it as a plan directory.

The planner is the online one (:func:`cpdata.packing.plan_lengths`, or a global schedule) run once over every
length, so the plan gives the packs the online pipeline would; per-pack real tokens and per-rank causal work
are stored beside it for ``cpdata inspect``. Cost: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cpdata.layout.maps import alignment, layout_spec
from cpdata.nodes.mixed import MixedDataset
from cpdata.nodes.options import (
    DataPolicy,
    PlanChoice,
    SchedulePlan,
    StreamPlan,
    check_records,
    refuse_keywords,
)
from cpdata.nodes.source_kinds import read_document
from cpdata.offline.metrics import pack_geometry, rank_work
from cpdata.offline.progress import Progress
from cpdata.offline.store import PackStore, read_store, write_store
from cpdata.packing.pieces import piece_continues
from cpdata.sources.atomic import check_writable
from cpdata.sources.base import TokenizedDataset
from cpdata.sources.fingerprint import lengths_sha256, source_identity
from cpdata.sources.open import as_source, open_dataset
from cpdata.sources.protocol import Listed, carried_targets, declared_labels
from cpdata.worker.targets import LabelsAlignment, declared_alignment, first_target, missing_alignment_message

__all__ = ["precompute"]


def _check_options(plan: Any, data: Any, dataset: Any) -> None:
    """Refuse records of another type and the fields that do not apply to a plan written ahead of training."""
    check_records(plan=plan, data=data)
    if data.dp_rank or data.shuffle:
        raise ValueError("a precomputed plan holds every DP rank's packs in the planner's order: leave "
                         "DataPolicy.dp_rank and shuffle out (the reader takes dp_rank)")  # fmt: skip
    if isinstance(plan, StreamPlan):
        if data.dp_size != 1:
            raise ValueError(f"DataPolicy(dp_size={data.dp_size}) with a StreamPlan: a streamed plan is split "
                             "between DP ranks when served; pass plan=SchedulePlan() to plan a global schedule "
                             "for dp_size ranks, or leave dp_size out")  # fmt: skip
        if plan.shuffle_buffer != StreamPlan().shuffle_buffer:
            raise ValueError("StreamPlan.shuffle_buffer shuffles a stream online; a precomputed plan keeps the "
                             "dataset's order: leave it out")  # fmt: skip
        if plan.world_step != 1:
            raise ValueError(f"StreamPlan(world_step={plan.world_step}): a precomputed plan stores slot lengths, "
                             "not the owners a world step deals; pack online with world_step, or precompute "
                             "with world_step=1 (each world micro-batch dealt by itself)")  # fmt: skip
    elif plan.lengths is not None or plan.window is not None:
        raise ValueError("SchedulePlan.lengths and SchedulePlan.window do not apply to precompute: it reads every "
                         "length from the dataset and plans them at once; leave them out")  # fmt: skip
    epochs = 1 if data.epochs is None else data.epochs
    if epochs == 1:
        return
    from cpdata.nodes.mix import Mix

    if not isinstance(dataset, Mix):
        raise ValueError(
            f"epochs={epochs} plans the epochs of a cpdata.mix, which draws other documents every epoch; this "
            f"dataset ({type(dataset).__name__}) is not a mix: it gives the same packs every epoch; precompute it "
            "once (epochs=1) and serve that plan every epoch"
        )
    if isinstance(plan, SchedulePlan):
        raise ValueError(
            f"epochs={epochs} with a SchedulePlan: a global schedule over a mix plans epoch 0's draws for every "
            "epoch, as build_loader(plan=SchedulePlan()) does; leave epochs out, or use a StreamPlan to plan "
            "each epoch's draws"
        )


def _first_targets(dataset: TokenizedDataset, labels_alignment: LabelsAlignment, progress: bool) -> np.ndarray:
    """First trained target of every document (the dataset carries labels or masks)."""
    out = np.empty(len(dataset), dtype=np.int64)
    with Progress(len(dataset), "finding trained targets", unit="docs", enabled=progress) as bar:
        for i in range(len(dataset)):
            out[i] = first_target(read_document(dataset, i, None, labels_alignment).arrays)
            bar.update()
    return out


def _plan_epochs(lengths: np.ndarray, starts: np.ndarray, firsts: np.ndarray | None, **plan_kw: Any) -> Any:
    """Each epoch ``lengths[starts[e]:starts[e + 1]]`` planned on its own (as the loader packs one epoch per
    ``iter()``), as one :class:`~cpdata.packing.PackingResult` whose ``doc_index`` counts over every epoch,
    and the first pack of each epoch (int64 ``[epochs + 1]``)."""
    from cpdata.packing import PackingResult, PackingStats, plan_lengths

    parts = [
        plan_lengths(lengths[lo:hi], first_target=None if firsts is None else firsts[lo:hi], **plan_kw)
        for lo, hi in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)
    ]
    if len(parts) == 1:
        return parts[0], np.array([0, parts[0].n_packs], dtype=np.int64)
    pack_starts = np.concatenate([[0], np.cumsum([r.n_packs for r in parts])]).astype(np.int64)
    piece_starts = np.cumsum([0] + [int(r.doc_index.shape[0]) for r in parts])
    offsets = [np.asarray(r.pack_offsets[:-1], dtype=np.int64) + base for r, base in zip(parts, piece_starts, strict=False)]
    counted = [f.name for f in dataclasses.fields(PackingStats)
               if f.name not in ("capacity", "padding_pct", "lower_bound_pct", "epoch", "sources")]  # fmt: skip
    stats = PackingStats.from_counts(capacity=parts[0].stats.capacity,
                                     **{k: sum(int(getattr(r.stats, k)) for r in parts) for k in counted})  # fmt: skip
    result = PackingResult(
        pack_offsets=np.concatenate([*offsets, [piece_starts[-1]]]).astype(np.int64),
        doc_index=np.concatenate([np.asarray(r.doc_index) + lo for r, lo in zip(parts, starts.tolist(), strict=False)]),
        **{k: np.concatenate([getattr(r, k) for r in parts]) for k in ("doc_start", "doc_len", "slot_len")},
        stats=stats, config=parts[0].config,
    )  # fmt: skip
    return result, pack_starts


def precompute(
    dataset: TokenizedDataset | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    capacity: int,
    cp_size: int,
    layout: str,
    tile: int | None = None,
    plan: PlanChoice = StreamPlan(),
    data: DataPolicy = DataPolicy(),
    overwrite: bool = False,
    progress: bool = False,
    **removed: Any,
) -> PackStore:
    """Plan every document of ``dataset`` into packs and write the plan directory ``out_dir`` (atomically).

    ``dataset``: a :class:`TokenizedDataset`, a ``datasets.Dataset``, a :func:`cpdata.mix`, or a path for
    :func:`open_dataset` (a lengths file is enough). ``capacity``, ``cp_size``, ``layout`` and ``tile`` as for
    :func:`cpdata.build_loader`. ``plan``: a :class:`~cpdata.nodes.options.StreamPlan` (the online ``Pack``
    node's packs) or a :class:`~cpdata.nodes.options.SchedulePlan` (a global schedule for ``data.dp_size`` DP
    ranks; ``lengths`` and ``window`` do not apply). ``data``: ``seed``, ``dp_size``, ``vocab_size``,
    ``labels_alignment`` and a mix's ``epochs`` (docs/usage.md says what each does to a plan; ``dp_rank`` and
    ``shuffle`` do not apply). ``removed``: 0.3's keywords, refused naming the field that replaces them.
    Returns the written directory, opened and verified."""
    from cpdata.packing import PackingConfig

    refuse_keywords("precompute", removed, ("capacity", "cp_size", "layout", "tile", "plan", "data", "overwrite",
                                            "progress"))  # fmt: skip
    _check_options(plan, data, dataset)
    layout = layout_spec(layout, tile)
    scheduled = isinstance(plan, SchedulePlan)
    window, vocab_size = None if scheduled else plan.window, data.vocab_size
    planner = dict(capacity=capacity, layout=layout, cp_size=cp_size, algorithm=plan.algorithm, overflow=plan.overflow,
                   seed=data.seed)  # fmt: skip
    PackingConfig.resolve(**planner, window=window)  # all checked before the input is read (a JSONL scan is long)
    for line in check_writable(out_dir, overwrite=overwrite):
        print(f"cpdata precompute: {line}", file=sys.stderr, flush=True)
    dataset = as_source(dataset, indexed=True, epochs=1 if data.epochs is None else data.epochs)
    if not isinstance(dataset, TokenizedDataset):
        path = Path(dataset)
        size = path.stat().st_size if path.is_file() else sum(1 for _ in path.glob("*.npy"))
        unit = "B" if path.is_file() else "files"
        with Progress(size, f"reading {path.name}", unit=unit, enabled=progress) as bar:
            dataset = open_dataset(path, on_progress=bar.update)
    labels_alignment = declared_alignment("precompute", data.labels_alignment, declared_labels(dataset), dataset)
    if vocab_size is not None and not dataset.serves_tokens:
        raise ValueError(
            f"vocab_size={vocab_size} cannot be checked against {dataset.path}, which holds document lengths only; "
            "precompute from the tokenized dataset, or leave vocab_size out (the reader checks ids when serving)"
        )
    dataset.check_token_ids(vocab_size)
    dataset.verify_content()  # a token store: every chunk, so the recorded input digest names the bytes read
    lengths = np.asarray(dataset.lengths, dtype=np.int64)
    if progress:
        print(f"planning {lengths.shape[0]} documents ({int(lengths.sum())} tokens)", file=sys.stderr, flush=True)
    present = sorted(carried_targets(dataset) or ())
    if present and labels_alignment is None:
        raise ValueError(missing_alignment_message(f"{dataset.path.name}", present))
    if not scheduled:  # a schedule plans lengths only: documents that train nothing stay
        firsts = _first_targets(dataset, labels_alignment, progress) if present else None
        starts = dataset.epoch_starts if isinstance(dataset, Listed) else np.array([0, lengths.shape[0]], dtype=np.int64)
        result, epoch_packs = _plan_epochs(lengths, starts, firsts, **planner, window=window)
    else:
        from cpdata.schedule import CostModel, plan_schedule

        cost = (plan.cost or CostModel()) if plan.kind == "balanced" else None
        sched = plan_schedule(lengths, **planner, dp_size=data.dp_size, micro_batches=plan.micro_batches, cost=cost,
                              max_delay=plan.max_delay, tail=plan.tail,
                              fallback=plan.kind == "balanced" and plan.cost is None)  # fmt: skip
        result = sched.as_packing_result()

    plan_arrays = {k: np.asarray(getattr(result, k), dtype=np.int64)
                   for k in ("pack_offsets", "doc_index", "doc_start", "doc_len", "slot_len")}  # fmt: skip
    offsets = plan_arrays["pack_offsets"]
    plan_arrays["continues"] = piece_continues(plan_arrays["doc_index"], plan_arrays["doc_start"], plan_arrays["doc_len"])
    n_packs = offsets.shape[0] - 1
    tokens_before = np.concatenate([[0], np.cumsum(plan_arrays["doc_len"])]).astype(np.int64)
    pack_tokens = tokens_before[offsets[1:]] - tokens_before[offsets[:-1]]
    work = np.zeros((n_packs, cp_size), dtype=np.int64)
    with Progress(n_packs, "pack statistics", unit="packs", enabled=progress) as bar:
        for k in range(n_packs):
            rows = slice(int(offsets[k]), int(offsets[k + 1]))
            geometry = pack_geometry(plan_arrays["doc_len"][rows], plan_arrays["slot_len"][rows], capacity)
            work[k] = rank_work(layout, cp_size, geometry)[1]
            bar.update()

    manifest = {
        "config": {
            **{k: getattr(result.config, k) for k in ("capacity", "cp_size", "layout", "doc_multiple")},
            "pack_multiple": alignment(layout, cp_size)[1],
            "labels_alignment": labels_alignment,
            "planner": {k: getattr(result.config, k) for k in ("algorithm", "overflow", "seed", "window")},
        },
        "input": {
            "kind": dataset.kind,
            "name": dataset.path.name,
            "identity": source_identity(dataset),
            "lengths_sha256": lengths_sha256(lengths),
            "documents": int(lengths.shape[0]),
            "tokens": int(lengths.sum()),
        },
        "counts": {
            "packs": int(n_packs),
            "pieces": int(plan_arrays["doc_index"].shape[0]),
            "real_tokens": int(pack_tokens.sum()),
            "total_tokens": int(n_packs) * int(capacity),
        },
        "stats": {k: v.item() if isinstance(v, np.generic) else v  # numpy numbers as JSON numbers
                  for k, v in dataclasses.asdict(result.stats).items()},
    }
    if isinstance(dataset, MixedDataset):  # what the mix drew from each source, as Pack.stats.sources online
        manifest["stats"]["sources"] = dataset.counts
        manifest["input"]["mix"] = dataset.mix.config
        if not scheduled:  # the mix draws other documents every epoch: each planned epoch has its packs
            manifest["epochs"] = {"count": dataset.epochs, "first_pack": epoch_packs.tolist(),
                                  "sources": dataset.epoch_counts}  # fmt: skip
    if scheduled:
        st = sched.stats
        manifest["schedule"] = {
            "kind": plan.kind, "dp_size": sched.dp_size, "micro_batches": sched.micro_batches,
            "num_steps": sched.num_steps, "max_delay": int(plan.max_delay), "tail": st.tail,
            "cost": None if cost is None else [cost.a, cost.b], "empty_packs": st.empty_packs,
            "delay_counts": list(st.delay_counts),
            "imb_step_mean": st.imb_step_mean, "imb_mb_mean": st.imb_mb_mean,
        }  # fmt: skip
    arrays: Mapping[str, np.ndarray] = {**plan_arrays, "pack_tokens": pack_tokens, "rank_work": work}
    write_store(out_dir, arrays, manifest, overwrite=overwrite)
    return read_store(out_dir)
