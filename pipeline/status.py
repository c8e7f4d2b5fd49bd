"""What `GET /api/status` reports about a worker: switches, counters, engine, KV pool, lag."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.service import Service


def status_report(service: Service) -> dict[str, Any]:
    stats, config = service.engine.stats(), service.engine.config  # what the engine runs
    return {
        "status": "ready" if service.is_ready else "starting",
        "grammars_ready": service.grammars_ready,
        "dynamic_batching": config.dynamic_batching,
        "kv_compression": config.kv_compression,
        "kv_profile": {
            "quant_bits": stats.kv_quant_bits,
            "int8_layers": list(config.kv_int8_layers) if stats.kv_quant_bits == 4 else [],
            "int6_layers": list(config.kv_int6_layers) if stats.kv_quant_bits == 4 else [],
            "int6_parts": list(config.kv_int6_parts) if stats.kv_quant_bits == 4 else [],
            "residual_tokens": config.kv_residual_tokens,
            "sink_tokens": config.kv_sink_tokens,
            "prompt_tokens": config.kv_prompt_tokens,
            "keep_ratio": config.kv_keep_ratio,
            "prune_policy": config.kv_prune_policy,
            "reader": stats.kv_reader,
        }
        if config.kv_compression
        else None,
        "max_batch_size": config.max_batch_size,
        "dynamic_batch_window_ms": config.dynamic_batch_window_ms,
        "model": stats.model_id,
        "device": stats.device,
        "dtype": stats.dtype,
        "consumed": service.counters.consumed,
        "processed": service.counters.processed,
        "failed": service.counters.failed,
        "dead_lettered": service.counters.dead_lettered,
        "in_flight": service.in_flight,
        "paused": service.paused,
        "consumer_lag": {f"{tp.topic}[{tp.partition}]": lag for tp, lag in sorted(service.lag().items())},
        "cluster": _cluster(service),
        "engine": {
            "waiting": stats.num_waiting,
            "running": stats.num_running,
            "steps": stats.num_steps,
            "mean_batch_size": round(stats.mean_batch_size, 3),
            "largest_batch": stats.largest_batch,
            # mean sequences per step as a share of the most allowed
            "batch_occupancy": round(stats.mean_batch_size / config.max_batch_size, 3),
            "generated_tokens": stats.num_generated_tokens,
            "preemptions": stats.num_preemptions,
            "decode_attention": stats.decode_reader,  # "native-<isa>": read in place; "torch": gathered
            "prompt_attention": stats.prompt_reader,  # "native-<isa>": read in place; "torch": SDPA
            # speculative decoding: draft tokens proposed by prompt lookup, and those the model took
            "draft_tokens": stats.num_draft_tokens,
            "accepted_drafts": stats.num_accepted_drafts,
        },
        "kv_pool": {
            "total_bytes": stats.kv_total_bytes,
            "used_bytes": stats.kv_used_bytes,
            "free_bytes": stats.kv_total_bytes - stats.kv_used_bytes,
            "bytes_per_token": stats.kv_bytes_per_token,
            "quantised_bytes_per_token": stats.kv_cold_bytes_per_token,
            "held_tokens": stats.kv_tokens,
            "live_ratio": round(stats.kv_ratio, 4),
            "prefix_caching": stats.prefix_caching,
            "prefix_cached_blocks": stats.prefix_cached_blocks,
            "prefix_hit_tokens": stats.prefix_hit_tokens,
        },
        "input_topics": list(service.settings.input_topics),
        "consumer_group": service.settings.consumer_group,
        "uptime_s": round(time.time() - service.started_at, 1),
    }


def _cluster(service: Service) -> dict[str, Any] | None:
    """What the cluster watch last saw: reachable, each topic's partitions, what looks wrong."""
    if service.watch is None:
        return None
    view = service.watch.view
    return {
        "reachable": view.reachable,
        "partitions": dict(sorted(view.partitions.items())),
        "problems": view.problems,
        "recreated_topics": sorted(view.recreated),
    }
