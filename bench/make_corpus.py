"""Writes bench/data/corpus.jsonl: 60 synthetic documents (complaints, meeting notes, filings;
Chinese and English; 150-2,000 characters) for the engine benchmark and the schema-validity run,
and bench/data/kv-corpus.jsonl: 120 more from another seed for the KV-compression harness, with
a sentiment label where the construction justifies one (every complaint sentence is a grievance,
so complaints are labelled negative; notes and filings mix good and bad news and stay unlabelled).

Synthetic on purpose: sentences are drawn from hand-written banks with varied names, figures and
dates, so the corpus is reproducible (`python bench/make_corpus.py`) and free of real customer
data. It exercises lengths, languages and kinds; it is not a quality benchmark.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("data") / "corpus.jsonl"
KV_OUT = Path(__file__).with_name("data") / "kv-corpus.jsonl"

BANKS: dict[tuple[str, str], list[str]] = {
    ("complaint", "zh"): [
        "我于{month}月{day}日在贵公司{channel}购买了{product}，订单号 {order}，金额 {amount} 元。",
        "页面承诺{promise}，但实际{reality}，比承诺晚了{days}天。",
        "安装人员上门后额外收取了 {fee} 元费用，下单时并没有任何说明。",
        "我先后{calls}次联系客服，每次都说会在24小时内回复，至今没有任何答复。",
        "产品第一次使用就出现{defect}，给我的家庭生活造成了很大不便。",
        "这已经不是第一次了，上个月购买的{product2}也出现过类似问题。",
        "我要求在{deadline}天内退还多收的费用，并上门检修或直接更换新品。",
        "如果得不到合理解决，我将向消费者协会投诉，并在社交媒体上公开此事。",
        "我对贵公司的售后服务非常失望，也怀疑你们是否真的重视客户的权益。",
        "希望贵公司能认真对待此事，给出书面说明和处理方案。",
        "家里老人因为{defect}差点受伤，这是严重的安全隐患。",
        "我保留了所有聊天记录和照片，必要时会寻求法律途径解决。",
    ],
    ("complaint", "en"): [
        "On {month_en} {day} I ordered a {product_en} from your {channel_en} (order {order}, ${amount}).",
        "You promised {promise_en}, but {reality_en}, {days} days later than promised.",
        "The technician charged an extra ${fee} that was never mentioned at checkout.",
        "I have contacted support {calls} times and every time I was told someone would call back within a day.",
        "The first time I used it, it {defect_en}.",
        "This is not the first time: the {product2_en} I bought last month had the same problem.",
        "I expect a refund of the extra charge and a replacement within {deadline} days.",
        "If this is not resolved, I will file a complaint with the consumer protection agency and post about it.",
        "Frankly, I doubt your company takes its customers seriously.",
        "Please reply in writing with a concrete plan.",
        "My child nearly got hurt because it {defect_en}; this is a safety hazard.",
        "I have kept every email and photo and will involve a lawyer if necessary.",
    ],
    ("meeting_notes", "zh"): [
        "{dept}周会纪要（{month}月{day}日，参会：{people}）。",
        "上周共收到客户投诉 {count} 条，较前一周{trend} {pct}%，其中{issue}占 {share}%。",
        "{person}汇报：新版系统上线后，{metric}从 {before}% 降到 {after}%，但{problem}仍未解决。",
        "决定：由{person}牵头，在{month2}月{day2}日前完成{action}。",
        "{person2}对第四季度目标 {target} 亿元能否完成表示担忧，建议追加 {budget} 万元预算。",
        "会上未就预算达成一致，下周再议。",
        "法务提示：新合同模板仍在审核中，审核通过前不得对外使用。",
        "会议同意暂停{dept}以外部门的招聘，直到预测确认。",
        "{person}将于下周三前提交修订后的销售预测。",
        "下次会议时间：{month2}月{day2}日上午10点。",
    ],
    ("meeting_notes", "en"): [
        "{dept_en} sync, {month_en} {day}. Attendees: {people_en}.",
        "Complaints last week: {count}, {trend_en} {pct}% week over week; {issue_en} made up {share}%.",
        "{person_en} reported that {metric_en} fell from {before}% to {after}%, but {problem_en} remains open.",
        "Decision: {person_en} owns {action_en}, due {month2_en} {day2}.",
        "{person2_en} doubts the Q4 target of ${target}M is reachable and asked for an extra ${budget}K budget.",
        "No agreement on the budget; to be revisited next week.",
        "Legal: the new contract template is still under review and must not be used before sign-off.",
        "Hiring outside {dept_en} is frozen until the forecast is confirmed.",
        "{person_en} will circulate a revised forecast by Wednesday.",
        "Next meeting: {month2_en} {day2}, 10:00.",
    ],
    ("filing", "zh"): [
        "本公司{year}年前三季度实现营业收入 {rev} 亿元，同比{trend} {pct}%。",
        "归属于上市公司股东的净利润 {profit} 亿元，同比{trend2} {pct2}%，主要原因是{reason}。",
        "经营活动产生的现金流量净额为 {cash} 亿元，同比增长 {pct3}%。",
        "截至9月30日，公司资产负债率为 {debt}%，较年初上升 {delta} 个百分点。",
        "公司预计第四季度{outlook}。",
        "提请投资者关注：前五大客户收入占比 {share}%，客户集中度较高。",
        "部分在建项目存在延期风险，可能影响全年业绩。",
        "如人民币汇率继续大幅波动，可能对公司利润产生不利影响。",
        "报告期内公司回购股份 {shares} 万股，耗资 {buyback} 亿元。",
        "董事会建议每10股派发现金红利 {dividend} 元。",
    ],
    ("filing", "en"): [
        "For fiscal {year}, net sales {trend_en} {pct}% to ${rev} billion.",
        "Gross margin moved {delta} percentage points to {margin}%, mainly because of {reason_en}.",
        "Operating income was ${profit} million compared with ${profit_prev} million a year earlier.",
        "Cash from operations rose {pct3}% to ${cash} million.",
        "The Company repurchased {shares} million shares for ${buyback} million.",
        "The quarterly dividend was raised to ${dividend} per share.",
        "Management expects next-year sales growth of {lo}% to {hi}%.",
        "The outlook assumes no further deterioration in European demand.",
        "A pending antitrust review could delay the closing of the {target_co} acquisition.",
        "Customer concentration remains high: the top five customers account for {share}% of revenue.",
    ],
}

FILL = {
    "product": ["滚筒洗衣机", "空调", "冰箱", "扫地机器人", "电热水器"],
    "product2": ["吸尘器", "微波炉", "净水器"],
    "channel": ["官网", "旗舰店", "线下门店"],
    "promise": ["三天内送达", "免费安装", "七天无理由退货"],
    "reality": ["过了一周才送到", "安装时被要求额外付费", "退货申请被拒绝"],
    "defect": ["漏水", "异常噪音", "无法开机", "电源线发烫"],
    "product_en": ["washing machine", "air conditioner", "fridge", "robot vacuum", "water heater"],
    "product2_en": ["vacuum cleaner", "microwave", "water filter"],
    "channel_en": ["website", "flagship store", "app"],
    "promise_en": ["delivery within three days", "free installation", "a 30-day return window"],
    "reality_en": ["it arrived a week late", "installation was charged", "my return was refused"],
    "defect_en": ["leaked water", "made a grinding noise", "would not turn on", "overheated"],
    "dept": ["产品", "客服", "市场", "战略"],
    "dept_en": ["Product", "Support", "Marketing", "Strategy"],
    "people": ["张伟、李娜、王强", "陈静、刘洋、赵敏", "孙磊、周婷、吴昊"],
    "people_en": ["Maria, Tom, Priya", "Ken, Aisha, Luca", "Wei, Sam, Olga"],
    "person": ["王强", "李娜", "刘洋"],
    "person2": ["陈静", "赵敏", "周婷"],
    "person_en": ["Priya", "Tom", "Aisha"],
    "person2_en": ["Maria", "Ken", "Olga"],
    "issue": ["物流延迟", "安装收费争议", "产品质量"],
    "issue_en": ["late delivery", "billing disputes", "product defects"],
    "metric": ["崩溃率", "退货率", "投诉率"],
    "metric_en": ["the crash rate", "the return rate", "the complaint rate"],
    "problem": ["支付页加载慢", "物流时效", "客服响应慢"],
    "problem_en": ["checkout latency", "delivery times", "support response time"],
    "action": ["物流供应商重新谈判", "安装收费标准公示", "客服流程改造"],
    "action_en": [
        "renegotiating carrier terms",
        "publishing installation fees",
        "the support workflow redesign",
    ],
    "trend": ["增长", "下降"],
    "trend2": ["增长", "下降"],
    "trend_en": ["grew", "fell"],
    "reason": ["原材料价格上涨及汇兑损失增加", "海外订单增长", "研发投入加大"],
    "reason_en": ["higher freight and component costs", "a stronger product mix", "price competition"],
    "outlook": ["海外订单将保持增长", "需求将有所放缓", "毛利率将逐步恢复"],
    "target_co": ["Halberd", "Northwind", "Corvid"],
    "month_en": ["January", "March", "May", "September", "October", "November"],
    "month2_en": ["December", "January", "February"],
}


def _value(name: str, rng: random.Random) -> str:
    if name in FILL:
        return rng.choice(FILL[name])
    numbers = {
        "month": (1, 12), "month2": (1, 12), "day": (1, 28), "day2": (1, 28), "days": (2, 15),
        "amount": (199, 9999), "fee": (50, 500), "calls": (2, 6), "deadline": (3, 10), "count": (80, 900),
        "pct": (2, 40), "pct2": (2, 30), "pct3": (5, 60), "share": (10, 60), "before": (2, 9), "after": (0, 2),
        "target": (1, 30), "budget": (50, 900), "year": (2024, 2026), "rev": (2, 90), "profit": (1, 400),
        "profit_prev": (1, 400), "cash": (1, 900), "debt": (30, 75), "delta": (1, 5), "margin": (20, 45),
        "shares": (1, 30), "buyback": (1, 200), "dividend": (1, 9), "lo": (1, 4), "hi": (5, 9),
    }  # fmt: skip
    lo, hi = numbers.get(name, (1, 99))
    return str(rng.randint(lo, hi))


def _render(template: str, rng: random.Random) -> str:
    import string

    names = [f[1] for f in string.Formatter().parse(template) if f[1]]
    values = {n: _value(n, rng) for n in names}
    values["order"] = f"A{rng.randint(2024, 2026)}-{rng.randint(1000, 9999)}"
    return template.format(**values)


def build(seed: int = 20261130, per_cell: int = 10) -> list[dict[str, object]]:
    rng = random.Random(seed)
    documents = []
    for (kind, language), bank in BANKS.items():
        for i in range(per_cell):
            target = rng.choice([150, 300, 600, 1000, 1500, 2000])
            sentences: list[str] = []
            joiner = "" if language == "zh" else " "
            while len(joiner.join(sentences)) < max(160, target * 0.9):
                sentences.append(
                    _render(bank[len(sentences) % len(bank)] if i % 2 else rng.choice(bank), rng)
                )
            while len(joiner.join(sentences)) > 2000:
                sentences.pop()
            text = joiner.join(sentences)
            documents.append(
                {
                    "document_id": f"{kind}-{language}-{i:02d}",
                    "kind": kind,
                    "language": language,
                    "text": text,
                }
            )
    return documents


def write(path: Path, docs: list[dict[str, object]]) -> None:
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    lengths = sorted(len(str(d["text"])) for d in docs)
    median = lengths[len(lengths) // 2]
    print(
        f"wrote {len(docs)} documents to {path} (chars: min {lengths[0]}, median {median}, max {lengths[-1]})"
    )


if __name__ == "__main__":
    write(OUT, build())
    kv_docs = build(seed=20261201, per_cell=20)
    for doc in kv_docs:
        doc["document_id"] = f"kv-{doc['document_id']}"
        if doc["kind"] == "complaint":
            doc["label_polarity"] = "negative"
    write(KV_OUT, kv_docs)
