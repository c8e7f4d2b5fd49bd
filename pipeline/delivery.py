"""Where an answer goes: published at once (at-least-once), or staged for its partition's next
Kafka transaction (`PROCESSING_GUARANTEE=exactly_once`). An answer the broker refuses for what it
is (its size) is replaced by a small `answer_rejected` dead letter without the original bytes; a
dead-letter topic that refuses even that is misconfigured, and stops the service (`PublishError`).
"""

from __future__ import annotations

import logging

from aiokafka.structs import TopicPartition

from pipeline.answering import Answerer, Counters
from pipeline.codec import RawRecord
from pipeline.publish import AnswerRejected, Publisher, PublishError
from pipeline.transactions import TransactionalOutbox
from schemas import AnalysisEvent, DeadLetter, DeadLetterReason

log = logging.getLogger(__name__)

Answer = AnalysisEvent | DeadLetter


class Delivery:
    def __init__(
        self,
        answerer: Answerer,
        counters: Counters,
        publisher: Publisher,
        outbox: TransactionalOutbox | None = None,
    ) -> None:
        self.answerer = answerer
        self.counters = counters
        self.publisher = publisher
        self.outbox = outbox  # exactly_once: answers wait for their partition's transaction

    async def deliver(self, raw: RawRecord, answer: Answer) -> Answer:
        """Publishes (or stages) the answer, or the small dead letter that replaces a refused one.
        Returns what was published; PublishError if nothing could be."""
        try:
            await self._publish(raw, answer)
        except AnswerRejected as exc:
            if isinstance(answer, AnalysisEvent):
                self.counters.failed += 1
            small = self.refused(raw, answer, str(exc))
        else:
            return answer
        try:
            await self._publish(raw, small)
        except AnswerRejected as exc:  # even a small dead letter: the topic itself is misconfigured
            raise PublishError(
                f"the dead-letter topic refuses a {len(small.model_dump_json())}-byte record"
            ) from exc
        return small

    async def _publish(self, raw: RawRecord, answer: Answer) -> None:
        """Publishes the answer now, or under exactly_once stages it for its partition's next
        transaction (AnswerRejected either way when it is too large)."""
        if self.outbox is not None:
            tp = TopicPartition(raw.topic, raw.partition)
            self.outbox.stage(tp, raw.offset, answer, lambda reason: self.refused(raw, answer, reason))
        else:
            await self.publisher.publish(answer)
        if isinstance(answer, AnalysisEvent):
            self.counters.processed += 1
        else:
            self.counters.dead_lettered += 1

    def refused(self, raw: RawRecord, answer: Answer, reason: str) -> DeadLetter:
        """The small dead letter published instead of an answer the broker refused."""
        log.warning("answer to %s[%d]@%d refused: %s", raw.topic, raw.partition, raw.offset, reason)
        return self.answerer.dead_letter(
            raw, DeadLetterReason.ANSWER_REJECTED, reason, document_id=answer.document_id, keep_value=False
        )
