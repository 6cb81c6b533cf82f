"""examples/ai-sdk-react (React, `useChat`) in Debian's headless Chromium against a real `chatmem up`.

The example is bundled and served by its own pinned esbuild on another origin (so
CORS_ORIGINS is part of what is tested); the page talks to chatmem only through the AI
SDK's transport and the stop endpoint: send, stop, reload-resume, approve, and a long chat's
earlier messages loaded a page at a time.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser_support import (
    ChatmemUp,
    browser_missing,
    example_reply_text,
    example_send,
    example_up,
    served_example,
    stored_chat_reply,
    stored_text,
)

pytestmark = pytest.mark.browser

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ai-sdk-react"
NODE = shutil.which("node")

_missing = browser_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)
if NODE is None:
    pytest.skip("node is not installed", allow_module_level=True)

from playwright.sync_api import Browser, Page  # noqa: E402
from playwright.sync_api import expect as expect_ui  # noqa: E402

ASK = '/tool transfer_funds {"amount": 3, "to": "carol"}'


@pytest.fixture(scope="module")
def example_url() -> Iterator[str]:
    """The example, bundled and served by esbuild (what `npm run serve` does, on a free port)."""
    with served_example(EXAMPLE) as url:
        yield url


@pytest.fixture(scope="module")
def server(example_url: str) -> Iterator[ChatmemUp]:
    with example_up(example_url) as up:
        yield up


def _ready(page: Page) -> None:
    page.wait_for_selector("main[data-status=ready]", timeout=30_000)


def test_send_stop_reload_resume_and_approve(browser: Browser, server: ChatmemUp, example_url: str) -> None:
    context = browser.new_context()
    page = context.new_page()
    requests: list[str] = []
    errors: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(f"{example_url}/?api={server.base_url}&token={server.token}")
        page.wait_for_selector("main[data-status=ready]", timeout=20_000)
        chat_id = str(page.evaluate("location.hash")).removeprefix("#chat=")

        # Send: the reply streams in, with the memories of the reply.
        example_send(page, "hello from the example")
        page.wait_for_function("() => document.querySelector('main').dataset.status === 'streaming'")
        _ready(page)
        assert "hello from the example" in example_reply_text(page)
        expect_ui(page.locator(".message.assistant .memories").last).to_contain_text("memor")
        assert stored_chat_reply(server, chat_id)["metadata"]["status"] == "completed"

        # Stop: what the page shows is what was stored.
        example_send(page, "/long a long story")
        page.wait_for_function(
            "() => [...document.querySelectorAll('.message.assistant')].at(-1)?.textContent.length > 60"
            " && document.querySelectorAll('.message.assistant').length === 2"
        )
        page.click("#stop")
        _ready(page)
        stopped = stored_chat_reply(server, chat_id)
        assert stopped["metadata"]["status"] == "interrupted_by_user"
        assert example_reply_text(page) == stored_text(stopped)

        # Reload mid-reply: the page loads the history and resumes the stream to its end.
        example_send(page, "/long another story")
        page.wait_for_function(
            "() => document.querySelectorAll('.message.assistant').length === 3"
            " && [...document.querySelectorAll('.message.assistant')].at(-1).textContent.length > 60"
        )
        page.reload()
        page.wait_for_function("() => document.querySelector('main')?.dataset.status === 'streaming'")
        _ready(page)
        resumed = stored_chat_reply(server, chat_id)
        assert resumed["metadata"]["status"] == "completed"
        assert example_reply_text(page) == stored_text(resumed)
        assert page.locator(".message.assistant").count() == 3

        # Approve: the waiting call runs, and the same reply answers.
        example_send(page, ASK)
        waiting = page.locator(".tool[data-state=approval-requested]")
        expect_ui(waiting).to_be_visible(timeout=20_000)
        waiting.locator(".approve").click()
        done = page.locator(".message.assistant").last.locator(".tool[data-state=output-available]")
        expect_ui(done).to_be_visible(timeout=20_000)
        expect_ui(done.locator(".output")).to_contain_text("carol")
        _ready(page)
        assert "The tool answered" in example_reply_text(page)
        assert stored_chat_reply(server, chat_id)["metadata"]["status"] == "completed"
    finally:
        context.close()
    outside = [u for u in requests if not u.startswith((example_url, server.base_url, "data:"))]
    assert outside == [], f"requests to other hosts: {outside}"
    assert errors == [], f"page errors: {errors}"


def test_a_long_chat_shows_its_newest_messages_and_loads_the_earlier_ones(
    browser: Browser, server: ChatmemUp, example_url: str
) -> None:
    """The page loaded a chat's every message at once (1.45 MB at 5,000 turns); it loads the
    newest page, and the earlier ones when asked, across origins (the cursor is a header)."""
    count = 150
    with server.client() as api:
        chat = api.post("/v1/conversations", json={}).json()["id"]  # a conversation id is a chat id
        turns = [{"role": ("user", "assistant")[i % 2], "content": f"message {i}"} for i in range(count)]
        api.post(f"/v1/conversations/{chat}/import", json={"turns": turns}).raise_for_status()
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(f"{example_url}/?api={server.base_url}&token={server.token}#chat={chat}")
        _ready(page)
        shown = page.locator("#messages > li")
        expect_ui(shown).to_have_count(100)
        expect_ui(shown.first).to_have_text("message 50")
        page.click("#earlier")
        expect_ui(shown).to_have_count(count)
        expect_ui(shown.first).to_have_text("message 0")
        expect_ui(shown.last).to_have_text(f"message {count - 1}")
        expect_ui(page.locator("#earlier")).to_have_count(0)  # nothing earlier left
    finally:
        context.close()
    assert errors == [], f"page errors: {errors}"
