"""The profile's replay: every packed product the engine ran is timed where it ran and replayed
alone as often as asked, and the engine's products are left as they were."""

from __future__ import annotations

from argparse import Namespace

import torch

from bench.engine_profile import replay_products
from engine.linear import PackedLinear, pack_linears
from engine.tiny import build_tiny


def test_the_replay_times_each_product_the_engine_ran_and_restores_the_products() -> None:
    tiny = build_tiny()
    packed = pack_linears(tiny.model, torch.device("cpu"), torch.float32)
    assert packed > 0
    forward = PackedLinear.forward
    args = Namespace(new_tokens=3, max_batch=2, step_tokens=16, replay=2)
    result = replay_products(tiny, [[5, 6, 7, 8], [9, 10, 11]], [0.0, 0.0], args)
    # each step runs every packed module once (the head only when a chunk samples: every step here)
    assert result["calls"] > 0 and result["calls"] % packed == 0
    assert result["inside_s"] > 0
    assert len(result["replayed_s"]) == 2 and all(t > 0 for t in result["replayed_s"])
    assert PackedLinear.forward is forward
