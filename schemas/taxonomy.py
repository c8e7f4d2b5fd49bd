"""The triage taxonomy a desk routes on: complaint categories, the urgency scale, the escalation rule.

Closed and documented: the same codes in every language, a display label per language, an
`other` for what fits nowhere. The category is a routing queue, not a summary: a hotel room and a
washing machine that leaks are both `product_quality` when the thing bought does not work.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class Category(StrEnum):
    SAFETY = "safety"
    PRODUCT_QUALITY = "product_quality"
    DELIVERY = "delivery"
    BILLING = "billing"
    CUSTOMER_SERVICE = "customer_service"
    AFTER_SALES = "after_sales"
    MISLEADING_CLAIMS = "misleading_claims"
    ACCOUNT_ACCESS = "account_access"
    PRIVACY = "privacy"
    OTHER = "other"


class Label(NamedTuple):
    zh: str
    en: str
    scope: str  # what belongs here, for the desk and for the model's question
    scope_zh: str


CATEGORY_LABELS: dict[Category, Label] = {
    Category.SAFETY: Label("安全隐患", "safety hazard", "harm or danger to people: injury, fire, electric shock, poisoning", "人身伤害或危险：受伤、起火、触电、中毒"),
    Category.PRODUCT_QUALITY: Label("产品质量", "product quality", "the product or service bought is faulty, broken or poor", "所购产品或服务有缺陷、损坏或质量差"),
    Category.DELIVERY: Label("物流配送", "delivery", "shipping late, lost, damaged in transit, wrong item delivered", "发货延误、丢件、运输损坏、送错货"),
    Category.BILLING: Label("收费退款", "billing and refunds", "wrong or unexpected charges, prices, refunds not paid", "收费错误或意外收费、价格、退款未到账"),
    Category.CUSTOMER_SERVICE: Label("服务态度", "customer service", "staff attitude, unanswered calls, being passed around", "员工态度、电话无人接听、被推来推去"),
    Category.AFTER_SALES: Label("售后维修", "after-sales and repair", "warranty, repair, installation, returns handling", "保修、维修、安装、退换货处理"),
    Category.MISLEADING_CLAIMS: Label("虚假宣传", "misleading claims", "advertising or sales promises that were not true", "广告或销售承诺与事实不符"),
    Category.ACCOUNT_ACCESS: Label("账户系统", "account and app", "login, account, app or website not working", "登录、账户、应用或网站无法使用"),
    Category.PRIVACY: Label("隐私数据", "privacy and data", "personal data leaked, misused or sold", "个人信息被泄露、滥用或出售"),
    Category.OTHER: Label("其他", "other", "none of the above", "以上都不是"),
}  # fmt: skip


class UrgencyRule(NamedTuple):
    zh: str
    en: str


# The urgency scale, lowest first, with the criteria the model is asked to apply; the safety
# floor (pipeline side) raises any answer to `critical` when a document names harm to a person.
URGENCY_CRITERIA: dict[str, UrgencyRule] = {
    "low": UrgencyRule(
        "一般不满或建议，不要求具体处理", "dissatisfaction or feedback; no specific action asked"
    ),
    "medium": UrgencyRule(
        "要求退款、维修、更换或答复", "asks for a refund, repair, replacement or an answer"
    ),
    "high": UrgencyRule(
        "安全隐患但未伤人、威胁投诉或起诉、较大经济损失",
        "a hazard without harm, a threat to sue or report, a large loss",
    ),
    "critical": UrgencyRule(
        "已有人受伤、住院、死亡，起火、触电，或已起诉、已向监管部门投诉",
        "someone hurt, in hospital or dead; fire or electric shock; a lawsuit or regulator complaint filed",
    ),
}

# Escalation is a rule, not an opinion: high and critical go to a supervisor at once.
ESCALATE_AT = ("high", "critical")


def category_label(category: Category, language: str) -> str:
    label = CATEGORY_LABELS[category]
    return label.zh if language == "zh" else label.en
