"""Scheduler + block pool under randomised load, without a model: every request finishes, no
block is lost or shared, budgets hold, and the loop always makes progress."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.block_manager import BlockManager
from engine.config import SamplingParams
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence, Status


def test_block_manager_accounts_exactly() -> None:
    blocks = BlockManager(num_blocks=4, block_size=16)
    assert blocks.allocate(1, 17) == [0, 1]
    assert blocks.allocate(1, 32) == [0, 1]  # already covered
    assert not blocks.can_allocate(2, 49)
    assert blocks.can_allocate(2, 32)
    blocks.allocate(2, 1)
    assert (blocks.num_used, blocks.num_free) == (3, 1)
    with pytest.raises(MemoryError):
        blocks.allocate(2, 64)
    assert blocks.free(1) == 2
    assert blocks.free(1) == 0
    assert blocks.num_free == 3


def make_sequence(seq_id: int, prompt_len: int, max_new: int, loop: asyncio.AbstractEventLoop) -> Sequence:
    request = Request(seq_id, [1] * prompt_len, SamplingParams(max_new_tokens=max_new), loop)
    return Sequence.of(seq_id, request)


@pytest.mark.parametrize("seed", range(3))
def test_random_load_with_cancellations_and_pool_exhaustion(seed: int) -> None:
    rng = random.Random(seed)
    loop = asyncio.new_event_loop()
    try:
        num_blocks, block_size = 40, 8  # 320 token slots for requests of up to 200 tokens each
        blocks = BlockManager(num_blocks, block_size)
        config = SchedulerConfig(max_running=rng.choice([1, 4, 8]), max_tokens_per_step=rng.choice([16, 64]))
        scheduler = Scheduler(config, blocks)
        pending = [make_sequence(i, rng.randint(1, 120), rng.randint(1, 80), loop) for i in range(1000)]
        live: list[Sequence] = []
        finished: dict[int, str] = {}
        steps = 0
        while pending or scheduler.has_work:
            steps += 1
            assert steps < 100_000, "no progress: deadlock"
            for _ in range(rng.randint(0, 3)):
                if pending:
                    seq = pending.pop()
                    scheduler.add(seq)
                    live.append(seq)
            if live and rng.random() < 0.01:  # cancel someone, waiting or running
                victim = live.pop(rng.randrange(len(live)))
                scheduler.finish(victim)
                finished[victim.seq_id] = "cancelled"
            plan = scheduler.schedule(admit=rng.random() < 0.8)
            # Invariants of every step.
            assert sum(c.num_tokens for c in plan) <= config.max_tokens_per_step
            assert len(scheduler.running) <= config.max_running
            assert len({id(c.seq) for c in plan}) == len(plan)
            owned = [b for s in scheduler.running for b in blocks.table(s.seq_id)]
            assert len(owned) == len(set(owned)), "a block has two owners"
            assert blocks.num_used == len(owned)
            for chunk in plan:
                seq = chunk.seq
                assert seq.status is Status.RUNNING and chunk.start == seq.num_computed
                assert len(blocks.table(seq.seq_id)) * block_size >= chunk.start + chunk.num_tokens
                seq.num_computed += chunk.num_tokens
                if chunk.samples:
                    seq.token_ids.append(7)
                    if seq.num_output >= seq.request.params.max_new_tokens:
                        scheduler.finish(seq)
                        live.remove(seq)
                        finished[seq.seq_id] = "done"
        assert len(finished) == 1000, "every request ends: generated out, or cancelled"
        assert blocks.num_free == num_blocks, "every block returned"
        assert list(finished.values()).count("done") > 500
        if config.max_running > 1:
            assert scheduler.num_preemptions > 0, "the pool should have run out at some point"
    finally:
        loop.close()


def test_decodes_run_before_prefill_chunks() -> None:
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(SchedulerConfig(max_running=4, max_tokens_per_step=10), BlockManager(64, 16))
        short = make_sequence(1, 3, 50, loop)
        scheduler.add(short)
        (chunk,) = scheduler.schedule(admit=True)
        short.num_computed += chunk.num_tokens
        short.token_ids.append(5)  # now decoding
        long = make_sequence(2, 500, 5, loop)
        scheduler.add(long)
        for _ in range(5):
            plan = scheduler.schedule(admit=True)
            assert plan[0].seq is short and plan[0].num_tokens == 1  # never stalled by the long prompt
            assert plan[1].seq is long and plan[1].num_tokens == 9  # the rest of the budget
            for c in plan:
                c.seq.num_computed += c.num_tokens
            short.token_ids.append(5)
    finally:
        loop.close()
