"""The clean-text rules: each holds on the parser's output whatever the model wrote."""

from __future__ import annotations

import json

import pytest

from prompts import AnalysisParseError, parse_narrative
from prompts.hygiene import (
    copied_example,
    foreign_words,
    is_filler,
    is_label_viewpoint,
    sort_layers,
    trim_cut,
    without_attitude_lead,
)
from prompts.render import worked_examples
from schemas import ANSWER_BOUNDS, Language


def narrative(**overrides: object) -> str:
    value: dict[str, object] = {
        "core_viewpoint": "The writer holds that the refund was refused without reason and asks for it now.",
        "key_information": {
            "facts": ["The heater leaked."],
            "data": ["order 4471"],
            "conclusions": ["Refund."],
        },
        "rationale": "The writer is angry about the refused refund.",
    }
    return json.dumps(value | overrides, ensure_ascii=False)


def test_a_field_cut_at_its_bound_ends_on_a_word_or_clause_boundary() -> None:
    en = ANSWER_BOUNDS[Language.EN].viewpoint
    cut = ("The writer says the washing machine leaked twice and the engineers never came, " * 5)[:en]
    assert not cut.endswith(" ") and len(cut) == en  # the decoder closed it inside a word
    for closed_at in (en, en - 1, en - 5):  # at the bound, or a token short of it ("…repurc")
        trimmed = trim_cut(cut[:closed_at], en, Language.EN)
        body = trimmed.removesuffix(".")
        assert trimmed.endswith(".") and cut.startswith(body) and cut[len(body)] in " ,;:."  # a word's end
        assert trim_cut(trimmed, en, Language.EN) == trimmed  # a sentence now: trimmed once
    zh = "洗衣机漏水两次，维修师傅一直没有上门，客服还说要再等一周才能处理，" * 4
    trimmed_zh = trim_cut(zh[:79], 80, Language.ZH)
    assert trimmed_zh.endswith("。") and zh.startswith(trimmed_zh[:-1]) and len(trimmed_zh) < 79
    assert trim_cut("short", 80, Language.EN) == "short"  # below the bound: untouched
    whole = "The writer holds that the washing machine leaked twice and asks for a new one. " * 4
    ended = whole[: en - 3].rstrip() + "."
    assert trim_cut(ended, en, Language.EN) == ended  # a whole sentence near the bound: kept


def test_parsed_narrative_has_no_cut_word_no_empty_item_and_no_repeat() -> None:
    bound = ANSWER_BOUNDS[Language.EN].item
    long_item = ("The engineer came late and left without fixing the pump, " * 6)[:bound]
    raw = narrative(
        key_information={
            "facts": ["The heater leaked.", " ", "N/A", long_item],
            "data": ["order 4471", "The heater leaked.", "no figure here"],
            "conclusions": ["…", "order 4471", "A refund is due."],
        }
    )
    parsed = parse_narrative(raw, Language.EN, "The heater leaked. order 4471")
    info = parsed.key_information
    items = [*info.facts, *info.data, *info.conclusions]
    assert len(items) == len(set(items))  # nothing said twice across the three lists
    assert not any(is_filler(i) for i in items)
    assert all(len(i) < bound for i in items)  # the cut item was trimmed back
    assert info.data == ["order 4471"] and "no figure here" in info.facts  # data hold figures


def test_an_item_in_the_other_language_is_dropped_and_a_mixed_viewpoint_refused() -> None:
    document = "洗衣机漏水，客服不理。型号XQB80。"
    assert foreign_words("型号XQB80漏水", Language.ZH, document) == []  # copied from the document
    assert foreign_words("our legal部门will纠纷", Language.ZH, document) == ["our", "legal", "will"]
    assert foreign_words("The 部门 refused", Language.EN, "The team refused") == ["部", "门"]
    zh = json.dumps(
        {
            "core_viewpoint": "作者认为洗衣机质量有问题，要求商家尽快退款。",
            "key_information": {
                "facts": ["洗衣机漏水", "the service was bad"],
                "data": [],
                "conclusions": [],
            },
            "rationale": "作者对漏水和客服不满。",
        },
        ensure_ascii=False,
    )
    assert parse_narrative(zh, Language.ZH, document).key_information.facts == ["洗衣机漏水"]
    mixed = json.loads(zh) | {"core_viewpoint": "作者认为our legal部门will处理纠纷并退款。"}
    with pytest.raises(AnalysisParseError, match="one language"):
        parse_narrative(json.dumps(mixed, ensure_ascii=False), Language.ZH, document)


@pytest.mark.parametrize(
    ("text", "language"),
    [("客户投诉", Language.ZH), ("这是一份客户投诉。", Language.ZH), ("会议纪要", Language.ZH),
     ("Financial Analyst", Language.EN), ("Customer complaint.", Language.EN), ("Bad service", Language.EN),
     ("..., and asks ..., and asks ...", Language.EN), ("作者认为……，要求……", Language.ZH)],
)  # fmt: skip
def test_a_label_is_not_a_viewpoint(text: str, language: Language) -> None:
    assert is_label_viewpoint(text, language)
    with pytest.raises(AnalysisParseError, match="position"):
        parse_narrative(narrative(core_viewpoint=text), language, text)


def test_a_position_in_a_sentence_is_a_viewpoint() -> None:
    assert not is_label_viewpoint("客户认为热水器漏电危及家人安全，要求全额退款并赔偿医药费。", Language.ZH)
    assert not is_label_viewpoint("The writer wants the double charge refunded this week.", Language.EN)


def test_sort_layers_keeps_short_distinct_figures() -> None:
    facts, data, conclusions = sort_layers(["价格5999元"], ["5999元", "2", "3"], ["2"])
    assert data == ["5999元", "2", "3"] and conclusions == [] and facts == ["价格5999元"]


@pytest.mark.parametrize("language", list(Language))
def test_an_analysis_copied_from_a_worked_example_is_refused_and_such_items_dropped(
    language: Language,
) -> None:
    # What the 0.5B model wrote for English filings when the examples preceded the document.
    example = worked_examples(language)[2]
    document = (
        "营业收入同比下降 6%，净利润增长 8%。"
        if language is Language.ZH
        else "Net sales fell 12% to $47 billion."
    )
    assert copied_example(f"The writer holds that {example}", worked_examples(language), document)
    with pytest.raises(AnalysisParseError, match="not the examples"):
        parse_narrative(narrative(core_viewpoint=f"The writer holds that {example}"), language, document)
    with pytest.raises(AnalysisParseError, match="not the examples"):
        parse_narrative(narrative(rationale=example), language, document)
    fine = (
        "客户认为热水器漏电危及家人安全，要求全额退款。" if language is Language.ZH else narrative_viewpoint()
    )
    layers = {"facts": [example, fine], "data": [], "conclusions": []}
    parsed = parse_narrative(
        narrative(core_viewpoint=fine, rationale=fine, key_information=layers), language, document
    )
    assert parsed.key_information.facts == [fine]


def test_a_document_that_says_what_an_example_says_may_be_quoted() -> None:
    example = worked_examples(Language.EN)[2]
    assert copied_example(example, worked_examples(Language.EN), f"My review: {example}") is None
    assert copied_example("The writer wants the charge refunded.", worked_examples(Language.EN), "x") is None


def narrative_viewpoint() -> str:
    return "The writer holds that the refund was refused without reason and asks for it now."


def test_a_viewpoint_does_not_open_with_the_attitude_word_it_was_given() -> None:
    zh = "负面，董事会建议每10股派发现金红利1元，但公司预计需求将放缓。"
    assert without_attitude_lead(zh) == "董事会建议每10股派发现金红利1元，但公司预计需求将放缓。"
    assert without_attitude_lead("Negative: the writer wants a refund.") == "The writer wants a refund."
    kept = "负面影响有限，作者认为公司仍会增长。"  # the word inside the position, not a label before it
    assert without_attitude_lead(kept) == kept
    parsed = parse_narrative(narrative(core_viewpoint=zh, rationale="公司预计需求将放缓。"), Language.ZH, zh)
    assert parsed.core_viewpoint == without_attitude_lead(zh)


def test_a_run_on_with_no_boundary_to_trim_back_to_is_dropped_or_refused() -> None:
    bounds = ANSWER_BOUNDS[Language.EN]
    run_on = ("}]}```json" * 40)[: bounds.item]  # what the 0.5B model once wrote into a list
    layers = {"facts": ["The heater leaked.", run_on], "data": [], "conclusions": []}
    parsed = parse_narrative(narrative(key_information=layers), Language.EN, "The heater leaked.")
    assert parsed.key_information.facts == ["The heater leaked."]
    with pytest.raises(AnalysisParseError, match="bound"):
        parse_narrative(narrative(rationale=("x" * 400)[: bounds.rationale]), Language.EN, "x")


def test_a_field_name_written_as_an_item_is_dropped() -> None:
    layers = {"facts": ["The heater leaked.", "data", "conclusions"], "data": ["数据"], "conclusions": []}
    parsed = parse_narrative(narrative(key_information=layers), Language.EN, "The heater leaked.")
    assert parsed.key_information.facts == ["The heater leaked."] and parsed.key_information.data == []
