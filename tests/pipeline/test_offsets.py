from __future__ import annotations

import random

from aiokafka.structs import TopicPartition
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

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


def test_a_record_fetched_again_while_in_flight_is_not_registered_twice() -> None:
    tracker = OffsetTracker()
    assert tracker.register(TP, 5) and tracker.register(TP, 6)
    assert not tracker.register(TP, 5)
    tracker.mark_done(TP, 5)
    tracker.mark_done(TP, 6)
    assert tracker.to_commit() == {TP: 7}
    assert tracker.next_to_read(TP) == 7


def test_an_offset_reset_starts_the_partition_over_instead_of_raising() -> None:
    """After an offset reset (or a re-created topic) offsets come again from lower down: this
    raised ValueError out of the consume loop. Now counting starts over from the new offset, and
    answers to the old offsets still in flight publish but move no commit."""
    tracker = OffsetTracker()
    for offset in (40, 41, 42):
        tracker.register(TP, offset)
    tracker.mark_done(TP, 40)
    tracker.committed(tracker.to_commit())
    assert tracker.register(TP, 3)
    tracker.mark_done(TP, 41)  # a late answer from before the reset
    assert tracker.to_commit() == {}
    tracker.mark_done(TP, 3)
    assert tracker.to_commit() == {TP: 4}
    assert tracker.num_pending(TP) == 0


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


class TrackerAgainstModel(RuleBasedStateMachine):
    """Interleaved fetches (with offset gaps), out-of-order answers, duplicate answers, commits and
    revocations, checked after every step against a direct statement of the rules: a partition's
    commit point is one past the longest run of answered offsets from the first one fetched (since
    it was last assigned), offered once until it moves, and never past an unanswered offset."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = OffsetTracker()
        self.fetched: dict[TopicPartition, list[int]] = {}
        self.done: dict[TopicPartition, set[int]] = {}
        self.committed: dict[TopicPartition, int] = {}
        self.next_offset: dict[TopicPartition, int] = {}  # the broker's next offset per partition

    @rule(partition=st.integers(0, 2), gap=st.integers(0, 3))
    def fetch(self, partition: int, gap: int) -> None:
        tp = TopicPartition("t", partition)
        offset = self.next_offset.get(tp, 0) + gap  # gaps: compacted or transactional markers
        self.next_offset[tp] = offset + 1
        self.tracker.register(tp, offset)
        self.fetched.setdefault(tp, []).append(offset)
        self.done.setdefault(tp, set())

    @rule(data=st.data())
    def answer(self, data: st.DataObject) -> None:
        candidates = [(tp, o) for tp, offsets in self.fetched.items() for o in offsets]
        if not candidates:
            return
        tp, offset = data.draw(st.sampled_from(candidates))
        self.tracker.mark_done(tp, offset)  # answering twice (a retry) is harmless
        self.done[tp].add(offset)

    @rule(data=st.data())
    def answer_after_revoke(self, data: st.DataObject) -> None:
        """An answer for a partition this worker no longer owns changes nothing."""
        tp = TopicPartition("t", data.draw(st.integers(3, 4)))
        self.tracker.mark_done(tp, data.draw(st.integers(0, 50)))

    @rule()
    def commit(self) -> None:
        offers = self.tracker.to_commit()
        assert offers == self.expected_offers()
        self.tracker.committed(offers)
        self.committed.update(offers)

    @rule(partition=st.integers(0, 2))
    def revoke(self, partition: int) -> None:
        tp = TopicPartition("t", partition)
        self.tracker.forget({tp})
        self.fetched.pop(tp, None)
        self.done.pop(tp, None)
        self.committed.pop(tp, None)

    def commit_point(self, tp: TopicPartition) -> int | None:
        point = None
        for offset in self.fetched.get(tp, []):
            if offset not in self.done[tp]:
                break
            point = offset + 1
        return point

    def expected_offers(self) -> dict[TopicPartition, int]:
        offers = {}
        for tp in self.fetched:
            point = self.commit_point(tp)
            if point is not None and self.committed.get(tp) != point:
                offers[tp] = point
        return offers

    @invariant()
    def never_past_an_unanswered_offset(self) -> None:
        for tp, offset in self.tracker.to_commit().items():
            assert all(o in self.done[tp] for o in self.fetched[tp] if o < offset)
        # Held back: everything from the first unanswered offset on (answered or not).
        held = 0
        for tp, offsets in self.fetched.items():
            point = self.commit_point(tp)
            held += sum(1 for o in offsets if point is None or o >= point)
        assert self.tracker.num_pending() == held


TestTrackerAgainstModel = TrackerAgainstModel.TestCase
TestTrackerAgainstModel.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
