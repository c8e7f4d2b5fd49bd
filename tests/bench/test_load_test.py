"""The load test harness: its arrival process, its arithmetic, and one small run end to end
through the session's Kafka with the pipeline benchmark's instant analyser (the test is about the
harness's accounting and outputs, not the model's speed, so no model runs here)."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.load_gen import DEPARTMENTS, Sent, load_corpus, schedule
from bench.load_report import Level, max_stable, outcome, percentile, summarise
from bench.load_test import (
    CONFIGS,
    DEFAULT_CONFIGS,
    burst_docs,
    config_settings,
    known_unstable,
    main,
    next_start,
)
from pipeline.settings import Settings


def test_the_corpus_is_the_articles_range_of_lengths_in_both_languages_and_all_kinds() -> None:
    corpus = load_corpus()
    assert len(corpus) >= 100
    assert all(300 <= len(d.text) <= 2_000 for d in corpus)
    assert {d.language.value for d in corpus} == {"zh", "en"}
    assert {d.kind for d in corpus} == {"complaint", "meeting_notes", "filing"}


def test_arrivals_are_poisson_at_the_offered_rate_split_over_the_departments() -> None:
    corpus = load_corpus()
    arrivals = schedule(600.0, 600.0, corpus, seed=3)  # 10 per second for 10 minutes
    assert abs(len(arrivals) - 6_000) < 4 * math.sqrt(6_000)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(arrivals)]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.1)  # exponential: sd = mean
    per_department = {d: sum(a.department == d for a in arrivals) for d in DEPARTMENTS}
    assert all(abs(n - 1_200) < 4 * math.sqrt(1_200) for n in per_department.values())
    assert arrivals == schedule(600.0, 600.0, corpus, seed=3)
    assert arrivals != schedule(600.0, 600.0, corpus, seed=4)


def test_exact_arrivals_offer_the_nominal_count_as_a_poisson_process_would_spread_it() -> None:
    corpus = load_corpus()
    arrivals = schedule(600.0, 600.0, corpus, seed=3, exact=True)
    assert len(arrivals) == 6_000 and all(0 <= a.at_s < 600 for a in arrivals)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(arrivals)]
    assert min(gaps) >= 0
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.1)  # exponential-like
    per_department = {d: sum(a.department == d for a in arrivals) for d in DEPARTMENTS}
    assert all(abs(n - 1_200) < 4 * math.sqrt(1_200) for n in per_department.values())
    # A short level sends its nominal count, every time, rounded up with the window stretched to
    # keep the rate; so does a level that must send at least min_count.
    assert {len(schedule(24.0, 45.0, corpus, seed=s, exact=True)) for s in range(20)} == {18}
    odd = schedule(6.0, 45.0, corpus, seed=1, exact=True)  # 4.5 expected: 5 over 50 s
    assert len(odd) == 5 and max(a.at_s for a in odd) < 50.0
    few = schedule(3.0, 45.0, corpus, seed=1, min_count=4, exact=True)
    assert len(few) == 4 and max(a.at_s for a in few) < 80.0


def _sent(latency_s: float | None, answer: str | None = "analysis", tokens: int = 100) -> Sent:
    sent = Sent("e", "d", "c", 0, "legal", "complaint", "en", 500, sent_ms=1_000_000)
    if answer is not None and latency_s is not None:
        sent.answer, sent.answered_ms, sent.output_tokens = answer, 1_000_000 + int(latency_s * 1000), tokens
        sent.ttft_ms = 500.0
    return sent


def test_a_late_or_missing_answer_is_a_failure_and_a_dead_letter_is_counted_apart() -> None:
    docs = [_sent(5.0) for _ in range(96)] + [_sent(61.0), _sent(None), _sent(2.0, "dead_letter"), _sent(7.0)]
    assert [outcome(d, 60.0) for d in docs[-4:]] == ["timed_out", "timed_out", "dead_letter", "answered"]
    level = summarise("c", 0, 10.0, 60.0, docs, deadline_s=60.0, slo_s=45.0)
    assert (level.sent, level.answered, level.dead_letters, level.timed_out) == (100, 97, 1, 2)
    assert level.failure_rate == pytest.approx(0.02)
    assert level.p50_s == 5.0 and level.p95_s == 5.0 and math.isinf(level.p99_s)
    assert not level.stable  # 2 % timed out, above the 1 % the issue allows


def test_a_level_is_stable_while_p95_is_within_the_slo_and_at_most_one_percent_times_out() -> None:
    fast = summarise("c", 0, 4.0, 60.0, [_sent(10.0)] * 99 + [_sent(None)], 60.0, 45.0)
    slow = summarise("c", 1, 8.0, 60.0, [_sent(10.0)] * 90 + [_sent(50.0)] * 10, 60.0, 45.0)
    assert fast.stable and not slow.stable
    assert max_stable([fast, slow]) is fast
    assert max_stable([slow]) is None
    assert percentile([1.0, 2.0, 3.0, math.inf], 50) == 2.0


def test_a_staircase_level_is_known_to_fail_before_its_last_answers_arrive() -> None:
    collector = SimpleNamespace(resolve=lambda s: s.answer is not None)
    in_time = [_sent(10.0) for _ in range(5)]
    just_sent = Sent("e", "d", "c", 0, "legal", "complaint", "en", 500, sent_ms=time.time() * 1000)
    assert not known_unstable([*in_time, just_sent], collector, 60.0, 45.0)  # it may still make it
    assert not known_unstable([*in_time, _sent(2.0, "dead_letter")], collector, 60.0, 45.0)
    assert known_unstable([*in_time, _sent(None)], collector, 60.0, 45.0)  # long past the deadline
    assert known_unstable([*in_time, _sent(50.0)], collector, 60.0, 45.0)  # P95 of six is the slowest
    assert not known_unstable([_sent(10.0)] * 39 + [_sent(50.0)], collector, 60.0, 45.0)  # P95 of 40: 10 s


def test_the_next_configuration_starts_where_the_previous_one_first_failed() -> None:
    grid = [1.5, 3.0, 6.0, 12.0]
    ok, bad = [_sent(10.0)] * 4, [_sent(None)] * 4

    def level(rate: float, docs: list[Sent]) -> Level:
        return summarise("c", 0, rate, 60.0, docs, 60.0, 45.0)

    assert next_start([level(3.0, ok), level(6.0, bad)], grid) == 6.0
    assert next_start([level(3.0, bad), level(1.5, ok)], grid) == 3.0  # stepped down, then held
    assert next_start([level(3.0, ok), level(6.0, ok)], grid) == 6.0  # held everything it ran
    assert next_start([level(3.0, bad), level(1.5, bad)], grid) == 3.0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_configuration_is_a_worker_setting_the_worker_accepts(name: str) -> None:
    args = SimpleNamespace(kv_pool_mib=64, max_batch=8, model="/models/m", max_document_chars=8_000)
    settings = config_settings("localhost:9092", name, args)
    assert settings.kv_cache_bytes == 64 * 2**20 and settings.kv_compression == ("kv" in name)
    if name.startswith("dynamic_kv4"):  # the capacity profiles: 4 bits, the five sensitive layers at 8
        assert settings.kv_quant_bits == 4 and settings.kv_int8_layers == (9, 11, 13, 16, 21)
        window = 0 if name == "dynamic_kv4w0" else Settings().kv_residual_tokens
        assert settings.kv_residual_tokens == window
    assert DEFAULT_CONFIGS == ("static", "dynamic", "dynamic_kv")  # what `make bench` runs


def test_the_burst_spans_the_corpus_from_shortest_to_longest() -> None:
    corpus = load_corpus()
    lengths = [len(d.text) for d in burst_docs(corpus, 15)]
    assert len(lengths) == 15 and lengths == sorted(lengths)
    assert lengths[0] == min(len(d.text) for d in corpus) and lengths[-1] == max(len(d.text) for d in corpus)


@pytest.mark.integration
def test_a_small_run_accounts_for_every_document_and_writes_report_json_and_plots(
    kafka_servers: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_servers)
    # Documents over 1,000 characters are dead-lettered as too long: the report must count them apart.
    argv = ["--worker", "bench.pipeline_worker", "--configs", "static,dynamic", "--rates", "300", "900",
            "--level-s", "2", "--deadline-s", "20", "--slo-s", "10", "--burst-configs", "dynamic",
            "--max-document-chars", "1000", "--out-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    payload = json.loads((tmp_path / "load.json").read_text())
    docs, accounting = payload["documents"], payload["accounting"]
    assert len(docs) == accounting["sent"] > 20
    assert accounting["answered"] + accounting["dead_letters"] + accounting["timed_out"] == accounting["sent"]
    assert accounting["timed_out"] == 0 and accounting["dead_letters"] > 0
    too_long = [d for d in docs if d["chars"] > 1000]
    assert too_long and all(d["answer"] == "dead_letter" and d["reason"] for d in too_long)
    assert all(d["answer"] == "analysis" and d["latency_s"] >= 0 for d in docs if d["chars"] <= 1000)
    assert len({d["event_id"] for d in docs}) == len(docs)
    levels = payload["levels"]
    # The quick profile starts the second configuration at the first one's highest stable load.
    assert [(lv["config"], lv["offered_per_min"]) for lv in levels] == [
        ("static", 300.0), ("static", 900.0), ("dynamic", 900.0)
    ]  # fmt: skip
    assert sum(lv["sent"] for lv in levels) + payload["bursts"][0]["sent"] == len(docs)
    assert payload["bursts"][0]["sent"] == 15 and payload["bursts"][0]["answered"] > 0
    report = (tmp_path / "load-report.md").read_text()
    for heading in ("## Configurations", "→", "## Every level", "## Burst", "## Accounting"):
        assert heading in report
    for png in ("latency-vs-load.png", "throughput-vs-load.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in report
