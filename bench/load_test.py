"""The article's load test, through the whole system: documents into Kafka, a real worker
(`deepanalyze run`: engine, default model), analyses out of Kafka.

For each configuration - one request at a time (`DYNAMIC_BATCHING=false`), dynamic batching, and
dynamic batching with `KV_COMPRESSION=true` (`dynamic_kv4`: at 4 bits, int8 in five layers;
`dynamic_kv4w0`: the same with no full-precision window; neither run unless named) - a worker process of its own on topics of its own, the same KV pool size for all. The workers start together, and each reports its grammars compiled and
answers one unmeasured warm-up document; then, one configuration at a time while the others idle:
the article's burst (one sender, 15 documents of different lengths back to back) on the idle
worker, then a sweep of rising offered load (five departments, open-loop Poisson arrivals) that
stops at the first level whose P95 latency exceeds the SLO or where more than 1 % of documents are
not answered within the deadline (the quick profile starts higher up the grid and steps down if
nothing holds). A configuration's worker stops once it has been measured.
Writes `load-report.md`, `load.json` (every document: when sent, what came back, when) and two
PNG plots into `--out-dir`. Embedded broker by default; `KAFKA_BOOTSTRAP_SERVERS` for any Kafka.

    python -m bench.load_test                  # quick profile (about 10 minutes on 2 cores)
    python -m bench.load_test --profile full   # 10-minute levels, for a GPU host
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench import common
from bench.kv_formats import SENSITIVE
from bench.load_gen import (
    DEPARTMENTS,
    Collector,
    CorpusDoc,
    Sender,
    Sent,
    arrival_window,
    drain,
    load_corpus,
    schedule,
)
from bench.load_report import Level, markdown, max_stable, outcome, plot, summarise
from bench.load_workers import Running, start_config, warm_up
from pipeline.broker import embedded_broker
from pipeline.settings import Settings, load_settings

CONFIGS = {  # name -> (label, environment)
    "static": (
        "one at a time (DYNAMIC_BATCHING=false)",
        {"dynamic_batching": False, "kv_compression": False},
    ),
    "dynamic": ("dynamic batching", {"dynamic_batching": True, "kv_compression": False}),
    "dynamic_kv": ("dynamic batching + KV compression", {"dynamic_batching": True, "kv_compression": True}),
    "dynamic_kv4": (  # issue 23's capacity profile: int4, int8 in the five layers that carry int4's error
        "dynamic batching + KV int4 (int8 in 5 layers)",
        {"dynamic_batching": True, "kv_compression": True, "kv_quant_bits": 4, "kv_int8_layers": SENSITIVE},
    ),
    "dynamic_kv4w0": (  # the same with no full-precision window (bench.kv_quality's int4+int8@5-w0, 0.40x)
        "dynamic batching + KV int4 (int8 in 5 layers, no window)",
        {
            "dynamic_batching": True,
            "kv_compression": True,
            "kv_quant_bits": 4,
            "kv_int8_layers": SENSITIVE,
            "kv_residual_tokens": 0,
        },
    ),
}
DEFAULT_CONFIGS = ("static", "dynamic", "dynamic_kv")  # the article's three
# Offered loads (documents/min), the first configuration's first load, seconds of arrivals per
# level (at least `min_docs` documents), which configurations run the burst, whether a
# configuration starts at the lowest load the previous one failed (quick: the loads below cost
# minutes, and that one is run by both), and whether levels follow each other undrained.
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {"rates": [1.5, 3.0, 6.0, 12.0, 24.0], "start": 3.0, "level_s": 45.0, "min_docs": 3,
              "burst": ["dynamic"], "skip": True, "staircase": False},
    "full": {"rates": [1.5, 3.0, 6.0, 12.0, 24.0, 48.0, 96.0], "start": None, "level_s": 600.0, "min_docs": 10,
             "burst": list(DEFAULT_CONFIGS), "skip": False, "staircase": False},
}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_settings(servers: str, name: str, args: Any) -> Settings:
    run = uuid.uuid4().hex[:8]
    return load_settings(
        kafka_bootstrap_servers=servers, consumer_group=f"load-{name}-{run}",
        topic_complaints=f"load{run}.complaints", topic_meeting_notes=f"load{run}.notes", topic_filings=f"load{run}.filings",
        topic_analysis=f"load{run}.analysis", topic_dead_letters=f"load{run}.dlq",
        status_port=_free_port(), kv_cache_bytes=args.kv_pool_mib * 2**20, max_batch_size=args.max_batch,
        model_path=args.model, max_document_chars=args.max_document_chars, shutdown_grace_s=0.0,
        **CONFIGS[name][1],
    )  # fmt: skip


async def send_level(
    sender: Sender, arrivals: list[Any], level: int, on_sent: Any, proc: subprocess.Popen[bytes]
) -> list[Sent]:
    start, acks = time.perf_counter(), []
    for arrival in arrivals:
        await asyncio.sleep(max(0.0, start + arrival.at_s - time.perf_counter()))
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode} (see its log)")
        acks.append(await sender.send(arrival.doc, arrival.department, level))
        on_sent()
    return list(await asyncio.gather(*acks))


def next_start(levels: list[Level], grid: list[float]) -> float:
    """Where the next configuration's sweep starts: the lowest load this one failed above its
    highest stable load (both then have run it, for the same-load comparison; the next one steps
    down if it cannot hold it), or that stable load if it failed none."""
    held = max_stable(levels)
    floor = held.offered_per_min if held is not None else grid[0]
    failed = [lv.offered_per_min for lv in levels if not lv.stable and lv.offered_per_min > floor]
    return min(failed, default=floor)


async def idle(
    collector: Collector,
    staged: list[tuple[int, float, float, list[Sent]]],
    progress: Progress,
    task: Any,
    name: str,
) -> None:
    """Until the worker has answered everything sent so far, late or not (at most 5 minutes), so
    that what is measured next does not queue behind an overloaded level's backlog."""
    progress.update(task, description=f"{name}: waiting for the backlog")
    await drain(collector, [d for lv in staged for d in lv[3]], 300.0)


def known_unstable(sent: list[Sent], collector: Collector, deadline_s: float, slo_s: float) -> bool:
    """Whether a level already fails the stability rule, whatever its unanswered documents do:
    more than 1 % of them past the deadline, or enough past the SLO that P95 must exceed it."""
    now_ms = time.time() * 1000
    over = failed = measured = 0
    for s in sent:
        collector.resolve(s)
        if s.answer == "dead_letter":
            continue  # counted apart, not in the latencies
        measured += 1
        waited = (
            s.latency_s if s.answer is not None and s.latency_s is not None else (now_ms - s.sent_ms) / 1000
        )
        over += waited > slo_s
        failed += waited > deadline_s
    return failed > 0.01 * len(sent) or (measured > 0 and over > measured - math.ceil(0.95 * measured))


def burst_docs(corpus: list[CorpusDoc], n: int) -> list[CorpusDoc]:
    """n documents of different lengths, short to long: evenly spaced through the corpus by length."""
    by_length = sorted(corpus, key=lambda d: len(d.text))
    return [by_length[round(i * (len(by_length) - 1) / max(n - 1, 1))] for i in range(n)]


async def run_config(
    run: Running, args: Any, corpus: list[CorpusDoc], progress: Progress, rates: list[float]
) -> tuple[dict[str, Any], list[Level], list[Sent], dict[str, Any] | None, tuple[int, int]]:
    name, proc, sender, collector, watch = run.name, run.proc, run.sender, run.collector, run.watch
    task = progress.add_task(f"{name}: measuring", total=None)
    levels: list[Level] = []
    docs: list[Sent] = []
    burst = None
    try:
        staged: list[tuple[int, float, float, list[Sent]]] = []  # (level, rate, window, sent)
        if name in args.burst_configs:  # first, on an idle worker: after the sweep it would wait
            # for an overloaded level's backlog, which costs minutes
            progress.update(task, description=f"{name}: burst of {args.burst}", total=args.burst, completed=0)
            start_ms = int(time.time() * 1000)
            acks = [await sender.send(d, "burst", len(args.rates)) for d in burst_docs(corpus, args.burst)]
            sent = list(await asyncio.gather(*acks))
            await drain(collector, sent, args.deadline_s * 3, lambda n: progress.update(task, completed=n))
            docs += sent
            burst = burst_summary(name, sent, start_ms, args.deadline_s * 3)

        async def run_level(rate: float) -> list[Sent]:
            level = args.rates.index(rate)
            arrivals = schedule(
                rate, args.level_s, corpus, seed=1000 + level, min_count=args.min_docs, exact=args.exact
            )
            progress.update(task, description=f"{name}: {rate:g} docs/min", total=len(arrivals), completed=0)
            sent = await send_level(sender, arrivals, level, lambda: progress.advance(task), proc)
            staged.append((level, rate, arrival_window(arrivals, rate, args.level_s, args.exact), sent))
            return sent

        for rate in rates:
            sent = await run_level(rate)
            if args.staircase:  # the next level follows at once; stop when one is known to fail
                if any(known_unstable(lv[3], collector, args.deadline_s, args.slo_s) for lv in staged):
                    break
            else:
                await drain(collector, sent, args.deadline_s)
                if not summarise(name, 0, rate, 1.0, sent, args.deadline_s, args.slo_s).stable:
                    break
        progress.update(task, description=f"{name}: draining")
        await drain(collector, [d for lv in staged for d in lv[3]], args.deadline_s)
        # Nothing held at the first load tried: step down the grid until a load holds.
        lower = [r for r in args.rates if r < rates[0]]
        while lower and not any(
            summarise(name, lv[0], lv[1], lv[2], lv[3], args.deadline_s, args.slo_s).stable for lv in staged
        ):
            await idle(collector, staged, progress, task, name)
            await drain(collector, await run_level(lower.pop()), args.deadline_s)
        for level, rate, window, sent in sorted(staged, key=lambda lv: lv[1]):
            docs += sent
            levels.append(summarise(name, level, rate, window, sent, args.deadline_s, args.slo_s))
        progress.update(task, description=f"{name}: done")
    finally:
        await run.close()
    for s in docs:
        collector.resolve(s)  # late answers, for the record
    info = {
        "name": name, "label": CONFIGS[name][0], "settings": {k: str(v) for k, v in CONFIGS[name][1].items()},
        "peak_rss_mib": watch.peak_rss, "kv_total_mib": watch.kv_total / 2**20 if watch.kv_total else None,
        "kv_peak_used_mib": watch.kv_peak_used / 2**20 if watch.kv_total else None,
    }  # fmt: skip
    return info, levels, docs, burst, (collector.duplicates, collector.unparseable)


def burst_summary(name: str, sent: list[Sent], start_ms: int, deadline_s: float) -> dict[str, Any]:
    done = sorted(s.answered_ms for s in sent if outcome(s, deadline_s) == "answered" and s.answered_ms)
    return {
        "config": name, "label": CONFIGS[name][0], "sent": len(sent), "answered": len(done),
        "first_s": (done[0] - start_ms) / 1000 if done else None, "last_s": (done[-1] - start_ms) / 1000 if done else None,
        "mean_interval_s": (done[-1] - start_ms) / 1000 / len(done) if done else None,
    }  # fmt: skip


def machine(args: Any, broker: str) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    device = "no GPU"
    if args.worker == "pipeline":
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (CPU inference)"
    settings = load_settings()
    model = "instant analyser (no model)" if args.worker != "pipeline" else str(args.model)
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "memory_gib": psutil.virtual_memory().total / 2**30,
            "device": device, "model": model, "dtype": settings.dtype, "broker": broker, "platform": platform.platform()}  # fmt: skip


def _json_safe(value: Any) -> Any:
    """Strict JSON: an infinite percentile (timed out) becomes "inf", a missing one null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else "inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


async def main_async(args: Any, console: Console) -> tuple[dict[str, Any], list[Level]]:
    corpus = load_corpus()
    started, t0 = dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), time.perf_counter()
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    with contextlib.ExitStack() as stack:
        if external:
            servers, broker = external, f"Kafka at {external}"
        else:
            started_broker = stack.enter_context(embedded_broker())
            servers, broker = started_broker.bootstrap_servers, f"{started_broker.kind}, one node on loopback"
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        results = []
        with Progress(*columns, console=console) as progress:
            rates = [r for r in args.rates if args.start is None or r >= args.start] or args.rates[-1:]
            # Every worker starts and warms up at once (their waits overlap); each then idles until
            # its turn and is stopped once its configuration is measured (or on any error).
            async with contextlib.AsyncExitStack() as workers:
                runs: list[Running] = []
                for name in args.configs:
                    runs.append(
                        await start_config(
                            name, config_settings(servers, name, args), args.worker, args.out_dir
                        )
                    )
                    workers.push_async_callback(runs[-1].close)  # closing twice is harmless
                async with asyncio.TaskGroup() as group:  # one failing cancels the others
                    for run in runs:
                        group.create_task(warm_up(run, corpus, progress))
                for run in runs:
                    results.append(await run_config(run, args, corpus, progress, rates))
                    if args.skip:
                        rates = [r for r in args.rates if r >= next_start(results[-1][1], args.rates)]
    configs = [r[0] for r in results]
    levels = [lv for r in results for lv in r[1]]
    docs = [d for r in results for d in r[2]]
    kinds = [outcome(d, args.deadline_s * (3 if d.department == "burst" else 1)) for d in docs]
    timed_out = [d for d, k in zip(docs, kinds, strict=True) if k == "timed_out"]
    payload = {
        "profile": args.profile, "started": started, "wall_s": time.perf_counter() - t0,
        "machine": machine(args, broker), "departments": list(DEPARTMENTS), "corpus_docs": len(corpus),
        "rates_per_min": args.rates, "level_s": args.level_s, "min_docs": args.min_docs, "skip_held_loads": args.skip, "start": args.start, "staircase": args.staircase, "exact_counts": args.exact, "deadline_s": args.deadline_s, "slo_s": args.slo_s,
        "kv_pool_mib": args.kv_pool_mib, "max_batch_size": args.max_batch, "configs": configs,
        "levels": [asdict(lv) | {"failure_rate": lv.failure_rate} for lv in levels],
        "max_stable": {c["name"]: asdict(s) if (s := max_stable([lv for lv in levels if lv.config == c["name"]])) else None for c in configs},
        "bursts": [r[3] for r in results if r[3] is not None], "burst_first": True,
        "accounting": {
            "sent": len(docs), "answered": kinds.count("answered"), "dead_letters": kinds.count("dead_letter"),
            "timed_out": len(timed_out), "late": sum(d.answer is not None for d in timed_out),
            "never": sum(d.answer is None for d in timed_out),
            "duplicates": sum(r[4][0] for r in results), "unparseable": sum(r[4][1] for r in results),
        },
        "documents": [asdict(d) | {"latency_s": d.latency_s} for d in docs],
    }  # fmt: skip
    return payload, levels


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--profile", choices=list(PROFILES), default="quick")
    parser.add_argument(
        "--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated: " + ", ".join(CONFIGS)
    )
    parser.add_argument(
        "--rates", type=float, nargs="+", help="offered loads, documents/min (profile default)"
    )
    parser.add_argument("--level-s", type=float, help="seconds of arrivals per level (profile default)")
    parser.add_argument("--min-docs", type=int, help="documents per level at least (profile default)")
    parser.add_argument(
        "--skip-held-loads", dest="skip", action=argparse.BooleanOptionalAction, default=None,
        help="start each configuration at the lowest load the previous one failed (profile default)",
    )  # fmt: skip
    parser.add_argument("--start", type=float, help="the first configuration's first load (profile default)")
    parser.add_argument(
        "--staircase", action=argparse.BooleanOptionalAction, default=None,
        help="levels follow each other without draining in between (profile default)",
    )  # fmt: skip
    parser.add_argument(
        "--exact", action=argparse.BooleanOptionalAction, default=True,
        help="each level sends its expected count of Poisson arrivals (default), not a random count",
    )  # fmt: skip
    parser.add_argument("--burst", type=int, default=15, help="documents in the one-sender burst")
    parser.add_argument("--burst-configs", help="configurations that run the burst (profile default)")
    parser.add_argument("--deadline-s", type=float, default=60.0, help="unanswered after this: failed")
    parser.add_argument(
        "--slo-s",
        type=float,
        default=60.0,
        help="a level is stable while P95 latency <= this (default: the deadline; one analysis alone takes 15-30 s on 2 cores with bf16, 45-120 s on 2 AVX2 cores in fp32: raise both there)",
    )
    parser.add_argument("--kv-pool-mib", type=int, default=128, help="KV_CACHE_BYTES for every configuration")
    parser.add_argument("--max-batch", type=int, default=16, help="MAX_BATCH_SIZE")
    parser.add_argument("--max-document-chars", type=int, default=8_000, help="MAX_DOCUMENT_CHARS")
    parser.add_argument(
        "--worker", default="pipeline", help="worker module: pipeline (the real one) or a stand-in"
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results/load"))
    parser.add_argument(
        "--report-only", action="store_true", help="re-render report and plots from --out-dir/load.json"
    )
    args = parser.parse_args(argv)
    if args.report_only:
        return render(json.loads((args.out_dir / "load.json").read_text()), args.out_dir, Console(width=140))
    profile = PROFILES[args.profile]
    args.configs = args.configs.split(",")
    if unknown := set(args.configs) - CONFIGS.keys():
        parser.error(f"unknown configurations: {', '.join(sorted(unknown))}")
    args.rates = sorted(args.rates or profile["rates"])
    args.level_s = args.level_s or profile["level_s"]
    args.min_docs = args.min_docs if args.min_docs is not None else profile["min_docs"]
    args.skip = args.skip if args.skip is not None else profile["skip"]
    args.start = args.start if args.start is not None else profile["start"]
    args.staircase = args.staircase if args.staircase is not None else profile["staircase"]
    args.burst_configs = args.burst_configs.split(",") if args.burst_configs is not None else profile["burst"]
    if args.worker == "pipeline":
        args.model = common.model_path(args.model)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    console = Console(width=140)
    payload, _ = asyncio.run(main_async(args, console))
    (args.out_dir / "load.json").write_text(
        json.dumps(_json_safe(payload), indent=1, allow_nan=False, default=str)
    )
    return render(payload, args.out_dir, console)


def render(payload: dict[str, Any], out_dir: Path, console: Console) -> int:
    """The report and plots of a run, from its payload (as written to load.json)."""
    fields = {f for f in Level.__dataclass_fields__}
    levels = [Level(**{k: math.inf if v == "inf" else math.nan if v is None else v
                       for k, v in lv.items() if k in fields}) for lv in payload["levels"]]  # fmt: skip
    labels = {c["name"]: c["label"] for c in payload["configs"]}
    plots = plot(levels, labels, payload["slo_s"], payload["deadline_s"], out_dir)
    report = markdown(payload, levels, plots)
    (out_dir / "load-report.md").write_text(report, encoding="utf-8")
    console.print(report)
    console.print(f"wrote {out_dir}/load-report.md, load.json, {', '.join(plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
