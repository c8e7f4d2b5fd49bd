"""The pages in headless Chromium (Debian's, driven by Playwright), over the real path: the worker
`deepanalyze run` would start (default model, dynamic batching), the session's Kafka, the page's
own requests. Screenshots go to test-artifacts/browser/ for a person to look at.

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
from pipeline.service import Service
from pipeline.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.model]

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
    await page.wait_for_function(
        "!document.querySelector('#viewpoint').classList.contains('placeholder')", timeout=600_000
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
    categories = await board.eval_on_selector_all("#category option", "os => os.map(o => o.value)")
    await board.select_option("#category", categories[-1])
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


async def test_errors_are_shown_plainly_on_the_page(site: str, browser: Any) -> None:
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    await page.goto(site)
    await page.click("#analyze")  # nothing pasted
    assert "粘贴" in (await page.text_content("#error") or "")
    limit = int(
        await page.evaluate("fetch('/api/limits').then(r => r.json()).then(l => l.max_document_chars)")
    )
    await page.fill("#text", "长" * (limit + 1))
    await page.click("#analyze")
    message = await page.text_content("#error") or ""
    assert "过长" in message and "too long" in message
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
