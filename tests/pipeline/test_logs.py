"""`RepeatFilter` on a fake clock: a broker outage's flood of identical Kafka-client lines becomes a
handful, while anything new, anything of ours and anything below WARNING gets through untouched."""

from __future__ import annotations

import itertools
import logging
import re

import pytest

from pipeline.logs import RepeatFilter

CONNECT_FAILED = 'Unable connect to "%s": [Errno 111] Connect call failed'
HELD = re.compile(r"\[(\d+) more like this held back\]$")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(
    msg: str = CONNECT_FAILED,
    *args: object,
    name: str = "aiokafka",
    level: int = logging.ERROR,
) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args or ("127.0.0.1:9092",), None)


def test_an_outage_flood_becomes_a_dozen_lines_with_doubling_pauses_and_held_counts() -> None:
    """What the issue saw: ~7,900 identical aiokafka ERROR lines in 80 s with the broker down.
    Through the filter: the first at once, then one after 1, 2, 4, 8 ... s, each saying how many
    it stands for, so the log still shows the outage went on and how hard the client retried."""
    clock = FakeClock()
    repeats = RepeatFilter(first_pause_s=1.0, max_pause_s=60.0, clock=clock)
    total, span_s = 10_000, 80.0
    passed: list[tuple[int, float, str]] = []  # (index, time, message)
    for i in range(total):
        clock.now = i * span_s / total
        line = record()
        if repeats.filter(line):
            passed.append((i, clock.now, line.getMessage()))

    assert len(passed) <= 12
    assert passed[0][:2] == (0, 0.0)
    assert not HELD.search(passed[0][2])  # the first one stands for itself
    gaps = [later[1] - earlier[1] for earlier, later in itertools.pairwise(passed)]
    assert gaps == pytest.approx([1.0, 2.0, 4.0, 8.0, 16.0, 32.0], abs=span_s / total)
    for earlier, later in itertools.pairwise(passed):
        held = HELD.search(later[2])
        assert held is not None, later[2]
        assert int(held.group(1)) == later[0] - earlier[0] - 1  # exactly the lines in between


def test_a_new_message_passes_though_its_neighbours_are_held() -> None:
    """A kind is the message before its arguments are filled in: a different message is news and
    passes at once; the same message about another node or error is the same complaint, held."""
    clock = FakeClock()
    repeats = RepeatFilter(clock=clock)
    assert repeats.filter(record())
    assert not repeats.filter(record(CONNECT_FAILED, "127.0.0.1:9093"))  # same kind, other address
    for message in ("Unable to update metadata from %s", "Failed fetch messages from %s", "Heartbeat %s"):
        assert repeats.filter(record(message, "111"))
    # The same message at another level or from another aiokafka logger is another kind too.
    assert repeats.filter(record(level=logging.WARNING))
    assert repeats.filter(record(name="aiokafka.consumer.fetcher"))


@pytest.mark.parametrize(
    ("name", "level"),
    [
        ("pipeline.service", logging.ERROR),  # ours: the service already logs once per change
        ("pipeline.watch", logging.WARNING),
        ("aiokafka", logging.INFO),  # joins, assignments: rare, and what one reads after an incident
        ("aiokafka.consumer.group_coordinator", logging.DEBUG),
    ],
)
def test_other_loggers_and_lines_below_warning_are_never_held(name: str, level: int) -> None:
    """Only the Kafka client's complaints are rate-limited; nothing else may go missing."""
    clock = FakeClock()
    repeats = RepeatFilter(clock=clock)
    lines = [record(name=name, level=level) for _ in range(1_000)]
    assert all(repeats.filter(line) for line in lines)
    assert not any(HELD.search(line.getMessage()) for line in lines)


def test_a_kind_quiet_for_longer_than_the_longest_pause_starts_over() -> None:
    """A second outage an hour after the first is news: its first line passes at once and the
    pauses start again from the first, not from where the last outage left them."""
    clock = FakeClock()
    repeats = RepeatFilter(first_pause_s=1.0, max_pause_s=60.0, clock=clock)
    for step in range(10_000):  # a long outage: the pause grows to its cap
        clock.now = step * 0.05
        repeats.filter(record())
    assert not repeats.filter(record())  # still within the (long) pause

    clock.now += 3_600.0
    first = record()
    assert repeats.filter(first)
    clock.now += 0.5
    assert not repeats.filter(record())
    clock.now += 0.5
    second = record()
    assert repeats.filter(second)  # one first pause after, not 60 s
    assert HELD.search(second.getMessage()) is not None


def test_a_line_inside_a_span_carries_its_trace_and_span_ids_and_one_outside_none() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from pipeline.logs import FORMAT, TraceContextFilter

    formatter, context_filter = logging.Formatter(FORMAT), TraceContextFilter()

    def line(message: str) -> str:
        record = logging.LogRecord("pipeline.service", logging.INFO, __file__, 1, message, None, None)
        assert context_filter.filter(record)
        return formatter.format(record)

    assert line("outside").endswith(" INFO pipeline.service: outside")
    with TracerProvider().get_tracer("t").start_as_current_span("process") as span:
        context = span.get_span_context()
        inside = line("inside")
    assert f"[trace_id={context.trace_id:032x} span_id={context.span_id:016x}]: inside" in inside
