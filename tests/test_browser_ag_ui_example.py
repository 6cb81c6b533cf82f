"""examples/ag-ui-assistant-ui (assistant-ui's AG-UI runtime) in headless Chromium against `chatmem up`.

The example is bundled and served by its own pinned esbuild on another origin (so
CORS_ORIGINS is part of what is tested); the page talks to chatmem only through
`@ag-ui/client`'s HttpAgent, driven by `@assistant-ui/react-ag-ui`, and the stop endpoint:
send, stop, approve and deny an interrupt. That runtime brings its own pre-1.0
`@ag-ui/client`, so this is also the door's test with a client that does not speak 1.0.
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

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ag-ui-assistant-ui"
NODE = shutil.which("node")

_missing = browser_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)
if NODE is None:
    pytest.skip("node is not installed", allow_module_level=True)

from playwright.sync_api import Browser, Page  # noqa: E402
from playwright.sync_api import expect as expect_ui  # noqa: E402


@pytest.fixture(scope="module")
def example_url() -> Iterator[str]:
    """The example, bundled and served by esbuild (what `npm run serve` does, on a free port)."""
    with served_example(EXAMPLE) as url:
        yield url


@pytest.fixture(scope="module")
def server(example_url: str) -> Iterator[ChatmemUp]:
    with example_up(example_url) as up:
        yield up


def _settled(page: Page) -> None:
    page.wait_for_selector("main[data-status=ready], main[data-status=waiting]", timeout=30_000)


def test_send_stop_approve_and_deny(browser: Browser, server: ChatmemUp, example_url: str) -> None:
    context = browser.new_context()
    page = context.new_page()
    requests: list[str] = []
    errors: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(f"{example_url}/?api={server.base_url}&token={server.token}")
        page.wait_for_selector("main[data-status=ready]", timeout=20_000)
        thread_id = str(page.evaluate("location.hash")).removeprefix("#thread=")

        # Send: the reply streams in, with the memories recalled for it.
        example_send(page, "hello from assistant-ui")
        page.wait_for_function("() => document.querySelector('main').dataset.status === 'streaming'")
        _settled(page)
        assert "hello from assistant-ui" in example_reply_text(page)
        expect_ui(page.locator(".memories")).to_contain_text("memor")
        stored = stored_chat_reply(server, thread_id)
        assert stored["metadata"]["status"] == "completed"
        assert example_reply_text(page) == stored_text(stored)

        # Stop: the run ends, and what the page shows is what was stored.
        example_send(page, "/long a long story")
        page.wait_for_function(
            "() => document.querySelectorAll('.message.assistant').length === 2"
            " && [...document.querySelectorAll('.message.assistant')].at(-1).textContent.length > 60"
        )
        page.click("#stop")
        _settled(page)
        stopped = stored_chat_reply(server, thread_id)
        assert stopped["metadata"]["status"] == "interrupted_by_user"
        assert example_reply_text(page) == stored_text(stopped)

        # Approve: the run ends with an interrupt; approved, the call runs and the reply goes on.
        example_send(page, '/tool transfer_funds {"amount": 3, "to": "carol"}')
        waiting = page.locator(".interrupts")
        expect_ui(waiting).to_contain_text("transfer_funds", timeout=20_000)
        waiting.locator(".approve").click()
        answered = page.locator(".message.assistant .tool[data-state=answered] .output").last
        expect_ui(answered).to_contain_text("carol", timeout=20_000)
        page.wait_for_function("() => document.querySelector('main').dataset.status === 'ready'")
        assert "The tool answered" in example_reply_text(page)
        assert stored_chat_reply(server, thread_id)["metadata"]["status"] == "completed"

        # Deny: the call never runs; the model is told, and says so.
        example_send(page, '/tool transfer_funds {"amount": 9, "to": "mallory"}')
        expect_ui(waiting).to_contain_text("mallory", timeout=20_000)
        waiting.locator(".deny").click()
        denied = page.locator(".message.assistant .tool[data-state=answered] .output").last
        expect_ui(denied).to_contain_text("did not approve", timeout=20_000)
        page.wait_for_function("() => document.querySelector('main').dataset.status === 'ready'")
        reply = stored_chat_reply(server, thread_id)
        assert reply["metadata"]["status"] == "completed"
        assert [p["state"] for p in reply["parts"] if p["type"] == "tool-transfer_funds"] == ["output-denied"]
    finally:
        context.close()
    outside = [u for u in requests if not u.startswith((example_url, server.base_url, "data:"))]
    assert outside == [], f"requests to other hosts: {outside}"
    assert errors == [], f"page errors: {errors}"
