"""Which offsets may be committed, when records finish out of order.

Per partition, records are registered in fetch order and marked done when their analysis or dead
letter is acknowledged. The committable offset is the first offset not yet done (Kafka commits
"the next record to read"), so a crash re-delivers everything unanswered and nothing answered is
skipped. Pure bookkeeping: no Kafka client, no I/O.

Offsets normally arrive rising. One that does not is either a record still in flight, fetched
again (skipped: its answer is on the way), or the partition's position moved back (an offset
reset, a seek, a re-created topic): then what was pending there is dropped, as on a revocation,
and counting starts again from the new offset.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from aiokafka.structs import TopicPartition


@dataclass
class _PartitionState:
    pending: deque[int] = field(default_factory=deque)  # registered, in fetch order
    done: set[int] = field(default_factory=set)
    next_offset: int | None = None  # one past the last contiguously answered offset; None until then
    last: int | None = None  # the last offset registered


class OffsetTracker:
    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, _PartitionState] = {}
        self._committed: dict[TopicPartition, int] = {}

    def register(self, tp: TopicPartition, offset: int) -> bool:
        """Records a fetched offset; False when it is already pending (a second fetch of a record
        in flight: don't process it twice)."""
        state = self._partitions.setdefault(tp, _PartitionState())
        if state.last is not None and offset <= state.last:
            if offset in state.pending and offset not in state.done:
                return False
            # The position moved back: start over from here (late answers publish, never commit).
            state = self._partitions[tp] = _PartitionState()
        state.pending.append(offset)
        state.last = offset
        return True

    def next_to_read(self, tp: TopicPartition) -> int | None:
        """One past the last offset registered for the partition (None: nothing registered)."""
        state = self._partitions.get(tp)
        return None if state is None or state.last is None else state.last + 1

    def mark_done(self, tp: TopicPartition, offset: int) -> None:
        state = self._partitions.get(tp)
        if state is None or offset not in state.pending:
            return  # revoked meanwhile, or already counted: an answer may still publish, never commit
        state.done.add(offset)
        while state.pending and state.pending[0] in state.done:
            finished = state.pending.popleft()
            state.done.discard(finished)
            state.next_offset = finished + 1

    def num_pending(self, tp: TopicPartition | None = None) -> int:
        if tp is not None:
            state = self._partitions.get(tp)
            return len(state.pending) if state else 0
        return sum(len(s.pending) for s in self._partitions.values())

    def to_commit(self) -> dict[TopicPartition, int]:
        """Offsets that advanced since the last `committed` call."""
        return {
            tp: state.next_offset
            for tp, state in self._partitions.items()
            if state.next_offset is not None and self._committed.get(tp) != state.next_offset
        }

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        self._committed.update(offsets)

    def committed_offset(self, tp: TopicPartition) -> int | None:
        """The last offset this tracker saw committed for the partition (None: none yet)."""
        return self._committed.get(tp)

    def forget(self, partitions: set[TopicPartition]) -> None:
        """Drops revoked partitions: their in-flight answers publish but are not committed here."""
        for tp in partitions:
            self._partitions.pop(tp, None)
            self._committed.pop(tp, None)
