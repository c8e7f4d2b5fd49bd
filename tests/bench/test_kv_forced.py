"""Next-token agreement against a reference: zero for the same logits, a tied best counts either
way, and mass outside the reference's top-k is weighed in one bucket."""

from __future__ import annotations

import math

import pytest
import torch

from bench.kv_forced import next_token_agreement


def test_next_token_agreement_is_zero_kl_for_the_same_logits_and_counts_a_tied_best_either_way() -> None:
    logits = torch.tensor([2.0, 5.0, 5.0, 1.0, -3.0, 0.5])  # tokens 1 and 2 tie for the best
    logp, ids = torch.log_softmax(logits, -1).topk(3)
    kl, same = next_token_agreement(logits, ids, logp)
    assert kl == pytest.approx(0.0, abs=1e-7) and same
    swapped = torch.tensor([2.0, 5.0, 5.0, 1.0, -3.0, 0.5])[[0, 2, 1, 3, 4, 5]]  # argmax picks the other
    assert next_token_agreement(swapped, ids, logp)[1]
    moved = torch.tensor([2.0, 5.0, 4.0, 1.0, 3.0, 0.5])  # mass moves to token 4, outside the top 3
    kl, same = next_token_agreement(moved, ids, logp)
    p, q = torch.softmax(logits, -1), torch.softmax(moved, -1)
    top = [int(i) for i in ids]  # tokens 1, 2 and 0
    rest_p, rest_q = 1 - float(p[top].sum()), 1 - float(q[top].sum())
    expected = float((p[top] * (p[top].log() - q[top].log())).sum()) + rest_p * math.log(rest_p / rest_q)
    assert kl == pytest.approx(expected, rel=1e-5) and same  # token 1 is still the best
    assert not next_token_agreement(torch.tensor([2.0, 1.0, 1.0, 9.0, 0.0, 0.0]), ids, logp)[1]
