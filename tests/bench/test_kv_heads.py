"""The per-part sweep measures each part alone (a part's cost does not carry the parts measured
before it), and the chosen formats hold the bytes of as many parts at 8 bits as they name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.kv_fake import BLOCK, Format, bytes_ratio
from bench.kv_formats import FORMATS, MIXED, SIX_BIT_PARTS, SIX_BIT_PARTS_ANSWERS, parts_format
from bench.kv_heads import allocate, costliest, held_bytes, part_costs, six_bit_parts, sweep_documents
from engine.tiny import build_tiny


def test_a_part_costs_the_same_measured_last_in_the_sweep_as_measured_alone() -> None:
    model = build_tiny("qwen2").model.eval()
    config = model.config
    generator = torch.Generator().manual_seed(5)
    prompt = 6 * BLOCK + 3  # the sink block and five cold blocks
    seqs = [(torch.randint(3, config.vocab_size, (prompt + 12,), generator=generator), prompt)]
    costs = part_costs(model, seqs)
    parts = config.num_hidden_layers * config.num_key_value_heads * 2
    assert len(costs) == parts
    last = (config.num_hidden_layers - 1, config.num_key_value_heads - 1, "values")
    alone = part_costs(model, seqs, parts=[last])[last]
    assert costs[last] == pytest.approx(alone, rel=1e-6, abs=1e-12)
    assert max(costs.values()) > 1e-7  # 4 bits disturb some part's history


def test_the_costliest_parts_take_8_bits_and_the_bytes_of_as_many_parts() -> None:
    layers, heads = 24, 2
    costs = {(layer, head, kind): float(layer * 4 + head * 2 + (kind == "keys"))
             for layer in range(layers) for head in range(heads) for kind in ("keys", "values")}  # fmt: skip
    chosen = costliest(costs, 3)  # layer 23's keys of both heads, then head 1's values
    assert chosen.bits(23, 1) == (8, 8) and chosen.bits(23, 0) == (8, 4) and chosen.bits(22, 1) == (4, 4)
    # 20 parts at 8 bits hold the bytes of five whole layers at 8 bits
    assert bytes_ratio(costliest(costs, 20), layers, 64, kv_heads=heads) == pytest.approx(
        bytes_ratio(MIXED, layers, 64)
    )
    with pytest.raises(ValueError, match="KV head"):
        bytes_ratio(Format(head_bits={(0, 2): (8, 8)}), layers, 64, kv_heads=heads)


def _costs(layers: int = 24, heads: int = 2) -> dict[tuple[int, int, str], float]:
    generator = torch.Generator().manual_seed(3)
    draws = torch.rand(layers * heads * 2, generator=generator).pow(4).tolist()  # a few parts cost most
    parts = [
        (layer, head, kind) for layer in range(layers) for head in range(heads) for kind in ("keys", "values")
    ]
    return dict(zip(parts, draws, strict=True))


def _modelled(costs: dict[tuple[int, int, str], float], fmt: Format) -> float:
    return sum(
        cost * 4.0 ** (4 - fmt.bits(layer, head)[kind == "values"])
        for (layer, head, kind), cost in costs.items()
    )


def test_allocating_4_and_8_bits_picks_the_costliest_parts() -> None:
    costs = _costs()
    budget = held_bytes(costliest(costs, 20), list(costs), 64)
    allocated, chosen = allocate(costs, (4, 8), budget, 64), costliest(costs, 20)
    assert all(allocated.bits(layer, head) == chosen.bits(layer, head) for layer, head, _ in costs)


def test_more_widths_never_cost_more_in_the_model_and_the_budget_holds() -> None:
    costs = _costs()
    budget = held_bytes(costliest(costs, 20), list(costs), 64)
    two = allocate(costs, (4, 8), budget, 64)
    five = allocate(costs, (3, 4, 5, 6, 8), budget, 64)
    assert held_bytes(five, list(costs), 64) <= budget
    assert _modelled(costs, five) < _modelled(costs, two)
    assert {b for bits in five.head_bits.values() for b in bits} > {4, 8}  # the other widths are used
    with pytest.raises(ValueError, match="cannot hold"):
        allocate(costs, (4, 8), held_bytes(Format(), list(costs), 64) - 1, 64)


SWEPT = [
    ("kv-heads-cpu-24docs-bf16.json", SIX_BIT_PARTS),
    ("kv-heads-cpu-analysis-sweep-bf16.json", SIX_BIT_PARTS_ANSWERS),
]


@pytest.mark.parametrize(("sweep", "parts"), SWEPT)
def test_each_parts_list_is_the_allocation_over_its_sweep(sweep: str, parts: tuple[str, ...]) -> None:
    """The parts a profile names at 6 bits (KV_INT6_PARTS of int4+int6@40parts and @40answers) are
    what `allocate` gives for widths 4 and 6 within the profile's bytes over the committed sweep
    they cite, and the search's format of them holds the profile's bytes."""
    swept = json.loads((Path("bench/results") / sweep).read_text())
    costs = {(c["layer"], c["head"], c["part"]): c["kl"] for c in swept["part_costs"]}
    budget = held_bytes(FORMATS["int4+int8@5layers-w0"], list(costs), 64)
    allocated = allocate(costs, (4, 6), budget, 64)
    named = six_bit_parts(allocated, list(costs))
    assert len(named) == len(parts) and set(named) == set(parts)
    assert held_bytes(parts_format(parts), list(costs), 64) == budget
    assert bytes_ratio(parts_format(parts), 24, 64, kv_heads=2) == pytest.approx(bytes_ratio(MIXED, 24, 64))


def test_parts_named_at_6_bits_are_the_format_the_engine_would_store() -> None:
    costs = _costs()
    budget = held_bytes(costliest(costs, 20), list(costs), 64)
    allocated = allocate(costs, (4, 6), budget, 64)
    named = six_bit_parts(allocated, list(costs))
    assert named and all(part.count(".") == 2 and part[-1] in "kv" for part in named)
    stored = parts_format(named)
    assert all(stored.bits(layer, head) == allocated.bits(layer, head) for layer, head, _ in costs)


def test_the_sweep_along_answers_reads_none_of_the_documents_the_evaluation_reads() -> None:
    """Calibration along the service's answers: the generated corpus' documents (not the KV corpus)
    and the real development split, disjoint from `bench.kv_quality --real`'s sample."""
    from bench import real_data
    from bench.kv_quality import load_corpus, real_documents

    evaluated = load_corpus(None) + real_documents(real_data.sample(300), 80)
    fitted = sweep_documents(evaluated, "analysis", 16, 8)
    assert len(fitted) == 24 and len({d["document_id"] for d in fitted}) == 24
    assert not {d["text"] for d in fitted} & {d["text"] for d in evaluated}
    assert not {d["document_id"] for d in fitted} & {d["document_id"] for d in evaluated}
    assert {(d["kind"], d["language"]) for d in fitted[:16]} == {
        (kind, language) for kind in ("complaint", "meeting_notes", "filing") for language in ("zh", "en")
    }
