"""Overlong documents with overflow="error" fail when the pipeline is built, all of them named at once."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cpdata import CPDataset, StreamPlan, build_loader, open_dataset, plan_lengths

LENGTHS = [5, 40, 3, 70, 9, 33, 12]
"""Capacity 32 (thd, cp 2: multiples of 4): documents 1, 3 and 5 are too long, 3 the longest (70 -> 72)."""


def _dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(1, n + 1))}) + "\n" for n in LENGTHS))
    ds = open_dataset(path)

    def unread(i):
        raise AssertionError(f"document {i} was read before the lengths were checked")

    ds._read = unread
    return ds


def _check(message: str) -> None:
    for part in ("document 1 has 40 tokens", "capacity=32", "3 of 7 documents", "[1, 3, 5]",
                 "longest: document 3 with 70 tokens", "to 72 for all", "overflow="):
        assert part in message, (part, message)


@pytest.mark.parametrize("build", ["build_loader", "CPDataset"])
def test_known_lengths_are_checked_when_the_pipeline_is_built(tmp_path, build):
    ds = _dataset(tmp_path)
    make = build_loader if build == "build_loader" else CPDataset
    with pytest.raises(ValueError) as err:
        make(ds, capacity=32, cp_size=2, cp_rank=0, layout="thd")
    _check(str(err.value))
    make(ds, capacity=32, cp_size=2, cp_rank=0, layout="thd", plan=StreamPlan(overflow="truncate"))  # other policies: no check


def test_plan_lengths_names_every_overlong_document_before_planning():
    with pytest.raises(ValueError) as err:
        plan_lengths(np.array(LENGTHS), capacity=32, layout="thd", cp_size=2)
    _check(str(err.value))
