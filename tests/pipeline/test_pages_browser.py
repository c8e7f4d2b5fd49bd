"""The pages in headless Chromium (Debian's, driven by Playwright), over the real path: the worker
`deepanalyze run` would start (default model, dynamic batching) or, for the pages' own behaviour,
a service with a scripted engine; the session's Kafka, the page's own requests. Screenshots go to
test-artifacts/browser/ for a person to look at.

Chromium and a CJK font are installed by `make install` (`.ci/install-browser`, Debian packages).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.app import serve
from pipeline.client import collect_answers, publish_documents
from pipeline.service import Service
from pipeline.settings import Settings
from pipeline.telemetry import Telemetry
from schemas import Category, DocumentEvent, DocumentKind
from tests.pipeline.fakes import ScriptedEngine
from tests.pipeline.test_front import front_end

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "browser"
COMPLAINT = (
    "我上个月在你们官网买的洗衣机，送货晚了整整五天，安装师傅又多收了两百元安装费。"
    "第一次使用就漏水，地板都泡坏了。我打了三次客服电话，每次都说会回电，结果没有任何人联系我。"
    "请在三个工作日内给我退款并赔偿地板损失，否则我会向消费者协会投诉。"
)


@pytest.fixture
async def site(settings: Settings) -> AsyncIterator[str]:
    """The worker's HTTP server with the real model behind it; yields its base URL."""
    settings = Settings(**{**settings.model_dump(), "dynamic_batching": True, "max_batch_size": 4})
    stop, ready = asyncio.Event(), asyncio.Event()
    port: list[int] = []

    def on_ready(service: Service, bound: int) -> None:
        port.append(bound)
        ready.set()

    worker = asyncio.create_task(serve(settings, stop, on_ready=on_ready))
    waiting = asyncio.create_task(ready.wait())
    await asyncio.wait({worker, waiting}, return_when=asyncio.FIRST_COMPLETED, timeout=600)
    if worker.done():
        await worker  # raises what stopped it
    try:
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        stop.set()
        await worker


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    if not await asyncio.to_thread(Path(CHROMIUM).exists):
        pytest.skip(f"no Chromium at {CHROMIUM}: `make install` installs Debian's (needs root and apt)")
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        chromium = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            await chromium.close()


@pytest.mark.model
async def test_a_pasted_chinese_complaint_is_analysed_and_appears_live_on_the_triage_board(
    site: str, browser: Any
) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []  # uncaught script errors on either page fail the test
    board = await browser.new_page(viewport={"width": 1280, "height": 900})
    board.on("pageerror", lambda exc: errors.append(f"triage: {exc}"))
    await board.goto(f"{site}/triage")
    await board.wait_for_selector("#live.up", timeout=30_000)
    assert await board.locator("#board li").count() == 0

    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("pageerror", lambda exc: errors.append(f"analyse: {exc}"))
    await page.goto(site)
    # Keyboard only: Tab from the top of the page reaches the text area, the kind, then the button.
    await _tab_to(page, "text")
    await page.keyboard.insert_text(COMPLAINT)
    assert "中文" in await page.text_content("#language") or ""
    await page.keyboard.press("Tab")
    assert await page.evaluate("document.activeElement.id") == "kind"
    await page.keyboard.press("Tab")
    assert await page.evaluate("document.activeElement.id") == "analyze"
    await page.keyboard.press("Enter")
    await page.wait_for_selector("#status .spinner", timeout=10_000)  # the visible progress state
    await page.screenshot(path=ARTIFACTS / "analyse-waiting-desktop.png")
    # The report fills in as the model writes it (the viewpoint first), then the analysis lands.
    await page.wait_for_function(
        "!document.querySelector('#viewpoint').classList.contains('placeholder')", timeout=600_000
    )
    assert "完成" not in (await page.text_content("#status") or "")
    await page.wait_for_function(
        "document.querySelector('#status').textContent.includes('完成')", timeout=600_000
    )
    viewpoint = (await page.text_content("#viewpoint") or "").strip()
    assert viewpoint
    for section in ("#facts li", "#data li", "#conclusions li"):
        assert await page.locator(section).count() >= 1
    assert (await page.text_content("#sentiment") or "").strip()
    assert await page.is_visible("#triage-block")
    assert "s" in (await page.text_content("#timings") or "")
    assert await page.is_hidden("#error")
    await page.screenshot(path=ARTIFACTS / "analyse-result-desktop.png", full_page=True)

    # The board was open all along: the complaint appears without a reload.
    await board.wait_for_selector("#board li", timeout=60_000)
    item = board.locator("#board li").first
    assert viewpoint[:20] in (await item.text_content() or "")
    counts = await board.text_content("#counts") or ""
    assert any(ch.isdigit() and ch != "0" for ch in counts)
    await board.screenshot(path=ARTIFACTS / "triage-desktop.png", full_page=True)
    # Filters: another urgency hides it, its own category keeps it.
    badge = await item.locator(".badge").get_attribute("class") or ""
    urgency = badge.split("urgency-")[-1]
    await board.select_option("#urgency", next(u for u in ("low", "critical") if u != urgency))
    assert await board.locator("#board li").count() == 0
    await board.select_option("#urgency", "")
    await board.select_option("#category", await item.get_attribute("data-category"))
    assert await board.locator("#board li").count() == 1

    # Readable at 360 px: nothing wider than the screen, the result below the form.
    for name, target in (("analyse", page), ("triage", board)):
        await target.set_viewport_size({"width": 360, "height": 780})
        assert await target.evaluate("document.documentElement.scrollWidth") <= 360, name
        await target.screenshot(path=ARTIFACTS / f"{name}-360px.png", full_page=True)
    # Chinese needs a CJK font on the machine (the page names them; Chromium falls back to it).
    listed = await asyncio.to_thread(
        subprocess.run, ["/usr/bin/fc-list", ":lang=zh", "family"], capture_output=True, text=True, check=True
    )
    fonts = listed.stdout
    assert "WenQuanYi" in fonts or "Noto Sans CJK" in fonts
    assert errors == []


@pytest.mark.model
async def test_errors_are_shown_plainly_on_the_page(site: str, browser: Any) -> None:
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    await page.goto(site)
    await page.click("#analyze")  # nothing pasted
    assert "粘贴" in (await page.text_content("#error") or "")
    limit = int(
        await page.evaluate("fetch('/api/limits').then(r => r.json()).then(l => l.max_document_chars)")
    )
    await page.fill("#text", "长" * (limit + 1))  # said as it is typed; the button cannot send it
    message = await page.text_content("#error") or ""
    assert "过长" in message and "too long" in message
    assert await page.is_disabled("#analyze")
    await page.screenshot(path=ARTIFACTS / "analyse-too-long.png")


async def _tab_to(page: Any, element_id: str, limit: int = 20) -> None:
    for _ in range(limit):
        await page.keyboard.press("Tab")
        if await page.evaluate("document.activeElement.id") == element_id:
            return
    raise AssertionError(f"#{element_id} is not reachable with Tab")


async def test_with_a_token_the_pages_ask_for_it_once_then_the_cookie_carries_their_requests(
    browser: Any,
) -> None:
    """HTTP_TOKEN set (no model or broker needed: a stand-in answer hub): a page sends the browser
    to the login form; after it the session cookie carries the pages' fetches and the event stream,
    which EventSource could not authenticate with a header."""
    from tests.pipeline.test_http import TOKEN, guarded

    errors: list[str] = []
    async with guarded(http_token=TOKEN) as url:
        page = await browser.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        await page.goto(f"{url}/triage")
        assert page.url == f"{url}/login?next=/triage"
        await page.fill("#token", "not-the-token")
        await page.click("button[type=submit]")
        assert "Wrong token" in (await page.text_content("[role=alert]") or "")
        await page.fill("#token", TOKEN)
        await page.click("button[type=submit]")
        await page.wait_for_selector("#live.up", timeout=10_000)  # the stream, on the cookie
        assert page.url == f"{url}/triage"
        (cookie,) = await page.context.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and TOKEN not in cookie["value"]
        await page.goto(url)
        await page.wait_for_function("document.querySelector('#count').textContent.includes('/ 8000')")
        await page.screenshot(path=ARTIFACTS / "login-then-analyse.png")
    assert errors == []


# The pages' own behaviour, with a scripted engine behind them (seconds, not minutes).


async def _page(browser: Any, errors: list[str], **options: Any) -> Any:
    page = await browser.new_page(viewport={"width": 1280, "height": 900}, **options)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return page


async def test_a_new_submission_clears_the_last_report_and_errors_say_what_to_do(
    settings: Settings, telemetry: Telemetry, browser: Any
) -> None:
    errors: list[str] = []
    async with front_end(settings, telemetry) as site:
        page = await _page(browser, errors)
        await page.goto(site)
        # Every status line the page shows, recorded as it changes: plain words, no Kafka coordinates.
        await page.evaluate("""window.said = [];
            const status = document.querySelector('#status');
            new MutationObserver(() => window.said.push(status.textContent))
              .observe(status, { childList: true, subtree: true, characterData: true });""")
        await page.fill("#text", "洗衣机漏水，客服不回电话。")
        await page.click("#analyze")
        # The viewpoint may show from a partial report before the whole one: wait for the end itself.
        await page.wait_for_function("document.querySelector('#status').textContent.includes('完成')")
        viewpoint = "document.querySelector('#viewpoint').classList.contains('placeholder')"
        assert not await page.evaluate(viewpoint)
        said = await page.evaluate("window.said")
        assert any("已提交" in line for line in said)
        assert not any(
            settings.topic_complaints in line or "@" in line or "Kafka" in line for line in said
        ), said

        # An empty submission: the previous report and its "Done" go, the error says what to do.
        await page.fill("#text", "")
        await page.click("#analyze")
        assert "粘贴" in (await page.text_content("#error") or "")
        assert await page.evaluate("document.querySelector('#viewpoint').classList.contains('placeholder')")
        assert await page.locator("#facts li").count() == 0
        assert (await page.text_content("#status") or "") == ""

        # Too long: said while typing, with what to do, and the button cannot send it.
        limit = int(
            await page.evaluate("fetch('/api/limits').then(r => r.json()).then(l => l.max_document_chars)")
        )
        await page.fill("#text", "长" * (limit + 1))
        message = await page.text_content("#error") or ""
        assert "Shorten it" in message and "删减" in message and str(limit) in message
        assert await page.is_disabled("#analyze")
        await page.fill("#text", "短")
        assert await page.is_hidden("#error") and await page.is_enabled("#analyze")

        # The broker away: what to do, not host:port or an exception's name; no stale report.
        internals = {
            "error": "broker_unavailable",
            "detail": "could not publish to 10.0.0.1:9092: TimeoutError",
        }
        await page.route("**/api/analyze", lambda route: route.fulfill(status=503, json=internals))
        await page.click("#analyze")
        await page.wait_for_selector("#error:not([hidden])")
        message = await page.text_content("#error") or ""
        assert "Try again in a minute" in message and "TimeoutError" not in message and "9092" not in message
        assert (await page.text_content("#status") or "") == "" and await page.is_enabled("#analyze")
        await page.screenshot(path=ARTIFACTS / "analyse-broker-down.png")
    assert errors == []


async def test_the_board_pages_lists_the_taxonomy_and_writes_dates_in_the_page_s_language(
    settings: Settings, telemetry: Telemetry, browser: Any
) -> None:
    errors: list[str] = []
    documents = [DocumentEvent(document_id=f"c{i}", kind=DocumentKind.COMPLAINT, text=f"第{i}台洗衣机漏水。")
                 for i in range(60)]  # fmt: skip
    async with front_end(settings, telemetry) as site:
        sent = await publish_documents(settings, documents)
        await collect_answers(settings, {s.event_id for s in sent}, timeout_s=120)
        page = await _page(browser, errors, locale="en-US")  # an English browser, a Chinese page
        await page.goto(f"{site}/triage")
        await page.wait_for_selector("#live.up", timeout=30_000)
        await page.wait_for_function("document.querySelectorAll('#board li').length === 50", timeout=30_000)
        assert "10" in (await page.text_content("#more") or "")
        await page.click("#more")
        assert await page.locator("#board li").count() == 60 and await page.is_hidden("#more")
        options = await page.eval_on_selector_all("#category option", "os => os.map(o => o.value)")
        assert options == ["", *(c.value for c in Category)]
        when = await page.text_content("#board li time") or ""
        assert "年" in when and "月" in when, when  # zh-CN, whatever the browser's locale
        icon = await page.get_attribute("link[rel=icon]", "href")
        assert icon and (await page.request.get(f"{site}{icon}")).ok
        await page.screenshot(path=ARTIFACTS / "triage-paged.png", full_page=True)
    assert errors == []


async def test_the_board_says_when_the_worker_cannot_reach_the_broker(
    settings: Settings, telemetry: Telemetry, browser: Any
) -> None:
    errors: list[str] = []
    async with front_end(settings, telemetry, worker=False, reachable=lambda: False) as site:
        page = await _page(browser, errors)
        await page.goto(f"{site}/triage")
        await page.wait_for_selector("#live.down", timeout=10_000)
        await page.wait_for_function("document.querySelector('#live').textContent.includes('unreachable')")
        assert "实时" not in (await page.text_content("#live") or "")
    assert errors == []


async def test_the_report_fills_in_as_it_is_written(
    settings: Settings, telemetry: Telemetry, browser: Any
) -> None:
    """The labels, then the viewpoint and each item appear while the model is still writing; the
    finished analysis replaces them."""
    errors: list[str] = []
    async with front_end(settings, telemetry, engine=ScriptedEngine(piece_delay_s=0.05)) as site:
        page = await _page(browser, errors)
        await page.goto(site)
        await page.evaluate("""window.log = [];
            const status = document.querySelector('#status'), view = document.querySelector('#viewpoint');
            const watch = (node, name, value) => new MutationObserver(() => window.log.push([name, value()]))
              .observe(node, { childList: true, subtree: true, characterData: true, attributes: true });
            watch(status, 'status', () => status.textContent);
            watch(view, 'viewpoint', () => (view.classList.contains('placeholder') ? '' : view.textContent));
            """)
        await page.fill("#text", "洗衣机漏水，客服不回电话。")
        await page.click("#analyze")
        await page.wait_for_function(
            "document.querySelector('#status').textContent.includes('完成')", timeout=30_000
        )
        log = await page.evaluate("window.log")
        await page.screenshot(path=ARTIFACTS / "analyse-finished-after-streaming.png")
    done = next(i for i, (name, value) in enumerate(log) if name == "status" and "完成" in value)
    shown = next(i for i, (name, value) in enumerate(log) if name == "viewpoint" and value)
    writing = [i for i, (name, value) in enumerate(log) if name == "status" and "Writing the report" in value]
    assert writing and writing[0] < shown < done, log  # the viewpoint showed while it was being written
    assert errors == []
