"""``plan_digest``: same-shape plans over other tokens get other digests; equal plans get equal ones."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cpdata.worker.collate import CollatedPack
from cpdata.worker.plan import DocPiece, PackPlan
from cpdata.worker.shard_block import DIGEST_SAMPLES, plan_digest, prepare_block
from tests.test_bit_identity import reference_digest


def _plan(pieces_ids: list[np.ndarray], **kw) -> PackPlan:
    pieces = tuple(DocPiece(index=i, start=0, arrays={"input_ids": ids}) for i, ids in enumerate(pieces_ids))
    slots = np.array([len(ids) for ids in pieces_ids], dtype=np.int64)
    return PackPlan(pieces=pieces, slot_lens=slots, capacity=int(slots.sum()) + 8, **kw)


IDS = [np.arange(10, 10 + n, dtype=np.int64) for n in (1, 2, 7, 8, 9, 100, 4096)]


def test_equal_plans_have_equal_digests():
    copies = [ids.copy() for ids in IDS]
    assert plan_digest(_plan(IDS), "thd", 2) == plan_digest(_plan(copies), "thd", 2)


@pytest.mark.parametrize("piece", range(len(IDS)))
def test_every_sampled_token_of_every_piece_is_covered(piece):
    """Changing any sampled position of one piece (same lengths, same provenance) changes the digest."""
    base = plan_digest(_plan(IDS), "thd", 2)
    n = len(IDS[piece])
    positions = sorted({(s * (n - 1)) // (DIGEST_SAMPLES - 1) for s in range(DIGEST_SAMPLES)})
    assert positions[0] == 0 and positions[-1] == n - 1
    assert len(positions) == min(n, DIGEST_SAMPLES)
    for pos in positions:
        changed = [ids.copy() for ids in IDS]
        changed[piece][pos] += 1
        assert plan_digest(_plan(changed), "thd", 2) != base, (piece, pos)


def test_whole_content_shift_of_same_shaped_plans_is_seen():
    shifted = [ids + 1 for ids in IDS]
    assert plan_digest(_plan(shifted), "thd", 2) != plan_digest(_plan(IDS), "thd", 2)


def test_provenance_and_configuration_are_covered():
    plan = _plan(IDS)
    base = plan_digest(plan, "thd", 2)
    assert plan_digest(plan, "balanced", 2) != base and plan_digest(plan, "thd", 4) != base
    assert plan_digest(dataclasses.replace(plan, index=1), "thd", 2) != base
    assert plan_digest(dataclasses.replace(plan, capacity=plan.capacity + 8), "thd", 2) != base
    for field, value in (("index", 99), ("start", 3), ("next_label", 5)):
        pieces = list(plan.pieces)
        pieces[2] = dataclasses.replace(pieces[2], **{field: value})
        assert plan_digest(dataclasses.replace(plan, pieces=tuple(pieces)), "thd", 2) != base, field


def test_empty_piece_is_digested():
    plan = _plan([np.zeros(0, dtype=np.int64), np.arange(3)])
    assert 0 <= plan_digest(plan, "identity", 1) < 2**63
    empty = np.zeros(0, dtype=np.int64)  # empty pieces first, between and last: their samples are -1
    plans = [_plan([empty, np.arange(3), empty, IDS[5], empty], index=i) for i in range(2)]
    assert len({plan_digest(p, "thd", 2) for p in plans}) == 2
    assert [plan_digest(p, "thd", 2) for p in plans] == [reference_digest([p], "thd", 2) for p in plans]
    batches = [CollatedPack(plans=(p,), pack_len=p.capacity, qkv_format="thd", padding_token_id=0) for p in plans]
    assert [item.info["digest"] for item in prepare_block(batches, "identity", 1, False)] == [
        reference_digest([p], "identity", 1) for p in plans
    ]


def test_digests_of_a_block_equal_each_plans_alone():
    """A block's digests (one table for every batch, an int32 plan's slot lengths, a batch of two plans and an
    empty plan included) equal the reference digest of each batch alone, and ``plan_digest`` of each plan."""
    plans = [_plan(IDS[:3], index=0), _plan(IDS[3:], index=5)]
    plans.append(dataclasses.replace(plans[0], slot_lens=plans[0].slot_lens.astype(np.int32), index=9))
    empty = np.zeros(0, dtype=np.int64)
    plans.append(PackPlan(pieces=(), slot_lens=empty, capacity=plans[0].capacity, index=3))
    groups = [plans[:1], plans[1:2], plans[2:3], [plans[0], plans[2]], plans[3:]]
    batches = [CollatedPack(plans=tuple(g), pack_len=g[0].capacity, qkv_format="thd", padding_token_id=0)
               for g in groups]  # fmt: skip
    assert [item.info["digest"] for item in prepare_block(batches, "identity", 1, False)] == [
        reference_digest(g, "identity", 1) for g in groups
    ]
    assert [plan_digest(p, "thd", 4) for p in plans] == [reference_digest([p], "thd", 4) for p in plans]


def test_a_world_steps_owners_are_digested():
    """The same slots dealt to other ranks by a world step are another layout: CP ranks must not agree on it."""
    ids = IDS[:3]
    owners = np.array([[0, 1], [1, 1], [0, 2]], dtype=np.int64)
    moved = owners.copy()
    moved[0, 0] = 1
    digests = {plan_digest(_plan(ids), "world:2", 4), plan_digest(_plan(ids, owners=owners), "world:2", 4),
               plan_digest(_plan(ids, owners=moved), "world:2", 4)}  # fmt: skip
    assert len(digests) == 3
    assert plan_digest(_plan(ids, owners=owners), "world:2", 4) == plan_digest(_plan(ids, owners=owners.copy()),
                                                                               "world:2", 4)  # fmt: skip
