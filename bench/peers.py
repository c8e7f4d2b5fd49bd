"""Our engine beside what a user would run instead — vLLM's CPU build and llama.cpp's server — on
the same workload, in one run: `make bench-peers`.

The workload is the engine benchmark's: the first `--docs` corpus documents rendered as the
service's prompts (a shared system prompt, zh and en), as token ids, `--new-tokens` new tokens
each with EOS ignored, greedy; once all at t=0 ("burst") and once as a Poisson stream
(`--rate` a second). Our engine runs in a fresh process (`bench.engine_bench --part`, its
dynamic batching); each peer is started as a server from its own environment (built by
`bench/peers_setup.sh` under `.peers/`, outside the product's dependencies), warmed with one
request, and driven over HTTP with streaming responses, so its first token is timed where a
client sees it. Every round runs every system, the order rotating; ratios are taken within a
round (this machine's speed drifts over minutes) and the median round is reported. `ours@N` is our
engine with N tokens per step (`MAX_TOKENS_PER_STEP`) instead of its default, and `ours:torch`
our engine with decodes' history gathered by torch (`KV_KERNEL=torch`) instead of read in place
by the native kernel, and `ours~N` our engine whose decodes give way to waiting prompts for up to N
steps in a row (`DECODE_DEFER_STEPS`), and `ours^N` our engine with N tokens per step while a full
batch is running or waiting (`SATURATED_TOKENS_PER_STEP`), and `ours+N` our engine with N draft
tokens per decode at most (`SPECULATIVE_TOKENS`; `ours+0`: none; `ours+N!`: N each as the step's
budget allows, `SPECULATIVE_STEP_TOKENS=0`; `ours+N/T`: shared out from T tokens a step of decodes,
`SPECULATIVE_STEP_TOKENS=T`; unset, 64 on a CPU without AMX, 0 with it), each run as a system of its
own in the same rounds (`ours@512^1024~16+8:torch` all five).

    python -m bench.peers --rounds 3 --out bench/results/peers-cpu.json
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from bench import common
from bench.engine_variants import WARM_UP_IDS, PeakRSS, arrivals, load_prompts
from engine.loader import cpu_has_bf16

PEERS = Path(__file__).resolve().parents[1] / ".peers"
SYSTEMS = ("ours", "vllm", "llama")
# our engine with that many tokens per step (@), while saturated (^), decodes deferred that many
# steps (~), that many draft tokens per decode at most (+; !: SPECULATIVE_STEP_TOKENS=0, /T: =T), and/or
# that KV_KERNEL (:)
# (`ours:torch`: decodes gathered)
OURS = re.compile(
    r"ours(?:@(\d+))?(?:\^(\d+))?(?:~(\d+))?(?:\+(\d+)(!|/\d+)?)?(?::(auto|torch|avx512|avx2|portable))?"
)


def _ours_part(system: str, group: int) -> str | None:
    match = OURS.fullmatch(system)
    return match.group(group) if match else None


def ours_step(system: str) -> str | None:
    """The tokens per step `ours@N` names (None for any other system)."""
    return _ours_part(system, 1)


def ours_saturated(system: str) -> str | None:
    """The SATURATED_TOKENS_PER_STEP `ours^N` names (None for any other system)."""
    return _ours_part(system, 2)


def ours_defer(system: str) -> str | None:
    """The DECODE_DEFER_STEPS `ours~N` names (None for any other system)."""
    return _ours_part(system, 3)


def ours_drafts(system: str) -> str | None:
    """The SPECULATIVE_TOKENS `ours+N` names (None for any other system)."""
    return _ours_part(system, 4)


def ours_draft_step_tokens(system: str) -> str | None:
    """The SPECULATIVE_STEP_TOKENS `ours+N!` ("0") or `ours+N/T` (T) names (None for any other system)."""
    part = _ours_part(system, 5)
    if part is None:
        return None
    return "0" if part == "!" else part.removeprefix("/")


def ours_kernel(system: str) -> str | None:
    """The KV_KERNEL `ours:K` names (None for any other system)."""
    return _ours_part(system, 6)


def is_ours(system: str) -> bool:
    return OURS.fullmatch(system) is not None


@dataclass
class Result:
    """One system's run of one scenario: what a client saw."""

    system: str
    scenario: str
    round: int
    wall_s: float
    tokens: list[int]
    latencies_s: list[float]
    ttfts_s: list[float]
    peak_rss_mib: float
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        return {
            "tok_s": sum(self.tokens) / self.wall_s,
            "p50_s": _pct(self.latencies_s, 50),
            "p95_s": _pct(self.latencies_s, 95),
            "ttft_p50_s": _pct(self.ttfts_s, 50),
            "ttft_p95_s": _pct(self.ttfts_s, 95),
            "peak_rss_mib": self.peak_rss_mib,
        }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# --- the peers as servers ------------------------------------------------------------------------


@dataclass
class Server:
    """How to start one peer and speak to it."""

    name: str
    argv: list[str]
    env: dict[str, str]
    url: str
    path: str  # the completion endpoint
    describe: str

    def body(self, ids: list[int], n: int) -> dict[str, Any]:
        if self.name == "vllm":
            return {"model": "m", "prompt": ids, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
                    "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        return {"prompt": ids, "n_predict": n, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
                "stream": True, "cache_prompt": True}  # fmt: skip


def vllm_server(model: Path, port: int, max_batch: int, max_len: int) -> Server:
    python = PEERS / "vllm" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no vLLM environment at {python.parent.parent}: run `bash bench/peers_setup.sh`")
    env = os.environ | {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",  # its default leaves a core idle
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: the engine's pool in this benchmark
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("PYTHONPATH", None)
    # The dtype our engine's `auto` picks here: bf16 where the CPU has it natively, else fp32 (bf16
    # emulated is several times slower than fp32 for either system).
    dtype = "bfloat16" if cpu_has_bf16() else "float32"
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "m", "--dtype", dtype, "--max-num-seqs", str(max_batch),
            "--max-model-len", str(max_len), "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], env=env,
                             capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    return Server("vllm", argv, env, f"http://127.0.0.1:{port}", "/v1/completions",
                  f"vLLM {version or '?'} (CPU), {dtype}, max-num-seqs {max_batch}, 1 GiB KV")  # fmt: skip


def llama_server(port: int, slots: int, max_len: int) -> Server:
    binary = PEERS / "llama" / "build" / "bin" / "llama-server"
    gguf = PEERS / "model-bf16.gguf"
    for needed in (binary, gguf):
        if not needed.exists():
            raise SystemExit(f"no {needed}: run `bash bench/peers_setup.sh`")
    threads = str(os.cpu_count() or 1)
    argv = [str(binary), "-m", str(gguf), "-t", threads, "-tb", threads, "-np", str(slots),
            "-c", str(slots * max_len), "--host", "127.0.0.1", "--port", str(port), "--no-ui"]  # fmt: skip
    return Server("llama", argv, dict(os.environ), f"http://127.0.0.1:{port}", "/completion",
                  f"llama.cpp server ({(PEERS / 'llama' / 'VERSION').read_text().strip()}), bf16 GGUF, "
                  f"{slots} slots, {threads} threads")  # fmt: skip


def llama_system_info(server: Server, log: Path) -> str:
    """The CPU features and threads the llama.cpp build uses: its `system_info` line, which it prints
    only at trace verbosity (so the measured servers run without it)."""
    with log.open("wb") as out:
        process = subprocess.Popen([*server.argv, "-lv", "4"], stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
    try:
        for _ in range(100):
            if found := re.search(r"system_info:.*", log.read_text(errors="replace")):
                return found.group(0).strip()
            time.sleep(0.1)
        return "?"
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextmanager
def running(server: Server, log: Path, start_timeout_s: float) -> Iterator[subprocess.Popen[bytes]]:
    """The server started in a process group of its own, ready; killed (the whole group) on exit."""
    with log.open("wb") as out:
        process = subprocess.Popen(server.argv, env=server.env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {process.returncode}; see {log}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} not ready after {start_timeout_s:.0f} s; see {log}")
            time.sleep(1)
        yield process
    finally:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue


async def _one(client: httpx.AsyncClient, server: Server, ids: list[int], n: int, start: float,
               delay: float) -> tuple[int, float, float]:  # fmt: skip
    """One streamed request: (tokens generated, latency, time to first token), from its arrival."""
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    sent = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", server.url + server.path, json=server.body(ids, n)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if server.name == "vllm":
                if chunk.get("choices") and first is None:
                    first = time.perf_counter()
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
            else:
                if first is None and (chunk.get("content") or chunk.get("tokens")):
                    first = time.perf_counter()
                if chunk.get("stop") and "timings" in chunk:
                    tokens = int(chunk["timings"]["predicted_n"])
    done = time.perf_counter()
    return tokens, done - sent, (first or done) - sent


async def drive(server: Server, prompts: list[list[int]], n: int, at: list[float]) -> tuple[float, list[Any]]:
    limits = httpx.Limits(max_connections=len(prompts) + 1, max_keepalive_connections=len(prompts) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(
            *(_one(client, server, p, n, start, a) for p, a in zip(prompts, at, strict=True))
        )
        return time.perf_counter() - start, answers


def peer_round(server: Server, prompts: list[list[int]], args: Any, round_: int, logs: Path) -> list[Result]:
    """Each scenario on a freshly started server: its prefix cache empty, as our engine's is (a
    server kept up would serve the stream's prompts from what the burst left)."""
    at = {"burst": [0.0] * len(prompts), "stream": arrivals(len(prompts), args.rate)}
    results = []
    for scenario in args.scenarios.split(","):
        log = logs / f"{server.name}-round{round_}-{scenario}.log"
        with running(server, log, args.start_timeout) as process:
            asyncio.run(drive(server, [WARM_UP_IDS], 8, [0.0]))  # one-off compilation and allocation
            with PeakRSS(process.pid) as rss:
                wall, answers = asyncio.run(drive(server, prompts, args.new_tokens, at[scenario]))
        tokens, latencies, ttfts = (list(column) for column in zip(*answers, strict=True))
        results.append(Result(server.name, scenario, round_, wall, tokens, latencies, ttfts, rss.mib))
    return results


def ours_round(args: Any, round_: int, system: str = "ours") -> list[Result]:
    """Our engine in a fresh process, each scenario in turn (`bench.engine_bench --part`); `ours@N`
    with N tokens per step, `ours^N` with SATURATED_TOKENS_PER_STEP=N, `ours~N` with
    DECODE_DEFER_STEPS=N, `ours+N` with SPECULATIVE_TOKENS=N (`ours+N!` and SPECULATIVE_STEP_TOKENS=0,
    `ours+N/T` and SPECULATIVE_STEP_TOKENS=T),
    `ours:K` with KV_KERNEL=K."""
    step, kernel, defer = ours_step(system), ours_kernel(system), ours_defer(system)
    saturated, drafts = ours_saturated(system), ours_drafts(system)
    draft_step = ours_draft_step_tokens(system)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "part.json"
        subprocess.run(
            [sys.executable, "-m", "bench.engine_bench", "--no-isolate", "--part", "--variants", "engine_dynamic",
             "--scenarios", args.scenarios, "--no-ttft-isolation", "--repeats", "1", "--docs", str(args.docs),
             "--new-tokens", str(args.new_tokens), "--max-batch", str(args.max_batch), "--rate", str(args.rate),
             "--kv-cache-mib", "1024", "--warm-up", "--model", str(args.model), "--out", str(out),
             *(["--step-tokens", step] if step else []), *(["--kv-kernel", kernel] if kernel else []),
             *(["--decode-defer", defer] if defer else []),
             *(["--saturated-step-tokens", saturated] if saturated else []),
             *(["--speculative-tokens", drafts] if drafts else []),
             *(["--speculative-step-tokens", draft_step] if draft_step else [])],
            check=True, cwd=Path(__file__).resolve().parents[1],
        )  # fmt: skip
        runs = json.loads(out.read_text())["runs"]
    n = args.new_tokens
    for r in runs:  # EOS ignored: every request gives exactly n tokens
        if r["tokens"] != n * len(r["latencies_s"]):
            raise RuntimeError(f"our engine gave {r['tokens']} tokens for {len(r['latencies_s'])} x {n}")
    return [
        Result(system, r["scenario"], round_, r["wall_s"], [n] * len(r["latencies_s"]), r["latencies_s"],
               r["ttfts_s"], r["peak_rss_mib"], {"tokens_total": r["tokens"], **r["extra"]})
        for r in runs
    ]  # fmt: skip


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--scenarios", default="burst,stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--max-batch", type=int, default=32, help="ours and vLLM: the largest batch")
    parser.add_argument("--slots", type=int, default=8, help="llama.cpp: parallel slots")
    parser.add_argument("--rate", type=float, default=0.5, help="stream arrivals per second")
    parser.add_argument(
        "--start-timeout", type=float, default=900.0, help="seconds for a server to get ready"
    )
    parser.add_argument("--port", type=int, default=18731)
    parser.add_argument("--out", type=Path, default=Path("bench/results/peers.json"))
    args = parser.parse_args()
    args.model = common.model_path(args.model)
    systems = args.systems.split(",")
    if unknown := {s for s in systems if s not in SYSTEMS and not is_ours(s)}:
        parser.error(
            f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}, ours@N, ours^N, ours~N, ours:K, ours@N^N~N:K"
        )
    from transformers import AutoTokenizer

    prompts = load_prompts(AutoTokenizer.from_pretrained(args.model), args.docs)
    max_len = -(-(max(map(len, prompts)) + args.new_tokens + 64) // 256) * 256
    servers = {}
    if "vllm" in systems:
        servers["vllm"] = vllm_server(args.model, args.port, args.max_batch, max_len)
    if "llama" in systems:
        servers["llama"] = llama_server(args.port + 1, args.slots, max_len)
    console = Console(width=160)
    results: list[Result] = []
    logs = Path(tempfile.mkdtemp(prefix="peers-"))
    for round_ in range(args.rounds):
        order = systems[round_ % len(systems) :] + systems[: round_ % len(systems)]  # each first in turn
        for system in order:
            console.print(f"round {round_ + 1}: {system} ...")
            got = (
                ours_round(args, round_, system)
                if is_ours(system)
                else peer_round(servers[system], prompts, args, round_, logs)
            )
            for r in got:
                s = r.summary()
                console.print(f"  {r.scenario}: {s['tok_s']:.1f} tok/s, p95 {s['p95_s']:.1f} s, "
                              f"TTFT p50 {s['ttft_p50_s']:.2f} s, {min(r.tokens)}-{max(r.tokens)} tokens each")  # fmt: skip
            results += got
    summary = report(results, systems, args, console)
    describe = {s: f"our engine (dynamic batching, max batch {args.max_batch}, 1 GiB KV, dtype auto"
                   f"{f', {ours_step(s)} tokens per step' if ours_step(s) else ''}"
                   f"{f', DECODE_DEFER_STEPS={ours_defer(s)}' if ours_defer(s) else ''}"
                   f"{f', SATURATED_TOKENS_PER_STEP={ours_saturated(s)}' if ours_saturated(s) else ''}"
                   f"{f', SPECULATIVE_TOKENS={ours_drafts(s)}' if ours_drafts(s) else ''}"
                   f"{f', SPECULATIVE_STEP_TOKENS={ours_draft_step_tokens(s)}' if ours_draft_step_tokens(s) else ''}"
                   f"{f', KV_KERNEL={ours_kernel(s)}' if ours_kernel(s) else ''})"
                for s in systems if is_ours(s)} | {k: s.describe for k, s in servers.items()}  # fmt: skip
    if "llama" in servers:
        describe["llama_system_info"] = llama_system_info(servers["llama"], logs / "llama-system-info.log")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": common.machine(), "systems": describe,
        "config": {k: str(v) for k, v in vars(args).items()} | {"prompt_tokens": sum(map(len, prompts))},
        "results": [asdict(r) | {"summary": r.summary()} for r in results], "summary": summary,
    }, indent=1))  # fmt: skip
    console.print(f"wrote {args.out} (server logs in {logs})")


def report(results: list[Result], systems: list[str], args: Any, console: Console) -> dict[str, Any]:
    """The median round of each system and scenario; ours / peer within each round, then the median."""
    by = {(r.system, r.scenario, r.round): r for r in results}
    table = Table("system", "scenario", "tok/s (median)", "p50 s", "p95 s", "TTFT p50", "TTFT p95", "peak RSS MiB",
                  title=f"{args.docs} documents x {args.new_tokens} tokens, EOS ignored, {args.rounds} rounds "
                        "(median of rounds)")  # fmt: skip
    summary: dict[str, Any] = {"medians": {}, "ratios": {}}
    for scenario in args.scenarios.split(","):
        for system in systems:
            rows = [by[(system, scenario, i)].summary() for i in range(args.rounds)]
            med = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
            summary["medians"][f"{system}/{scenario}"] = med
            table.add_row(system, scenario, f"{med['tok_s']:.1f}", f"{med['p50_s']:.1f}", f"{med['p95_s']:.1f}",
                          f"{med['ttft_p50_s']:.2f}", f"{med['ttft_p95_s']:.2f}", f"{med['peak_rss_mib']:.0f}")  # fmt: skip
    console.print(table)
    pairs = [(mine, other) for mine in systems if is_ours(mine) for other in systems
             if not is_ours(other) or (mine != "ours" and other == "ours")]  # fmt: skip
    for scenario in args.scenarios.split(","):
        for mine, peer in pairs:
            for key, label in (("tok_s", "tok/s"), ("p95_s", "p95 latency"), ("ttft_p95_s", "TTFT p95")):
                per_round = [by[(mine, scenario, i)].summary()[key] / by[(peer, scenario, i)].summary()[key]
                             for i in range(args.rounds)]  # fmt: skip
                name = f"{scenario}: {mine} / {peer} {label}"
                summary["ratios"][name] = {"rounds": per_round, "median": statistics.median(per_round)}
                console.print(f"{name}: {statistics.median(per_round):.2f}x "
                              f"(rounds: {', '.join(f'{v:.2f}' for v in per_round)})")  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
