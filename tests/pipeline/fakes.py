"""A stand-in engine for delivery tests: fast, deterministic, no model.

It reads the document back out of the prompt and answers with a valid analysis, except for
documents containing "MODEL-FAIL" (invalid output every time) or "MODEL-REPAIR" (invalid first,
valid on the repair attempt).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from engine import EngineConfig, EngineStats, GenerationResult, SamplingParams
from pipeline.telemetry import PROVIDER
from prompts.render import CONTENT_FREE


class ScriptedEngine:
    def __init__(
        self,
        delay_s: float = 0.0,
        model_id: str = "scripted",
        kv_compression: bool = False,
        config: EngineConfig | None = None,
        piece_delay_s: float = 0.0,
    ) -> None:
        self.delay_s = delay_s
        self.piece_delay_s = piece_delay_s  # between the pieces of a streamed answer
        self.config = config or EngineConfig(model_path=Path(model_id), kv_compression=kv_compression)
        self.kv_compression = self.config.kv_compression
        self._model_id = model_id
        self.calls = 0
        self.scored = 0  # label questions answered
        self.hidden_asked = 0  # hidden states read (a polarity probe's input)
        self.generated = 0  # tokens of every answer so far
        self.active = 0
        self.max_concurrent = 0
        self.prepared: list[str] = []  # schemas compiled ahead, in order

    provider = PROVIDER  # it stands in for the embedded engine

    @property
    def model_id(self) -> str:
        return self._model_id

    async def prepare(self, json_schema: str) -> None:
        self.prepared.append(json_schema)

    async def generate(
        self,
        messages: Sequence[dict[str, str]],
        params: SamplingParams | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        self.calls += 1
        self.active += 1
        self.max_concurrent = max(self.max_concurrent, self.active)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.active -= 1
        user = next(m["content"] for m in reversed(messages) if "<document>" in m["content"])
        document = user.split("<document>")[-1].split("</document>")[0].strip()
        is_repair = messages[-1]["content"] != user
        chinese = messages[0]["content"].startswith("你")  # the prompt's language: the answer's
        if "MODEL-FAIL" in document or ("MODEL-REPAIR" in document and not is_repair):
            text = '{"core_viewpoint": "unterminated'
        else:
            analysis: dict[str, object] = {
                "core_viewpoint": f"作者认为这份文档说的是：{document[:40]}"
                if chinese
                else f"The writer says that {document[:40]}",
                "key_information": {
                    "facts": [document[:60]],
                    "data": [str(len(document))],
                    "conclusions": [],
                },
                "rationale": "脚本给出的理由" if chinese else "scripted",
            }
            own = (
                json.loads(params.json_schema).get("properties", {}).get("fields")
                if params and params.json_schema
                else None
            )
            if own:  # a kind's own fields: a value of each one's type
                values = {"string": f"{document[:20]}", "array": [document[:20]], "boolean": True}
                analysis["fields"] = {
                    name: values[shape["type"]] for name, shape in own["properties"].items()
                }
            text = json.dumps(analysis)
        if on_text is not None:  # written in pieces, as a model streams it
            for start in range(0, len(text), 8):
                on_text(text[start : start + 8])
                await asyncio.sleep(self.piece_delay_s)
        self.generated += len(text) // 4 + 1
        return GenerationResult(
            text=text,
            token_ids=list(range(len(text) // 4 + 1)),
            prompt_tokens=sum(len(m["content"]) for m in messages),
            finish_reason="stop",
            queued_s=0.001,
            ttft_s=0.002,
            total_s=self.delay_s + 0.003,
            batch_size=1,
        )

    async def score(self, messages: Sequence[dict[str, str]], continuations: Sequence[str]) -> list[float]:
        """Labels without a model: yes to every yes/no question, negative over positive (no
        preference on content-free calibration inputs), and the second option of longer lists
        (category product_quality, urgency medium)."""
        self.scored += 1
        preferred = {2: 0, 3: 1}.get(len(continuations), 1)
        if tuple(continuations) in {("positive", "negative"), ("正面", "负面")}:
            document = messages[-1]["content"].split("<document>")[-1].split("</document>")[0].strip()
            if document in CONTENT_FREE:
                return [0.0] * len(continuations)
            preferred = 1
        return [0.0 if i == preferred else -2.0 for i in range(len(continuations))]

    async def hidden(self, messages: Sequence[dict[str, str]], depth: int) -> list[float]:
        """A scripted state of four values: its first is +1 for a document that says "good" (or
        "好"), else -1; its second the depth asked (a probe reading the first finds the side)."""
        self.hidden_asked += 1
        document = messages[-1]["content"].split("<document>")[-1].split("</document>")[0]
        return [1.0 if ("good" in document or "好" in document) else -1.0, float(depth), 0.0, 0.0]

    def stats(self) -> EngineStats:
        return EngineStats(
            model_id=self.model_id,
            device="cpu",
            dtype="none",
            num_waiting=0,
            num_running=0,
            num_steps=self.calls,
            num_finished=self.calls,
            num_generated_tokens=self.generated,
            num_preemptions=0,
            mean_batch_size=1.0 if self.calls else 0.0,
            largest_batch=1 if self.calls else 0,
            kv_total_bytes=1024,
            kv_used_bytes=0,
            kv_bytes_per_token=8,
            kv_tokens=0,
            kv_quant_bits=4 if self.kv_compression else None,
            kv_cold_bytes_per_token=2.5 if self.kv_compression else 0.0,
            kv_reader="torch" if self.kv_compression else None,
            decode_reader="torch",
            prefix_caching=False,
            prefix_cached_blocks=0,
            prefix_hit_tokens=0,
        )
