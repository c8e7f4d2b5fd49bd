"""Human-readable rendering of analysis events and dead letters (terminal, via rich)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from schemas import AnalysisEvent, DeadLetter, Language
from schemas.taxonomy import category_label

_LABELS = {
    Language.ZH: {
        "core": "核心观点 Core viewpoint",
        "key": "关键信息 Key information",
        "facts": "事实 Facts",
        "data": "数据 Data",
        "conclusions": "结论 Conclusions",
        "sentiment": "潜在情感 Latent sentiment",
        "triage": "分诊 Triage",
    },
    Language.EN: {
        "core": "Core viewpoint",
        "key": "Key information",
        "facts": "Facts",
        "data": "Data",
        "conclusions": "Conclusions",
        "sentiment": "Latent sentiment",
        "triage": "Triage",
    },
}
_POLARITY_STYLE = {"positive": "green", "neutral": "yellow", "negative": "red"}


def _bullets(items: list[str]) -> Text:
    return Text("\n".join(f"  • {item}" for item in items) if items else "  —")


def render_event(event: AnalysisEvent) -> RenderableType:
    labels = _LABELS[event.language]
    analysis = event.analysis
    parts: list[RenderableType] = [
        Text(f"1. {labels['core']}", style="bold cyan"),
        Text(f"  {analysis.core_viewpoint}"),
        Text(f"2. {labels['key']}", style="bold cyan"),
    ]
    for name in ("facts", "data", "conclusions"):
        parts += [Text(f"  {labels[name]}", style="bold"), _bullets(getattr(analysis.key_information, name))]
    sentiment = analysis.sentiment
    parts += [
        Text(f"3. {labels['sentiment']}", style="bold cyan"),
        Text.assemble(
            "  ",
            (sentiment.polarity.value, f"bold {_POLARITY_STYLE[sentiment.polarity.value]}"),
            f"   doubt 质疑: {'yes' if sentiment.implies_doubt else 'no'}",
            f"   expectation 期待: {'yes' if sentiment.implies_expectation else 'no'}",
            f"   confidence: {sentiment.confidence:.2f}" if sentiment.confidence is not None else "",
        ),
        Text(f"  {sentiment.rationale}", style="italic"),
    ]
    if analysis.triage is not None:
        triage = analysis.triage
        parts += [
            Text(f"4. {labels['triage']}", style="bold magenta"),
            Text(
                f"  urgency: {triage.urgency.value}   category: {triage.category.value} "
                f"({category_label(triage.category, event.language.value)})   "
                f"escalate: {'YES' if triage.escalate else 'no'}"
                + (f"   safety signals: {', '.join(triage.safety_signals)}" if triage.safety_signals else "")
            ),
        ]
    if analysis.suspected_injection:
        parts.append(Text("  ⚠ suspected injection, withheld from the model:", style="bold red"))
        parts.append(_bullets(analysis.injection_excerpts))
    t = event.timings
    parts.append(
        Text(
            f"{event.model} · queued {t.queued_ms:.0f} ms · first token {t.time_to_first_token_ms:.0f} ms · "
            f"total {t.total_ms / 1000:.1f} s · {t.prompt_tokens}+{t.output_tokens} tokens · "
            f"attempts {t.attempts}",
            style="dim",
        )
    )
    title = f"{event.document_id}  [{event.kind}, {event.language.value}]"
    return Panel(Group(*parts), title=title, title_align="left")


def render_dead_letter(letter: DeadLetter) -> RenderableType:
    body = Table.grid(padding=(0, 2))
    body.add_row("reason", Text(letter.error_type.value, style="bold red"))
    body.add_row("message", letter.error_message)
    body.add_row("source", f"{letter.source.topic}[{letter.source.partition}]@{letter.source.offset}")
    body.add_row("attempts", str(letter.attempts))
    if letter.raw_model_output:
        body.add_row("model output", letter.raw_model_output[:400])
    return Panel(body, title=f"dead letter {letter.document_id or letter.event_id}", border_style="red")
