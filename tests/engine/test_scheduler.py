"""Scheduler + block pool under randomised load, without a model: every request finishes, no
block is lost or shared, budgets hold, and the loop always makes progress."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import SamplingParams
from engine.kv_policy import CompressionConfig, Compressor, select_kept
from engine.request import Request
from engine.scheduler import Chunk, Scheduler, SchedulerConfig
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


def make_sequence(
    seq_id: int, prompt: int | list[int], max_new: int, loop: asyncio.AbstractEventLoop
) -> Sequence:
    ids = [1] * prompt if isinstance(prompt, int) else prompt
    request = Request(seq_id, ids, SamplingParams(max_new_tokens=max_new), loop)
    return Sequence.of(seq_id, request)


def test_a_shared_prefix_block_moves_to_quantised_storage_once_out_of_every_sharers_window() -> None:
    """Adopted prefix blocks are quantised too (in every sharer's table at once), not pinned in
    full precision while any sharer runs; never while inside one sharer's recent window."""
    loop = asyncio.new_event_loop()
    try:
        size = 4
        blocks = BlockManager(num_blocks=12, block_size=size, num_cold_blocks=12)
        scheduler = Scheduler(SchedulerConfig(max_running=2, max_tokens_per_step=32), blocks)
        compressor = Compressor(CompressionConfig(quantising=True, residual_tokens=4), blocks, str)
        head = list(range(100, 116))  # 4 blocks of shared instructions
        first = make_sequence(0, [*head, 1, 2, 3, 4, 5], 10, loop)
        scheduler.add(first)
        for chunk in scheduler.schedule(admit=True):  # the whole prompt in one chunk
            scheduler.computed(chunk)
            chunk.seq.token_ids.append(7)  # its first sampled token
        second = make_sequence(1, [*head, 6], 10, loop)  # ends one token after the shared head
        scheduler.add(second)
        plan = scheduler.schedule(admit=True)
        shared = blocks.table(0)[:4]
        assert blocks.table(1)[:4] == shared and blocks.num_cache_hits == 4
        moves = dict(compressor.moves(scheduler.running).settle)
        # blocks 1 and 2 are out of both windows; block 3 holds the second's last 4 tokens
        assert set(moves) == {shared[1], shared[2]} and not blocks.is_cold(shared[3])
        for seq in (first, second):
            table = blocks.table(seq.seq_id)
            assert table[1:3] == [moves[shared[1]], moves[shared[2]]]
            assert table[0] == shared[0]  # the sink stays
        for chunk in plan:
            scheduler.computed(chunk)
            chunk.seq.token_ids.append(7)
        for _ in range(4):  # the second decodes past its window: block 3 moves too
            for chunk in scheduler.schedule(admit=True):
                scheduler.computed(chunk)
                chunk.seq.token_ids.append(7)
            compressor.moves(scheduler.running)
        assert blocks.is_cold(blocks.table(0)[3]) and blocks.table(0)[3] == blocks.table(1)[3]
        third = make_sequence(2, [*head, 9], 10, loop)  # adopts the quantised prefix
        scheduler.finish(first)
        scheduler.add(third)
        scheduler.schedule(admit=True)
        assert blocks.table(2)[1:4] == blocks.table(1)[1:4] and blocks.num_cache_hits == 8
    finally:
        loop.close()


def test_prompts_read_in_full_precision_adopt_a_settled_prefix_from_its_full_precision_copy() -> None:
    """KV_PROMPT_TOKENS: a running sequence's prefix blocks are quantised once it decodes, and the
    prefix registration stays with their freed full-precision copies (cached, evicted last), so a
    later prompt with the same prefix reads it in full precision; once a copy is evicted, the
    prefix from there on is computed again, never read from a block that now holds other tokens."""
    loop = asyncio.new_event_loop()
    try:
        size = 4
        blocks = BlockManager(num_blocks=12, block_size=size, num_cold_blocks=12)
        scheduler = Scheduler(SchedulerConfig(max_running=3, max_tokens_per_step=32), blocks)
        config = CompressionConfig(
            quantising=True, residual_tokens=0, sink_tokens=0, prompts_full_precision=True
        )
        compressor = Compressor(config, blocks, str)
        head = list(range(100, 116))  # 4 blocks of shared instructions
        first = make_sequence(0, [*head, 1], 10, loop)
        scheduler.add(first)
        for chunk in scheduler.schedule(admit=True):
            scheduler.computed(chunk)
            chunk.seq.token_ids.append(7)  # decoding now
        hot = blocks.table(0)[:4]
        moves = dict(compressor.moves(scheduler.running).settle)
        assert set(moves) == set(hot) and all(blocks.is_cold(b) for b in blocks.table(0)[:4])
        second = make_sequence(1, [*head, 2], 10, loop)
        scheduler.add(second)
        plan = scheduler.schedule(admit=True)
        assert blocks.table(1)[:4] == hot, "the full-precision copies, not the quantised blocks"
        assert [(c.seq.seq_id, c.start) for c in plan if c.seq is second] == [(1, 16)]
        scheduler.finish(second)
        scheduler.finish(first)
        blocks.allocate(99, blocks.num_blocks * size)  # another sequence takes every block: evicted
        blocks.free(99)
        third = make_sequence(2, [*head, 3], 10, loop)
        scheduler.add(third)
        plan = scheduler.schedule(admit=True)
        assert [(c.seq.seq_id, c.start) for c in plan] == [(2, 0)], "evicted: computed again"
    finally:
        loop.close()


@pytest.mark.parametrize(
    ("cold", "window", "sinks", "prompts"),
    [(0, 8, 1, False), (48, 8, 1, False), (48, 0, 0, False), (48, 0, 0, True)],
)
@pytest.mark.parametrize("seed", range(3))
def test_random_load_with_cancellations_pool_exhaustion_and_shared_prefixes(
    seed: int, cold: int, window: int, sinks: int, prompts: bool
) -> None:
    """With `cold` quantised blocks, full blocks also move there once out of the recent window of
    `window` tokens, past `sinks` sink blocks (none and none: every full block, at once). With
    `prompts` (KV_PROMPT_TOKENS) no block a prompt being read holds moves while the pool
    has room for a step and a block per sequence; without room they move, and nothing deadlocks."""
    rng = random.Random(seed)
    loop = asyncio.new_event_loop()
    try:
        # 320 token slots for requests of up to 200 tokens each (or 128 + 384 quantised ones)
        num_blocks, block_size = (16 if cold else 40), 8
        blocks = BlockManager(num_blocks, block_size, num_cold_blocks=cold)
        settled = settled_shared = 0
        config = SchedulerConfig(
            max_running=rng.choice([1, 4, 8]), max_tokens_per_step=rng.choice([16, 64]),
            decode_defer_steps=seed % 2 * 4,  # decodes giving way to prompts keep every invariant too
            saturated_tokens_per_step=rng.choice([0, 96]),  # and larger steps while saturated
            draft_step_tokens=rng.choice([0, 24]),  # and drafts in turn or in equal shares
        )  # fmt: skip

        def draft(seq: Sequence, room: int) -> tuple[int, ...]:  # random guesses, as many as allowed
            left = seq.request.params.max_new_tokens - seq.num_output - 1
            return tuple(rng.randrange(50) for _ in range(min(room, left, rng.randint(0, 5))))

        # Decodes carry drafts (speculative decoding) on every other seed: every invariant holds too.
        scheduler = Scheduler(config, blocks, draft if seed % 2 == 0 else None)
        drafted = 0
        compression = CompressionConfig(
            quantising=True, residual_tokens=window, sink_tokens=sinks * block_size,
            prompts_full_precision=prompts, reserve_blocks=2,
        )  # fmt: skip
        pressed = 0  # steps where prompt blocks moved for want of room
        compressor = Compressor(compression, blocks, str)
        # Prompts start with one of three instructions (or part of one), then their own tokens.
        instructions = [[rng.randrange(50) for _ in range(rng.randint(10, 60))] for _ in range(3)]

        def prompt() -> list[int]:
            head = rng.choice(instructions)[: rng.randint(0, 60)]
            return head + [rng.randrange(50) for _ in range(rng.randint(1, 60))]

        pending = [make_sequence(i, prompt(), rng.randint(1, 80), loop) for i in range(1000)]
        live: list[Sequence] = []
        finished: dict[int, str] = {}
        written: dict[int, tuple[int, int]] = {}  # slot -> (token, position): a stand-in for the KV cache
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
            budget = scheduler.budget  # what this step may carry (larger while saturated)
            assert budget in (config.max_tokens_per_step, config.saturated_tokens_per_step)
            plan = scheduler.schedule(admit=rng.random() < 0.8)
            room = blocks.num_free >= compression.reserve_blocks + len(scheduler.running)
            for hot, moved in compressor.moves(scheduler.running).settle:  # the runner: copy, then compute
                settled += 1
                assert blocks.is_cold(moved) and not blocks.is_cold(hot)
                holders = [s for s in scheduler.running if moved in blocks.table(s.seq_id)]
                settled_shared += len(holders) > 1
                if prompts:
                    reading = any(not s.is_decoding for s in holders)
                    assert not (room and reading), "a prompt being read lost a block with room to spare"
                    pressed += reading
                for s in holders:  # never a sink, never in the recent window of anyone holding it
                    index = blocks.table(s.seq_id).index(moved)
                    assert (
                        compressor.sink_blocks
                        <= index
                        < (s.num_cached - compression.residual_tokens) // block_size
                    )
                for i in range(block_size):
                    written[moved * block_size + i] = written[hot * block_size + i]
            # Invariants of every step.
            assert sum(c.num_tokens + len(c.draft) for c in plan) <= budget
            if any(c.draft for c in plan):  # drafts only in a step of decodes alone
                assert all(c.seq.is_decoding and c.num_tokens == 1 for c in plan)
            assert all(c.num_tokens > 0 for c in plan)
            assert len(scheduler.running) <= config.max_running
            assert len({id(c.seq) for c in plan}) == len(plan)
            owners: dict[int, list[Sequence]] = {}
            for s in scheduler.running:
                for b in blocks.table(s.seq_id):
                    owners.setdefault(b, []).append(s)
            assert blocks.num_used + blocks.num_used_cold == len(owners)
            for b, users in owners.items():
                if len(users) > 1:  # shared: a full block of prompt every user has already computed
                    ends = [(blocks.table(u.seq_id).index(b) + 1) * block_size for u in users]
                    assert all(end <= u.num_computed for end, u in zip(ends, users, strict=True))
            for chunk in plan:
                seq = chunk.seq
                table = blocks.table(seq.seq_id)
                assert seq.status is Status.RUNNING and chunk.start == seq.num_computed
                end = chunk.start + chunk.num_tokens
                assert len(table) * block_size >= end + len(chunk.draft)
                slot = [b * block_size + i for b in table for i in range(block_size)]
                history = [written.get(slot[p]) for p in range(chunk.start)]
                expected = [(seq.token_ids[p], p) for p in range(chunk.start)]
                assert history == expected, "the cache holds another prefix"
                for p, token in enumerate([*seq.token_ids[chunk.start : end], *chunk.draft], chunk.start):
                    assert len(owners[table[p // block_size]]) == 1, "writing into a shared block"
                    assert not blocks.is_cold(table[p // block_size]), "writing into a quantised block"
                    written[slot[p]] = (token, p)
            for chunk in plan:
                seq = chunk.seq
                scheduler.computed(chunk)
                if not chunk.samples:
                    continue
                # The model agrees with a random share of the draft, then samples its own token.
                taken = chunk.draft[: rng.randint(0, len(chunk.draft))]
                drafted += len(taken)
                for i, token in enumerate([*taken, 7]):
                    if i:
                        scheduler.accepted(seq)
                    seq.token_ids.append(token)
                    if seq.num_output >= seq.request.params.max_new_tokens:
                        scheduler.finish(seq)
                        live.remove(seq)
                        finished[seq.seq_id] = "done"
                        break
                if chunk.draft:
                    scheduler.release_drafts(seq)
                    held = len(blocks.table(seq.seq_id))
                    assert held <= blocks.blocks_for(seq.num_cached + 1), "blocks past the next token go back"
        assert len(finished) == 1000, "every request ends: generated out, or cancelled"
        assert (drafted > 1000) == (seed % 2 == 0)
        assert blocks.num_free == num_blocks, "every block returned"
        assert blocks.num_free_cold == cold
        assert (settled > 500) == bool(cold)
        if cold and config.max_running > 1:  # adopted prefixes, too, move once out of every window
            assert settled_shared > 0
        assert list(finished.values()).count("done") > 500
        if prompts and config.max_running > 1:  # 16 full-precision blocks: prompts read together run short
            assert pressed > 0
        assert blocks.num_cache_hits > 100, "shared prefixes should have been reused"
        if config.max_running > 1 and window:  # with none, every full block leaves the pool at once
            assert scheduler.num_preemptions > 0, "the pool should have run out at some point"
    finally:
        loop.close()


def test_prefix_blocks_are_adopted_kept_while_free_and_evicted_last() -> None:
    blocks = BlockManager(num_blocks=4, block_size=4)
    tokens = list(range(10))  # two full blocks and a partial one
    blocks.allocate(1, 10)
    blocks.register(1, tokens, 10)
    assert blocks.num_cached == 2  # the partial block is not a prefix yet
    assert blocks.adopt_prefix(2, [*tokens[:8], 99, 98]) == 8
    assert blocks.table(2) == blocks.table(1)[:2]
    assert blocks.num_used == 3
    blocks.free(1)
    blocks.free(2)
    assert blocks.num_free == 4 and blocks.num_cached == 2
    # Unregistered blocks are reused first; the cached ones survive until memory is needed.
    blocks.allocate(3, 8)
    assert blocks.num_cached == 2
    assert blocks.adopt_prefix(4, tokens) == 8
    # A whole prompt is never adopted: its last token must run to give the next token's logits.
    assert blocks.adopt_prefix(5, tokens[:8]) == 4
    for seq_id in (3, 4, 5):
        blocks.free(seq_id)
    blocks.allocate(6, 16)  # needs the whole pool: the cached blocks are evicted
    assert blocks.num_cached == 0
    blocks.free(6)
    assert blocks.adopt_prefix(7, tokens) == 0
    # Without prefix caching nothing is registered or adopted.
    plain = BlockManager(num_blocks=4, block_size=4, prefix_caching=False)
    plain.allocate(1, 8)
    plain.register(1, tokens, 8)
    assert plain.adopt_prefix(2, tokens) == 0


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


def run_plan(plan: list[Chunk]) -> None:
    """What the runner does with a plan, without a model: tokens computed, a sample appended."""
    for c in plan:
        c.seq.num_computed += c.num_tokens
        if c.samples:
            c.seq.token_ids.append(5)


def test_deferred_decodes_give_way_to_waiting_prompts_at_most_n_steps_in_a_row() -> None:
    """With `decode_defer_steps` 3, a running decode waits while a long prompt is read: three
    steps of prompt only, then one step that decodes first, and so on; once no prompt waits,
    decodes run every step."""
    loop = asyncio.new_event_loop()
    try:
        config = SchedulerConfig(max_running=4, max_tokens_per_step=10, decode_defer_steps=3)
        scheduler = Scheduler(config, BlockManager(64, 16))
        short = make_sequence(1, 3, 50, loop)
        scheduler.add(short)
        run_plan(scheduler.schedule(admit=True))  # its prompt and first token: now decoding
        long = make_sequence(2, 78, 5, loop)  # 3 x 10 + 9 + 3 x 10 + 9 tokens
        scheduler.add(long)
        shapes = []
        for _ in range(10):
            plan = scheduler.schedule(admit=True)
            shapes.append([(c.seq.seq_id, c.num_tokens) for c in plan])
            run_plan(plan)
        deferred, decoding = [(2, 10)], [(1, 1), (2, 9)]
        assert shapes[:8] == [deferred] * 3 + [decoding] + [deferred] * 3 + [decoding]
        assert shapes[8] == shapes[9] == [(1, 1), (2, 1)], "no prompt waits: everyone decodes"
    finally:
        loop.close()


def test_decodes_are_not_deferred_into_a_preemption_or_an_empty_step() -> None:
    """Deferral needs room: with too few free blocks for a full step of prompt plus every
    decode's next token, or no prompt the step could read, decodes run first as without it."""
    loop = asyncio.new_event_loop()
    try:
        for blocks, running, expected in ((4, 4, [(1, 1), (2, 9)]), (64, 1, [(1, 1)])):
            config = SchedulerConfig(max_running=running, max_tokens_per_step=10, decode_defer_steps=8)
            scheduler = Scheduler(config, BlockManager(blocks, 16))
            short = make_sequence(1, 3, 50, loop)
            scheduler.add(short)
            run_plan(scheduler.schedule(admit=True))
            scheduler.add(make_sequence(2, 40, 5, loop))  # waits: admission full when running == 1
            plan = scheduler.schedule(admit=True)
            assert [(c.seq.seq_id, c.num_tokens) for c in plan] == expected
            assert scheduler.num_preemptions == 0
    finally:
        loop.close()


def test_a_saturated_scheduler_reads_prompts_in_larger_steps() -> None:
    """With `saturated_tokens_per_step` 30 over a budget of 10 and room for 4: while fewer than 4
    requests are running or waiting, steps carry 10 tokens; from the 4th on, 30 (decodes riding
    along included); once requests finish and fewer than 4 remain, 10 again."""
    loop = asyncio.new_event_loop()
    try:
        config = SchedulerConfig(max_running=4, max_tokens_per_step=10, saturated_tokens_per_step=30)
        scheduler = Scheduler(config, BlockManager(64, 16))
        seqs = [make_sequence(i, 100, 2, loop) for i in range(4)]
        for seq in seqs[:3]:
            scheduler.add(seq)
        sizes = []
        for _ in range(2):
            plan = scheduler.schedule(admit=True)
            sizes.append(sum(c.num_tokens for c in plan))
            run_plan(plan)
        scheduler.add(seqs[3])
        for _ in range(2):
            plan = scheduler.schedule(admit=True)
            sizes.append(sum(c.num_tokens for c in plan))
            run_plan(plan)
        assert sizes == [10, 10, 30, 30]
        scheduler.finish(seqs[3])
        assert scheduler.budget == 10
        unsaturated = Scheduler(replace(config, saturated_tokens_per_step=0), BlockManager(64, 16))
        for seq in [make_sequence(i, 100, 2, loop) for i in range(4)]:
            unsaturated.add(seq)
        assert sum(c.num_tokens for c in unsaturated.schedule(admit=True)) == 10
    finally:
        loop.close()


def test_a_newcomers_first_token_step_carries_no_partial_prompt_chunk() -> None:
    """A short request arriving while a long prompt is read gets its first token in a step of
    its own; the long prompt gives way at most every other step, so newcomers cannot starve it;
    requests that arrive together share steps as before."""
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(SchedulerConfig(8, 32, together_s=0.0), BlockManager(256, 16))
        long = make_sequence(1, 200, 5, loop)
        scheduler.add(long)
        (chunk,) = scheduler.schedule(admit=True)
        assert chunk.num_tokens == 32 and not chunk.samples
        long.num_computed += chunk.num_tokens
        shapes = []
        for i in range(4):  # a short newcomer every step
            scheduler.add(make_sequence(10 + i, 6, 5, loop))
            plan = scheduler.schedule(admit=True)
            shapes.append([(c.seq is long, c.num_tokens, c.samples) for c in plan])
            for c in plan:
                c.seq.num_computed += c.num_tokens
                if c.samples:
                    c.seq.token_ids.append(5)
        assert shapes[0] == [(False, 6, True)]  # the newcomer alone: the long chunk waits
        assert shapes[1] == [(False, 1, True), (False, 6, True), (True, 25, False)]  # not twice
        assert shapes[2] == [(False, 1, True), (False, 1, True), (False, 6, True)]
        assert shapes[3][-1] == (True, 23, False)
        # Requests that arrived together are batched as usual: no step is kept short for them.
        burst = Scheduler(SchedulerConfig(8, 32, together_s=60.0), BlockManager(256, 16))
        together = [make_sequence(20, 200, 5, loop), make_sequence(21, 6, 5, loop)]
        for seq in together:
            burst.add(seq)
        plan = burst.schedule(admit=True)
        assert [(c.seq.seq_id, c.num_tokens) for c in plan] == [(21, 6), (20, 26)]
    finally:
        loop.close()


def test_a_newcomer_with_a_cached_prefix_counts_only_what_it_must_compute() -> None:
    """Shortest-first ordering looks past a waiting prompt's cached prefix: a 200-token request
    whose first 192 tokens are cached goes before a running prompt with 36 tokens left, and its
    step carries nothing of that prompt."""
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(SchedulerConfig(max_running=8, max_tokens_per_step=64), BlockManager(256, 16))
        shared = list(range(100, 300))
        first = make_sequence(1, shared, 5, loop)
        scheduler.add(first)
        while first.num_pending:
            (chunk,) = scheduler.schedule(admit=True)
            scheduler.computed(chunk)
        scheduler.finish(first)  # its blocks stay cached
        long = make_sequence(2, 164, 5, loop)
        scheduler.add(long)
        for _ in range(2):  # two chunks of 64 read
            plan = scheduler.schedule(admit=True)
            for c in plan:
                c.seq.num_computed += c.num_tokens
        assert long.num_pending == 164 - 128
        newcomer = make_sequence(3, [*shared[:-1], 9], 5, loop)  # differs only in its last token
        scheduler.add(newcomer)
        plan = scheduler.schedule(admit=True)
        assert [(c.seq.seq_id, c.start, c.num_tokens, c.samples) for c in plan] == [(3, 192, 8, True)]
    finally:
        loop.close()


@pytest.mark.parametrize("seed", range(2))
def test_random_load_with_pruning_and_quantised_blocks(seed: int) -> None:
    """Prompts pruned to about half once read (compacted, the tail released), old blocks
    quantised: the cache always holds exactly each sequence's kept tokens, every block returns."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    loop = asyncio.new_event_loop()
    try:
        size = 8
        blocks = BlockManager(24, size, prefix_caching=False, num_cold_blocks=48)
        compression = CompressionConfig(
            quantising=True,
            residual_tokens=8,
            sink_tokens=size,
            pruning=True,
            keep_ratio=0.5,
            observe_tokens=4,
        )
        config = SchedulerConfig(
            max_running=rng.choice([4, 8]), max_tokens_per_step=rng.choice([16, 64]),
            prune_window=compression.prune_window,
        )  # fmt: skip
        scheduler = Scheduler(config, blocks)
        compressor = Compressor(compression, blocks, str)
        prompts = [[rng.randrange(50) for _ in range(rng.randint(1, 120))] for _ in range(300)]
        pending = [make_sequence(i, p, rng.randint(1, 60), loop) for i, p in enumerate(prompts)]
        written: dict[int, tuple[int, int]] = {}  # slot -> (token, position)
        held: dict[int, list[int]] = {}  # seq id -> positions its cache holds, in cache order
        finished = pruned = 0
        for _ in range(100_000):
            if not (pending or scheduler.has_work):
                break
            for _ in range(rng.randint(0, 2)):
                if pending:
                    scheduler.add(pending.pop())
            plan = scheduler.schedule(admit=True)
            moves = compressor.moves(scheduler.running)
            for source, destination in moves.copies:  # what the runner does first
                values = [written.get(s) for s in source]
                for d, v in zip(destination, values, strict=True):
                    written[d] = v  # type: ignore[assignment]
            for hot, cold in moves.settle:
                for i in range(size):
                    written[cold * size + i] = written[hot * size + i]
            for chunk in plan:
                seq = chunk.seq
                table = blocks.table(seq.seq_id)
                slot = [b * size + i for b in table for i in range(size)]
                if chunk.start == 0:
                    held[seq.seq_id] = []
                positions = held[seq.seq_id]
                assert len(positions) == chunk.start - seq.num_dropped == seq.num_cached
                assert [written.get(slot[i]) for i in range(len(positions))] == [
                    (seq.token_ids[p], p) for p in positions
                ]
                if chunk.samples and not seq.pruned:
                    assert chunk.num_tokens >= min(config.prune_window, len(seq.token_ids)), (
                        "window in the final chunk"
                    )
                for p in range(chunk.start, chunk.start + chunk.num_tokens):
                    index = p - seq.num_dropped
                    assert not blocks.is_cold(table[index // size])
                    written[slot[index]] = (seq.token_ids[p], p)
                    positions.append(p)
            for chunk in plan:
                seq = chunk.seq
                scheduler.computed(chunk)
                if not chunk.samples:
                    continue
                if not seq.pruned:
                    kept = select_kept(torch.rand(seq.num_cached), 0.5, sinks=2, window=4).tolist()
                    before = seq.num_dropped
                    compressor.drop(seq, kept)
                    if seq.num_dropped > before:
                        held[seq.seq_id] = [held[seq.seq_id][i] for i in kept]
                        pruned += 1
                seq.token_ids.append(7)
                if seq.num_output >= seq.request.params.max_new_tokens:
                    scheduler.finish(seq)
                    finished += 1
        assert finished == 300
        assert pruned > 100
        assert (blocks.num_free, blocks.num_free_cold) == (24, 48), "every block returned"
    finally:
        loop.close()


def test_drafts_fill_a_step_of_decodes_alone_within_budget_and_free_blocks() -> None:
    """Drafts ride only in steps without prompt chunks, decode by decode until the budget is
    spent, and never take more blocks than are free."""
    loop = asyncio.new_event_loop()
    try:
        asked: list[int] = []

        def draft(seq: Sequence, room: int) -> tuple[int, ...]:
            asked.append(room)
            return (9,) * 4

        blocks = BlockManager(16, 4)
        scheduler = Scheduler(SchedulerConfig(max_running=4, max_tokens_per_step=10), blocks, draft)
        first, second = make_sequence(1, 3, 50, loop), make_sequence(2, 3, 50, loop)
        for seq in (first, second):
            scheduler.add(seq)
        run_plan(scheduler.schedule(admit=True))  # both prompts and first tokens: now decoding
        long = make_sequence(3, 9, 5, loop)
        scheduler.add(long)
        plan = scheduler.schedule(admit=True)  # decodes and a prompt chunk: no drafts
        assert [(c.seq.seq_id, c.num_tokens, c.draft) for c in plan] == [(1, 1, ()), (2, 1, ()), (3, 8, ())]
        assert not asked
        run_plan(plan)
        plan = scheduler.schedule(admit=True)  # the prompt's last token: still no drafts
        assert not any(c.draft for c in plan) and not asked
        run_plan(plan)
        plan = scheduler.schedule(admit=True)  # decodes alone: 3 tokens, 7 left to share out
        assert [len(c.draft) for c in plan] == [4, 3, 0] and asked == [7, 3]
        run_plan(plan)
        for c in plan:
            scheduler.release_drafts(c.seq)
        assert blocks.num_free == 16 - sum(blocks.blocks_for(s.num_cached + 1) for s in (first, second, long))
        tight = BlockManager(2, 4)  # one block each: no free block for a draft to spill into
        scheduler = Scheduler(SchedulerConfig(max_running=2, max_tokens_per_step=10), tight, draft)
        for seq in (make_sequence(4, 2, 50, loop), make_sequence(5, 2, 50, loop)):
            scheduler.add(seq)
        run_plan(scheduler.schedule(admit=True))
        plan = scheduler.schedule(admit=True)
        assert [len(c.draft) for c in plan] == [0, 0], "a draft that needs a block nobody has waits"
    finally:
        loop.close()


def test_drafts_share_the_step_tokens_equally_so_fewer_decodes_guess_further() -> None:
    """With `draft_step_tokens` T, each of a step's m decodes may guess (T - m) // m tokens (within
    the budget): a full batch a few each, the last decodes of a burst many; none once m > T / 2."""
    loop = asyncio.new_event_loop()
    try:
        asked: list[int] = []

        def draft(seq: Sequence, room: int) -> tuple[int, ...]:
            asked.append(room)
            return (9,) * room

        def decoding(count: int, step_tokens: int, budget: int = 40) -> list[Chunk]:
            asked.clear()
            config = SchedulerConfig(max_running=8, max_tokens_per_step=budget, draft_step_tokens=step_tokens)
            scheduler = Scheduler(config, BlockManager(64, 4), draft)
            for i in range(count):
                scheduler.add(make_sequence(i, 3, 50, loop))
            run_plan(scheduler.schedule(admit=True))  # prompts and first tokens: now decoding
            return scheduler.schedule(admit=True)

        plan = decoding(3, step_tokens=12)
        assert [len(c.draft) for c in plan] == [3, 3, 3] and asked == [3, 3, 3]
        assert [len(c.draft) for c in decoding(1, step_tokens=12)] == [11]
        assert [len(c.draft) for c in decoding(1, step_tokens=60)] == [39], "never past the budget"
        assert [len(c.draft) for c in decoding(7, step_tokens=12)] == [0] * 7 and not asked
        assert [len(c.draft) for c in decoding(3, step_tokens=0)] == [37, 0, 0], "0: the budget, in turn"
    finally:
        loop.close()
