"""The chat page, unchanged, on a real model: `chatmem up` pointed at the session's llama-server
(tests/real_model.py), driven in headless Chromium. Send, a tool call, stop; the assertions are
about what the page shows against what is stored, never the model's wording."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.browser_support import ChatmemUp, browser_missing
from tests.real_model import MAX_TOKENS, RealModel

pytestmark = [pytest.mark.browser, pytest.mark.real_model]

_missing = browser_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

from playwright.sync_api import Page  # noqa: E402
from playwright.sync_api import expect as expect_ui  # noqa: E402

from tests.browser_support import (  # noqa: E402
    PageWatch,
    last_reply_id,
    new_chat,
    open_chat,
    rendered_text,
    reply_text,
    send,
    shot,
    stored_turn,
    wait_finished,
)

REPLY_MS = 180_000  # a bound for one real reply on a shared 2-core machine


@pytest.fixture(scope="module")
def server(real_model: RealModel) -> Iterator[ChatmemUp]:
    up = ChatmemUp(
        LLM_BASE_URL=real_model.base_url,
        LLM_MODEL=real_model.model,
        LLM_API_KEY=real_model.api_key,
        LLM_TIMEOUT_SECONDS=180,
        # As `chatmem local-model` sets it for a small model: offered `recall_memory`, the 0.5B
        # model called it twice on "count to 200", the repeat ended the loop, and no text came.
        MEMORY_TOOL="off",
    )
    up.env["LLM_PROVIDER"] = "openai"  # ChatmemUp clears it from the inherited environment
    try:
        up.start()
        yield up
    finally:
        up.stop()


def reply_steps(api: httpx.Client, page: Page) -> list[dict[str, Any]]:
    """The stored assistant turns of the page's last reply (one per model step), in order."""
    conversation_id = page.url.rsplit("/c/", 1)[1]
    response = api.get(f"/v1/conversations/{conversation_id}/turns")
    response.raise_for_status()
    reply_id = last_reply_id(page)
    return [t for t in response.json()["items"] if t["reply_id"] == reply_id and t["role"] == "assistant"]


def wait_server_idle(real_model: RealModel, within: float = 10.0) -> dict[str, object]:
    """llama-server's own slot, once it stopped generating (bounded)."""
    deadline = time.monotonic() + within
    while True:
        slot = httpx.get(f"{real_model.root}/slots", headers=real_model.headers, timeout=10).json()[0]
        if not slot["is_processing"]:
            return dict(slot)
        assert time.monotonic() < deadline, "llama-server still generates after the stop"
        time.sleep(0.1)


def test_send_tool_call_and_stop_on_the_real_model(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client, real_model: RealModel
) -> None:
    tab, _ = page
    open_chat(tab, server)
    new_chat(tab)

    send(tab, "Say hello in one short sentence.")
    wait_finished(tab, "completed", timeout=REPLY_MS)
    shown = reply_text(tab)
    assert shown.strip()
    assert stored_turn(api, last_reply_id(tab))["status"] == "completed"

    # In a fresh chat: after an earlier reply this small model tends to write the call as bare JSON
    # without the ```json fence, which the server then returns as text (seen on the real model).
    new_chat(tab)
    send(tab, "What time is it in Europe/Paris right now? Call the current_time tool.")
    call = tab.locator(".reply").last.locator("details.tool-call").first
    expect_ui(call.locator("summary")).to_contain_text("current_time — succeeded", timeout=REPLY_MS)
    if tab.locator("#stop").is_visible():  # the small model may call the tool again and again
        tab.click("#stop", timeout=5_000)
    tab.wait_for_selector(
        ".reply:last-of-type:is([data-status=interrupted_by_user], [data-status=completed])", timeout=REPLY_MS
    )
    stored = stored_turn(api, last_reply_id(tab))
    assert stored["tool_calls"][0]["name"] == "current_time"
    assert stored["tool_calls"][0]["state"] == "succeeded"
    shot(tab, "real-model-tool-call")

    # A fresh chat again, so the count does not follow the tool call above in the history.
    new_chat(tab)
    send(tab, "Count from 1 to 200, separated by commas. Do not call any tool.")
    # Text on the page, or the reply already over (then there is nothing to stop: said plainly).
    tab.wait_for_function(
        "() => { const r = [...document.querySelectorAll('.reply')].at(-1);"
        " return r && (r.dataset.status !== 'streaming'"
        " || [...r.querySelectorAll('.content')].map(e => e.textContent).join('').length > 8); }",
        timeout=REPLY_MS,
    )
    if (status := tab.locator(".reply").last.get_attribute("data-status")) != "streaming":
        ended = [
            (s["status"], s["content"][:80], [c["name"] for c in s["tool_calls"]])
            for s in reply_steps(api, tab)
        ]
        pytest.fail(f"the reply ended ({status}) before it showed text to stop; its steps: {ended}")
    tab.click("#stop")
    wait_finished(tab, "interrupted_by_user", timeout=30_000)
    shown = reply_text(tab)
    # The small model may spend a step on a tool call before it counts: the reply is every
    # step it took, the stopped one last.
    steps = reply_steps(api, tab)
    assert steps[-1]["status"] == "interrupted_by_user"
    # Each step is shown as Markdown: a fenced block the model wrote is shown without its fence
    # (compared raw, this failed whenever the small model wrote one).
    assert "".join(rendered_text(tab, step["content"]) for step in steps) == shown
    slot = wait_server_idle(real_model)
    decoded = slot["next_token"][0]["n_decoded"]  # type: ignore[index]
    assert decoded < MAX_TOKENS, "the real generation ran to its cap instead of stopping"
    shot(tab, "real-model-stopped")
