"""The load test's arithmetic and its outputs: per-level summaries, the stability rule, the markdown
report (the article's two tables, ours), and the plots.

A document is `answered` when its analysis arrived within the deadline, `dead_letter` when a dead
letter arrived (counted apart from failures, as the issue asks), and `timed_out` otherwise, whether
its answer came late or never. Percentiles count a timed-out document as infinitely late, so a
level where more than 5 % time out has an infinite P95.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.load_gen import Sent


def outcome(sent: Sent, deadline_s: float) -> str:
    if sent.answer == "dead_letter":
        return "dead_letter"
    latency = sent.latency_s
    if sent.answer == "analysis" and latency is not None and latency <= deadline_s:
        return "answered"
    return "timed_out"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); inf entries count as the largest values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class Level:
    config: str
    level: int
    offered_per_min: float
    window_s: float  # how long documents were being sent
    sent: int
    answered: int
    dead_letters: int
    timed_out: int
    p50_s: float
    p95_s: float
    p99_s: float
    mean_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    completed_per_min: float  # answered within the deadline, per minute of the arrival window
    tokens_per_s: float  # output tokens of those, per second from the first send to the last answer
    concurrency: float  # mean documents in flight over the window (sum of latencies / window)
    stable: bool

    @property
    def sent_per_min(self) -> float:
        """The load a level actually offered: a short Poisson level sends more or fewer documents
        than its nominal rate."""
        return self.sent / self.window_s * 60 if self.window_s else 0.0

    @property
    def failure_rate(self) -> float:
        return self.timed_out / self.sent if self.sent else 0.0


def summarise(
    config: str,
    level: int,
    offered_per_min: float,
    window_s: float,
    docs: list[Sent],
    deadline_s: float,
    slo_s: float,
) -> Level:
    kinds = [outcome(s, deadline_s) for s in docs]
    answered = [s for s, k in zip(docs, kinds, strict=True) if k == "answered"]
    latencies = [
        s.latency_s if k == "answered" else math.inf
        for s, k in zip(docs, kinds, strict=True)
        if k != "dead_letter"
    ]  # type: ignore[misc]
    ttfts = [s.ttft_ms / 1000 for s in answered if s.ttft_ms is not None]
    finite = [x for x in latencies if math.isfinite(x)]
    first = min((s.sent_ms for s in docs), default=0)
    last = max((s.answered_ms or 0 for s in answered), default=first)
    span_s = max((last - first) / 1000, 1e-9)
    in_flight_s = sum(min(s.latency_s or deadline_s, deadline_s) for s in docs)
    timed_out = kinds.count("timed_out")
    p95 = percentile(latencies, 95)
    return Level(
        config, level, offered_per_min, window_s, len(docs), len(answered), kinds.count("dead_letter"), timed_out,
        percentile(latencies, 50), p95, percentile(latencies, 99), sum(finite) / len(finite) if finite else math.nan,
        percentile(ttfts, 50), percentile(ttfts, 95), len(answered) / window_s * 60 if window_s else 0.0,
        sum(s.output_tokens or 0 for s in answered) / span_s, in_flight_s / window_s if window_s else 0.0,
        bool(docs) and p95 <= slo_s and timed_out <= 0.01 * len(docs),
    )  # fmt: skip


def max_stable(levels: list[Level]) -> Level | None:
    """The highest offered load this configuration held (its levels run in rising order and stop at
    the first unstable one)."""
    stable = [lv for lv in levels if lv.stable]
    return max(stable, key=lambda lv: lv.offered_per_min) if stable else None


def _fmt(value: float | None, digits: int = 1, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "timed out"
    return f"{value:.{digits}f}{unit}"


def _change(before: float | None, after: float | None, higher_is_better: bool) -> str:
    if before is None or after is None or not all(map(math.isfinite, (before, after))) or before == 0:
        return "-"
    ratio = after / before
    if after == before:
        return "same (1.00x)"
    arrow = "↑" if ratio > 1 else "↓"
    better = (ratio > 1) == higher_is_better
    return f"{arrow}{abs(ratio - 1):.0%} ({ratio:.2f}x, {'better' if better else 'worse'})"


def markdown(payload: dict[str, Any], levels: list[Level], plots: list[str]) -> str:
    meta, configs = payload["machine"], payload["configs"]
    by_config: dict[str, list[Level]] = {
        c["name"]: [lv for lv in levels if lv.config == c["name"]] for c in configs
    }
    lines = [
        f"# Load test ({payload['profile']} profile)", "",
        f"Machine: {meta['cpus']} CPUs ({meta['cpu_model']}), {meta['memory_gib']:.0f} GiB, {meta['device']}; "
        f"model {meta['model']} in {meta['dtype']}; broker: {meta['broker']}. Run {payload['started']}, "
        f"{payload['wall_s'] / 60:.1f} min.", "",
        f"Workload: {len(payload['departments'])} departments, each a Poisson stream of documents "
        f"({payload['corpus_docs']} corpus documents of 300-2,000 characters, zh/en, three kinds). Offered load "
        f"rises level by level (at least {payload['level_s']:.0f} s of arrivals and {payload['min_docs']} documents "
        f"each) until P95 latency exceeds the SLO of {payload['slo_s']:.0f} s or more than 1 % of documents are not "
        f"answered within {payload['deadline_s']:.0f} s"
        + (f", the first configuration starting at {payload['start']:g}/min (one step down the grid at a time if "
           "that does not hold)" if payload.get("start") else "")
        + (", each next configuration starting at the lowest load the previous one failed (stepping down if it "
           "cannot hold that)" if payload["skip_held_loads"] else "")
        + (". Levels follow each other without a pause (a staircase: documents still in flight from one level "
           "meet the next), and the sweep stops once a level is known to fail" if payload.get("staircase") else "")
        + f". KV pool {payload['kv_pool_mib']} MiB and MAX_BATCH_SIZE {payload['max_batch_size']} for every "
        "configuration; the workers start together, each reports every grammar compiled and answers one "
        "unmeasured warm-up document, then idles until its configuration is measured (so the configurations "
        "measured first have idle workers beside them, holding memory, not compute). Throughput = "
        "documents answered within the deadline per minute of the arrival window; concurrency = mean documents "
        "in flight over the window (sum of latencies / window). "
        + ("Each level sends the number of documents its load expects in its window (Poisson arrivals "
           "conditioned on their count: random times, random departments; rounded up, the window stretched to "
           "match), so sent/min is the nominal load." if payload.get("exact_counts") else
           "A short Poisson level sends more or fewer documents than its nominal rate: sent/min is what it "
           "really offered, so throughput can exceed the nominal load, not that."), "",
        "## Configurations, at their highest stable load", "",
        "| configuration | max stable load (docs/min) | mean latency | P95 latency | throughput (docs/min) | tokens/s | max stable concurrency | peak RSS | peak KV used / pool |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for c in configs:
        best = max_stable(by_config[c["name"]])
        lines.append(
            f"| {c['label']} | {_fmt(best.offered_per_min if best else None)} | {_fmt(best.mean_s if best else None, 1, ' s')} | "
            f"{_fmt(best.p95_s if best else None, 1, ' s')} | {_fmt(best.completed_per_min if best else None)} | "
            f"{_fmt(best.tokens_per_s if best else None)} | {_fmt(best.concurrency if best else None)} | "
            f"{c['peak_rss_mib']:.0f} MiB | {_fmt(c['kv_peak_used_mib'], 0)} / {_fmt(c['kv_total_mib'], 0)} MiB |"
        )  # fmt: skip
    base, new = configs[0]["name"], configs[1]["name"] if len(configs) > 1 else None
    if new is not None:
        lines += _before_after(by_config[base], by_config[new], configs[0], configs[1])
    if len(configs) > 2:
        lines += _before_after(by_config[new or base], by_config[configs[2]["name"]], configs[1], configs[2])
    lines += ["", "## Every level", "",
              "| configuration | offered docs/min | sent | sent/min | answered | dead letters | timed out | P50 | P95 | P99 | TTFT P50 | TTFT P95 | docs/min | tokens/s | concurrency | stable |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for lv in levels:
        lines.append(
            f"| {lv.config} | {lv.offered_per_min:.1f} | {lv.sent} | {lv.sent_per_min:.1f} | {lv.answered} | {lv.dead_letters} | {lv.timed_out} | "
            f"{_fmt(lv.p50_s, 1, ' s')} | {_fmt(lv.p95_s, 1, ' s')} | {_fmt(lv.p99_s, 1, ' s')} | {_fmt(lv.ttft_p50_s, 2, ' s')} | "
            f"{_fmt(lv.ttft_p95_s, 2, ' s')} | {lv.completed_per_min:.1f} | {lv.tokens_per_s:.1f} | {lv.concurrency:.1f} | {'yes' if lv.stable else 'no'} |"
        )  # fmt: skip
    if payload.get("bursts"):
        when = ", first, on the idle worker" if payload.get("burst_first") else ", after the sweep"
        lines += ["", f"## Burst: one sender, 15 documents of different lengths back to back{when}", "",
                  "| configuration | documents | answered | first result | last result | mean interval between results |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for b in payload["bursts"]:
            lines.append(
                f"| {b['label']} | {b['sent']} | {b['answered']} | {_fmt(b['first_s'], 1, ' s')} | "
                f"{_fmt(b['last_s'], 1, ' s')} | {_fmt(b['mean_interval_s'], 2, ' s')} |"
            )
    accounted = payload["accounting"]
    lines += ["", "## Accounting", "",
              f"{accounted['sent']} documents sent: {accounted['answered']} answered within the deadline, "
              f"{accounted['dead_letters']} dead-lettered, {accounted['timed_out']} timed out "
              f"({accounted['late']} of them answered late, {accounted['never']} never answered before the collector stopped). "
              f"{accounted['duplicates']} duplicate answers (same event id) and {accounted['unparseable']} unparseable records "
              "on the answer topics. Every count comes from matching the collector's answers to the acknowledged "
              "coordinates of what was sent.", ""]  # fmt: skip
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _before_after(before: list[Level], after: list[Level], b: dict[str, Any], a: dict[str, Any]) -> list[str]:
    """The article's second table: one configuration against the next, at the load both ran."""
    common = sorted({lv.offered_per_min for lv in before} & {lv.offered_per_min for lv in after})
    at = common[-1] if common else None
    lb = next((lv for lv in before if lv.offered_per_min == at), None)
    la = next((lv for lv in after if lv.offered_per_min == at), None)
    sb, sa = max_stable(before), max_stable(after)
    rows = [
        ("P95 latency at the same load", lb and lb.p95_s, la and la.p95_s, False, " s"),
        ("failure rate (timed out) at the same load", lb and lb.failure_rate * 100, la and la.failure_rate * 100, False, " %"),
        ("max stable load (docs/min)", sb and sb.offered_per_min, sa and sa.offered_per_min, True, ""),
        ("max stable concurrency (documents in flight)", sb and sb.concurrency, sa and sa.concurrency, True, ""),
        ("throughput at max stable load (docs/min)", sb and sb.completed_per_min, sa and sa.completed_per_min, True, ""),
        ("tokens/s at max stable load", sb and sb.tokens_per_s, sa and sa.tokens_per_s, True, ""),
        ("peak RSS (MiB)", b["peak_rss_mib"], a["peak_rss_mib"], False, ""),
        ("peak KV pool used (MiB)", b["kv_peak_used_mib"], a["kv_peak_used_mib"], False, ""),
    ]  # fmt: skip
    out = ["", f"## {b['label']} → {a['label']}", "",
           f"Same load = {_fmt(at)} docs/min, the highest offered load both ran.", "",
           f"| metric | {b['label']} | {a['label']} | change |", "|---|---|---|---|"]  # fmt: skip
    for name, x, y, higher, unit in rows:
        out.append(f"| {name} | {_fmt(x, 1, unit)} | {_fmt(y, 1, unit)} | {_change(x, y, higher)} |")
    return out


def _load_axis(ax: Any, levels: list[Level]) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted({lv.offered_per_min for lv in levels})))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(ScalarFormatter())


def plot(
    levels: list[Level], labels: dict[str, str], slo_s: float, deadline_s: float, out_dir: Path
) -> list[str]:
    """Two PNGs: latency percentiles vs offered load, and throughput vs offered load."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    names = []
    fig, ax = plt.subplots(figsize=(8, 7))
    for i, (config, label) in enumerate(labels.items()):
        mine = [lv for lv in levels if lv.config == config]
        x = [lv.offered_per_min for lv in mine]
        for q, style in (("p50_s", ":"), ("p95_s", "-"), ("p99_s", "--")):
            y = [getattr(lv, q) if math.isfinite(getattr(lv, q)) else math.nan for lv in mine]
            ax.plot(x, y, style, marker="o", color=f"C{i}", label=f"{label} {q[:3].upper()}")
        lost = [lv.offered_per_min for lv in mine if not math.isfinite(lv.p95_s)]
        if lost:  # a P95 past the deadline has no value: an x on the deadline line instead, nudged
            nudge = 1.04 ** (i - (len(labels) - 1) / 2)  # sideways per configuration so none hides another
            ax.plot([x * nudge for x in lost], [deadline_s] * len(lost), "x", markersize=12, mew=2, color=f"C{i}",
                    label=f"{label}: P95 past the deadline")  # fmt: skip
    ax.axhline(slo_s, color="grey", linewidth=0.8, label=f"SLO (P95 {slo_s:.0f} s)")
    if deadline_s != slo_s:
        ax.axhline(
            deadline_s, color="black", linestyle=":", linewidth=0.8, label=f"deadline ({deadline_s:.0f} s)"
        )
    ax.set(
        xlabel="offered load (documents/min)",
        ylabel="end-to-end latency (s)",
        title="Latency vs offered load",
    )
    _load_axis(ax, levels)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncols=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    fig.savefig(out_dir / "latency-vs-load.png", dpi=110)
    names.append("latency-vs-load.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    loads = sorted({lv.offered_per_min for lv in levels}) or [1.0]
    ax.plot(loads, loads, color="grey", linewidth=0.8, label="throughput = offered load")
    for i, (config, label) in enumerate(labels.items()):
        mine = [lv for lv in levels if lv.config == config]
        ax.plot([lv.offered_per_min for lv in mine], [lv.completed_per_min for lv in mine], marker="o",
                color=f"C{i}", label=label)  # fmt: skip
        # What the short Poisson level really sent: answers can exceed the nominal load, not this.
        ax.scatter([lv.offered_per_min for lv in mine], [lv.sent_per_min for lv in mine], marker="_", s=160,
                   color=f"C{i}", label=f"{label}: sent")  # fmt: skip
    ax.set(xlabel="offered load (documents/min)", ylabel="answered within the deadline (documents/min)",
           title="Throughput vs offered load")  # fmt: skip
    _load_axis(ax, levels)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "throughput-vs-load.png", dpi=110)
    names.append("throughput-vs-load.png")
    plt.close(fig)
    return names
