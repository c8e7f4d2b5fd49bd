"""Logging set-up for the CLI: the trace and span ids of the current span on each line, and the
filter that keeps a broker outage from flooding the log.

aiokafka logs every failed connection attempt at ERROR, several times a second per client and
node: with the broker down, a worker wrote ~7,900 such lines in 80 s, burying everything else.
`RepeatFilter` lets the first line of a kind through, then the same kind again only after a
pause that doubles each time (1 s, 2 s, 4 s ... up to `max_pause_s`), with the count it held
back. A "kind" is the logger, the level and the message before its arguments are filled in, so
a line that says something new always gets through. The service logs the state changes itself
(cluster unreachable / reachable again: `pipeline.watch`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import trace

FORMAT = "%(asctime)s %(levelname)s %(name)s%(trace)s: %(message)s"


class TraceContextFilter(logging.Filter):
    """Puts the current span's ids on each record: `record.trace` is " [trace_id=… span_id=…]"
    inside a span (W3C hex, as Jaeger, Tempo and the answer events' `trace_id` write them), else ""."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        record.trace = (
            f" [trace_id={context.trace_id:032x} span_id={context.span_id:016x}]" if context.is_valid else ""
        )
        return True


@dataclass
class _Seen:
    next_at: float  # when a line of this kind may pass again
    pause_s: float
    held: int = 0  # lines held back since the last one that passed


class RepeatFilter(logging.Filter):
    def __init__(
        self,
        prefixes: tuple[str, ...] = ("aiokafka",),
        first_pause_s: float = 1.0,
        max_pause_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.prefixes = prefixes
        self.first_pause_s = first_pause_s
        self.max_pause_s = max_pause_s
        self.clock = clock
        self._seen: dict[tuple[str, int, str], _Seen] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not record.name.startswith(self.prefixes):
            return True
        kind = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        seen = self._seen.get(kind)
        if seen is None:
            self._seen[kind] = _Seen(now + self.first_pause_s, self.first_pause_s)
            return True
        if now < seen.next_at:
            seen.held += 1
            return False
        if seen.held:
            record.msg = f"{record.msg} [{seen.held} more like this held back]"
        pause = seen.pause_s * 2 if now - seen.next_at < self.max_pause_s else self.first_pause_s
        seen.pause_s = min(self.max_pause_s, pause)  # a kind quiet for a long while starts over
        seen.next_at, seen.held = now + seen.pause_s, 0
        return True


def setup_logging(level: str) -> None:
    """The process's log format and level, with repeats of the Kafka client's complaints held back."""
    logging.basicConfig(level=level, format=FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RepeatFilter())
        handler.addFilter(TraceContextFilter())
