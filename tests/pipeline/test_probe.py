"""A document read in parts: cut only at sentence ends into at most the parts asked, nothing but the
joins dropped; the parts' readings weighed by length, each bounded; a complaint's positive reading
overruled by any part that reads negative."""

from __future__ import annotations

import pytest

from pipeline.probe import guarded, mean_log_odds, parts

TEXTS = [
    "热水器漏电，我母亲洗澡时触电，现在还在医院。我要求赔偿！客服一直推诿。顾客整体满意。",
    "The heater broke. It is awful.\nI want a refund.\nAgent: anything else?\nCustomer: no.",
    "one sentence only, however long it runs on and on",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("count", [1, 2, 3, 4, 8])
def test_parts_cover_the_text_at_sentence_ends_and_never_exceed_the_count(text: str, count: int) -> None:
    pieces = parts(text, count)
    assert len(pieces) <= max(count, 1)
    assert "".join(p.replace("\n", "") for p in pieces).replace(" ", "") == text.replace("\n", "").replace(
        " ", ""
    )
    position = 0
    for piece in pieces[:-1]:  # each cut at an end mark or a line break
        position = text.index(piece, position) + len(piece)
        assert piece[-1] in "。！？!?；;." or text[position] == "\n", piece
    assert all(p == p.strip() and p for p in pieces)


def test_a_single_sentence_stays_whole() -> None:
    assert parts(TEXTS[2], 4) == [TEXTS[2]]


def test_the_mean_weighs_by_length_and_bounds_each_reading() -> None:
    assert mean_log_odds([(1.0, 30), (-2.0, 10)]) == pytest.approx((30 - 20) / 40)
    # One part read with extreme certainty counts as at most the bound.
    assert mean_log_odds([(-40.0, 10), (5.0, 30)]) == pytest.approx((-100 + 150) / 40)


def test_a_positive_whole_is_overruled_by_its_lowest_clearly_negative_part_and_nothing_else_is() -> None:
    assert guarded(3.0, [-8.0, 4.0, -9.0], below=-7.0) == -9.0
    assert guarded(3.0, [-6.0, 4.0], below=-7.0) == 3.0  # negative, not clearly: the whole's reading
    assert guarded(3.0, [0.5, 4.0], below=0.0) == 3.0  # every part positive: the whole's reading
    assert guarded(-2.0, [6.0, 1.0], below=0.0) == -2.0  # negative already: parts cannot make it positive
    assert guarded(1.0, [], below=0.0) == 1.0  # nothing read apart
