from __future__ import annotations

import random

from aiokafka.structs import TopicPartition

from pipeline.offsets import OffsetTracker

TP = TopicPartition("docs", 0)


def test_commits_only_the_contiguous_prefix_of_done_offsets() -> None:
    tracker = OffsetTracker()
    for offset in range(5):
        tracker.register(TP, offset)
    tracker.mark_done(TP, 2)
    tracker.mark_done(TP, 1)
    assert tracker.to_commit() == {}
    tracker.mark_done(TP, 0)
    assert tracker.to_commit() == {TP: 3}
    tracker.committed({TP: 3})
    assert tracker.to_commit() == {}
    tracker.mark_done(TP, 4)
    assert tracker.to_commit() == {}
    tracker.mark_done(TP, 3)
    assert tracker.to_commit() == {TP: 5}
    assert tracker.num_pending() == 0


def test_gaps_in_offsets_do_not_block() -> None:
    tracker = OffsetTracker()
    for offset in (10, 12, 15):
        tracker.register(TP, offset)
    for offset in (15, 10, 12):
        tracker.mark_done(TP, offset)
    assert tracker.to_commit() == {TP: 16}


def test_revoked_partitions_are_forgotten_and_late_answers_ignored() -> None:
    tracker = OffsetTracker()
    tracker.register(TP, 0)
    tracker.forget({TP})
    tracker.mark_done(TP, 0)
    assert tracker.to_commit() == {}


def test_random_completion_orders_commit_exactly_what_is_done() -> None:
    rng = random.Random(3)
    for _ in range(200):
        tracker = OffsetTracker()
        partitions = [TopicPartition("t", p) for p in range(3)]
        registered = {tp: sorted(rng.sample(range(100), rng.randint(1, 30))) for tp in partitions}
        for tp, offsets in registered.items():
            for offset in offsets:
                tracker.register(tp, offset)
        pending = [(tp, o) for tp, offsets in registered.items() for o in offsets]
        rng.shuffle(pending)
        done: set[tuple[TopicPartition, int]] = set()
        for tp, offset in pending[: rng.randint(0, len(pending))]:
            tracker.mark_done(tp, offset)
            done.add((tp, offset))
        commit = tracker.to_commit()
        for tp, offsets in registered.items():
            prefix = 0
            while prefix < len(offsets) and (tp, offsets[prefix]) in done:
                prefix += 1
            if prefix:
                assert commit[tp] == offsets[prefix - 1] + 1
            else:
                assert tp not in commit
