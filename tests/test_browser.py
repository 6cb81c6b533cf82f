"""The chat page in Debian's headless Chromium, driven by Playwright, against a real `chatmem up`.

The demo model streams 10 words a second here, so there is time to stop or reload mid-reply.
Screenshots of the main states go to test-artifacts/browser/ (git-ignored).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from chat_api.providers.demo import FILLER, LABEL
from tests.browser_support import ChatmemUp, browser_missing

pytestmark = pytest.mark.browser

_missing = browser_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

from playwright.sync_api import Browser, Page, Route  # noqa: E402
from playwright.sync_api import expect as expect_ui  # noqa: E402

from tests.browser_support import (  # noqa: E402
    PHONE,
    PageWatch,
    last_reply_id,
    new_chat,
    new_page,
    open_chat,
    reply_text,
    send,
    shot,
    stored_turn,
    wait_finished,
)


def is_whole_demo_reply(text: str, user_text: str) -> bool:
    """The demo model's complete reply to `user_text`: its opening, then (after any quoted
    memories, which depend on what earlier tests stored) its closing words, once each."""
    opening = f"{LABEL} You said: “{user_text[:200]}”."
    closing = FILLER * (5 if "/long" in user_text else 1)
    return text.startswith(opening) and text.endswith(closing) and text.count(opening) == 1


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ChatmemUp]:
    with ChatmemUp(DEMO_TOKENS_PER_SECOND=10, CHECKPOINT_INTERVAL_MS=200) as up:
        yield up


# --- helpers -------------------------------------------------------------------------------


def wait_reply_text_longer_than(page: Page, chars: int, timeout: float = 20_000) -> None:
    page.wait_for_function(
        "n => { const r = [...document.querySelectorAll('.reply')].at(-1);"
        " return r && [...r.querySelectorAll('.content')].map(e => e.textContent).join('').length > n; }",
        arg=chars,
        timeout=timeout,
    )


def wait_stored_status(api: httpx.Client, turn_id: str, timeout: float = 60.0) -> dict[str, Any]:
    """Poll the stored turn until it has left `streaming` (bounded).

    Twice a second: the page and this client are one user, and polling five times a second
    through a 23-second reply used up the server's 120 requests a minute, so the next
    test's page got 429s (seen on a loaded machine).
    """
    deadline = time.monotonic() + timeout
    while True:
        turn = stored_turn(api, turn_id)
        if turn["status"] != "streaming":
            return turn
        assert time.monotonic() < deadline, f"turn {turn_id} still streaming after {timeout}s"
        time.sleep(0.5)


# --- tests ---------------------------------------------------------------------------------


def test_reply_streams_in_and_matches_the_stored_turn(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, _ = page
    open_chat(tab, server)
    conversation_id = new_chat(tab)
    send(tab, "Hello there, how are you?")
    wait_reply_text_longer_than(tab, 20)
    expect_ui(tab.locator(".reply").last.locator(".status-label")).to_have_text("Streaming…")
    expect_ui(tab.locator("#stop")).to_be_visible()
    first = reply_text(tab)
    wait_reply_text_longer_than(tab, len(first))  # it grows while the model generates
    shot(tab, "01-streaming")
    wait_finished(tab, "completed")
    expect_ui(tab.locator(".reply").last.locator(".status-label")).to_have_text("Completed")
    expect_ui(tab.locator("#stop")).to_be_hidden()
    expect_ui(tab.locator(".reply").last.locator(".model-label")).to_have_text("[demo model]")
    shown = reply_text(tab)
    assert is_whole_demo_reply(shown, "Hello there, how are you?")
    assert stored_turn(api, last_reply_id(tab))["content"] == shown
    # The untitled conversation is named after its first message, in the list too.
    expect_ui(tab.locator(f"[data-conversation-id='{conversation_id}']")).to_contain_text("Hello there")


def test_stop_mid_reply_keeps_the_partial_text_and_says_interrupted(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, _ = page
    open_chat(tab, server)
    new_chat(tab)
    send(tab, "/long tell me everything")
    wait_reply_text_longer_than(tab, 60)
    tab.click("#stop")
    wait_finished(tab, "interrupted_by_user")
    label = tab.locator(".reply").last.locator(".status-label")
    expect_ui(label).to_have_text("Interrupted — stopped by you")
    expect_ui(tab.locator("#stop")).to_be_hidden()
    shown = reply_text(tab)
    assert len(shown) > 60 and shown.startswith(f"{LABEL} You said: “/long tell me everything”.")
    assert not is_whole_demo_reply(shown, "/long tell me everything")  # it really stopped early
    turn = stored_turn(api, last_reply_id(tab))
    assert turn["status"] == "interrupted_by_user"
    assert turn["content"] == shown  # nothing the user saw is lost, nothing more was added
    shot(tab, "02-interrupted")
    # The history after a reload shows the same status and text.
    tab.reload()
    tab.wait_for_selector("body[data-ready=true]")
    expect_ui(tab.locator(".reply").last.locator(".status-label")).to_have_text(
        "Interrupted — stopped by you"
    )
    assert reply_text(tab) == shown
    # The memories panel opens beside the reply (whatever memory found for it).
    reply = tab.locator(".reply").last
    reply.locator(".memories-toggle").click()
    panel = reply.locator("aside.memories")
    expect_ui(panel).to_contain_text("Memories used")
    expect_ui(panel).not_to_contain_text("Loading")
    main_box, panel_box = reply.locator(".reply-main").bounding_box(), panel.bounding_box()
    assert main_box and panel_box and panel_box["x"] >= main_box["x"] + main_box["width"]
    expect_ui(reply.locator(".memories-toggle")).to_have_attribute("aria-expanded", "true")
    shot(tab, "09-memories-panel")


def test_reload_mid_reply_resumes_with_continuous_text(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, watch = page
    open_chat(tab, server)
    new_chat(tab)
    send(tab, "Please reload me halfway")
    wait_reply_text_longer_than(tab, 70)
    reply_id = last_reply_id(tab)
    before = reply_text(tab)
    assert stored_turn(api, reply_id)["status"] == "streaming"
    tab.reload()
    tab.wait_for_selector("body[data-ready=true]")
    # The same reply is still streaming on the reloaded page, drawn from its events.
    resumed = tab.locator(f".reply[data-reply-id='{reply_id}']")
    expect_ui(resumed).to_have_attribute("data-status", "streaming")
    expect_ui(tab.locator("#stop")).to_be_visible()
    wait_finished(tab, "completed")
    after = reply_text(tab)
    assert after.startswith(before)
    assert is_whole_demo_reply(after, "Please reload me halfway")
    assert stored_turn(api, reply_id)["content"] == after
    assert any(f"/v1/turns/{reply_id}/events?after=0" in url for url in watch.requests)


def test_cut_stream_resumes_after_the_last_event_seen(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    """The POST's stream ends early (as when the network drops); the page follows ?after=N."""
    tab, watch = page
    cut_after = 8

    def cut_stream(route: Route) -> None:
        # The real request, but only its first events reach the page.
        request = route.request
        kept: list[str] = []
        headers = {
            k: v for k, v in request.headers.items() if k.lower() in ("authorization", "idempotency-key")
        }
        with (
            httpx.Client(base_url=server.base_url, timeout=30) as client,
            client.stream(
                "POST",
                request.url,
                content=request.post_data,
                headers=headers | {"content-type": "application/json"},
            ) as response,
        ):
            for line in response.iter_lines():
                kept.append(line)
                if line == "" and sum(1 for k in kept if k.startswith("id:")) >= cut_after:
                    break
        route.fulfill(
            status=200, headers={"content-type": "text/event-stream"}, body="\r\n".join(kept) + "\r\n"
        )

    open_chat(tab, server)
    new_chat(tab)
    tab.route("**/messages", cut_stream)
    send(tab, "Cut my stream please")
    wait_finished(tab, "completed")
    shown = reply_text(tab)
    assert is_whole_demo_reply(shown, "Cut my stream please")
    assert stored_turn(api, last_reply_id(tab))["content"] == shown
    assert any(f"/events?after={cut_after}" in url for url in watch.requests)


def test_closing_the_tab_does_not_stop_the_reply(
    browser: Browser, server: ChatmemUp, api: httpx.Client
) -> None:
    tab, _ = new_page(browser, server)
    open_chat(tab, server)
    new_chat(tab)
    send(tab, "I will close the tab now")
    wait_reply_text_longer_than(tab, 40)
    reply_id = last_reply_id(tab)
    tab.context.close()
    turn = wait_stored_status(api, reply_id)
    assert turn["status"] == "completed"
    assert is_whole_demo_reply(turn["content"], "I will close the tab now")


def test_tool_call_and_result_are_shown_collapsed(page: tuple[Page, PageWatch], server: ChatmemUp) -> None:
    tab, _ = page
    open_chat(tab, server)
    new_chat(tab)
    send(tab, 'what time is it? /tool current_time {"timezone":"UTC"}')
    wait_finished(tab, "completed")
    call = tab.locator(".reply").last.locator("details.tool-call")
    expect_ui(call).to_have_count(1)
    expect_ui(call).not_to_have_attribute("open", "")
    expect_ui(call.locator(".tool-result")).to_be_hidden()
    expect_ui(call.locator("summary")).to_contain_text("current_time — succeeded")
    call.locator("summary").click()
    expect_ui(call.locator(".tool-arguments")).to_have_text('{"timezone":"UTC"}')
    expect_ui(call.locator(".tool-result")).to_contain_text('"timezone": "UTC"')
    assert "The tool answered" in reply_text(tab)  # the step after the tool streamed in too
    shot(tab, "03-tool-call-expanded")


def test_stop_while_tool_arguments_stream_shows_the_call_cut_off(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, _ = page
    open_chat(tab, server)
    new_chat(tab)
    padding = "x" * 240  # about 60 argument fragments: six seconds at 10 a second
    send(tab, f'/tool current_time {{"timezone": "UTC", "note": "{padding}"}}')
    call = tab.locator(".reply").last.locator("details.tool-call")
    expect_ui(call).to_have_attribute("data-state", "streaming")
    tab.wait_for_function(  # some of the arguments, not all: stop lands mid-JSON
        "() => { const a = document.querySelector('.reply:last-of-type .tool-arguments');"
        " return a && a.textContent.length > 16; }"
    )
    tab.click("#stop")
    wait_finished(tab, "interrupted_by_user")
    expect_ui(call).to_have_attribute("data-state", "cut_off")
    expect_ui(call.locator("summary")).to_contain_text("cut off — arguments incomplete")
    call.locator("summary").click()
    shown_arguments = call.locator(".tool-arguments").text_content() or ""
    stored = stored_turn(api, last_reply_id(tab))["tool_calls"][0]
    assert stored["state"] == "streaming" and stored["arguments"] == shown_arguments
    assert len(shown_arguments) > 16 and shown_arguments.startswith('{"timezone": "UTC"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(shown_arguments)  # really half a JSON document
    shot(tab, "04-tool-call-cut-off")


def test_markup_in_user_and_model_text_is_shown_as_text(
    page: tuple[Page, PageWatch], server: ChatmemUp
) -> None:
    tab, watch = page
    open_chat(tab, server)
    new_chat(tab)
    hostile = (
        "<img src=x onerror=alert(1)> <script>alert(2)</script> **bold** "
        "[bad](javascript:alert(3)) [good](https://example.org/a?b=1&c=2)"
    )
    send(tab, hostile)
    wait_finished(tab, "completed")
    messages = tab.locator("#messages")
    # The demo model echoes the text, so it comes back as model output too.
    expect_ui(messages.locator(".message.user .bubble")).to_contain_text("<img src=x onerror=alert(1)>")
    assert "<script>alert(2)</script>" in reply_text(tab)
    assert messages.locator("img").count() == 0
    assert messages.locator("script").count() == 0
    assert messages.locator("[onerror]").count() == 0
    assert messages.locator("a[href^='javascript']").count() == 0
    assert messages.locator("strong", has_text="bold").count() == 2  # user bubble and reply
    assert messages.locator("a[href='https://example.org/a?b=1&c=2']").count() == 2
    assert watch.dialogs == []


def test_message_while_streaming_follows_the_busy_policy(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    """The embedded default is on_busy=reject: the page says the message was not sent, and keeps it."""
    tab, _ = page
    open_chat(tab, server)
    conversation_id = new_chat(tab)
    send(tab, "/long first message")
    wait_reply_text_longer_than(tab, 30)
    send(tab, "second message")
    note = tab.locator(".message.user").last.locator(".message-note")
    expect_ui(note).to_contain_text("Not sent: a reply is still streaming")
    expect_ui(tab.locator("#composer-input")).to_have_value("second message")
    expect_ui(tab.locator(".reply").last.locator(".status-label")).to_have_text("Streaming…")
    turns = api.get(f"/v1/conversations/{conversation_id}/turns").json()["items"]
    assert [t["content"] for t in turns if t["role"] == "user"] == ["/long first message"]
    tab.click("#stop")
    wait_finished(tab, "interrupted_by_user")


def test_failed_turn_and_network_loss_are_shown_and_recovered(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, _ = page
    open_chat(tab, server)
    new_chat(tab)
    send(tab, "/fail please")
    wait_finished(tab, "failed")
    reply = tab.locator(".reply").last
    expect_ui(reply.locator(".status-label")).to_have_text("Failed")
    expect_ui(reply.locator(".reply-error")).to_contain_text("demo model failure")

    tab.context.set_offline(True)
    expect_ui(tab.locator("#banner")).to_contain_text("offline")
    send(tab, "sent while offline")
    expect_ui(tab.locator(".message.user").last.locator(".message-note")).to_contain_text(
        "Not sent: The server cannot be reached"
    )
    expect_ui(tab.locator("#composer-input")).to_have_value("sent while offline")
    shot(tab, "05-offline")
    tab.context.set_offline(False)
    expect_ui(tab.locator("#banner")).to_be_hidden()
    tab.press("#composer-input", "Enter")  # the kept text, sent again
    wait_finished(tab, "completed")
    assert is_whole_demo_reply(reply_text(tab), "sent while offline")


def test_page_asks_for_a_token_when_the_server_hands_none_out(browser: Browser, server: ChatmemUp) -> None:
    tab, _ = new_page(browser, server)
    # A server with a configured secret answers {"token": null}.
    tab.route(
        "**/ui/config",
        lambda route: route.fulfill(
            status=200, content_type="application/json", body=json.dumps({"token": None, "on_busy": "reject"})
        ),
    )
    try:
        tab.goto(server.base_url + "/")
        dialog = tab.locator("#token-dialog")
        expect_ui(dialog).to_be_visible()
        tab.fill("#token-input", "not-a-token")
        tab.press("#token-input", "Enter")
        expect_ui(tab.locator("#token-error")).to_contain_text("401")
        shot(tab, "06-token-prompt")
        tab.fill("#token-input", server.token)
        tab.press("#token-input", "Enter")
        tab.wait_for_selector("body[data-ready=true]")
        expect_ui(dialog).to_be_hidden()
        assert tab.evaluate("localStorage.getItem('chatmem.token')") == server.token
    finally:
        tab.context.close()


def test_rename_from_the_keyboard(page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client) -> None:
    tab, _ = page
    open_chat(tab, server)
    conversation_id = new_chat(tab)
    tab.focus("#rename")
    tab.keyboard.press("Enter")
    expect_ui(tab.locator("#rename-input")).to_be_focused()
    tab.keyboard.type("Trip to Lisbon")
    tab.keyboard.press("Enter")
    expect_ui(tab.locator("#chat-title")).to_have_text("Trip to Lisbon")
    expect_ui(tab.locator(f"[data-conversation-id='{conversation_id}']")).to_contain_text("Trip to Lisbon")
    assert api.get(f"/v1/conversations/{conversation_id}").json()["title"] == "Trip to Lisbon"


def test_phone_width_and_keyboard_only(browser: Browser, server: ChatmemUp) -> None:
    tab, watch = new_page(browser, server, PHONE)

    def tab_back_to(element_id: str) -> None:
        for _ in range(40):
            if tab.evaluate("document.activeElement.id") == element_id:
                return
            tab.keyboard.press("Shift+Tab")
        raise AssertionError(f"#{element_id} cannot be reached with the keyboard")

    try:
        open_chat(tab, server)
        expect_ui(tab.locator("#sidebar")).to_be_hidden()
        # Everything below is keys only: open the list, start a chat, send, stop.
        tab_back_to("toggle-sidebar")
        tab.keyboard.press("Enter")
        expect_ui(tab.locator("#sidebar")).to_be_visible()
        expect_ui(tab.locator("#new-chat")).to_be_focused()
        tab.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().left === 0")
        shot(tab, "07-phone-conversations")
        before = tab.evaluate("location.hash")
        tab.keyboard.press("Enter")
        tab.wait_for_function("h => location.hash !== h", arg=before)
        expect_ui(tab.locator("#sidebar")).to_be_hidden()
        expect_ui(tab.locator("#composer-input")).to_be_focused()
        tab.keyboard.type("/long typed on a phone")
        tab.keyboard.press("Enter")
        wait_reply_text_longer_than(tab, 40)
        shot(tab, "08-phone-streaming")
        tab.keyboard.press("Escape")  # stops the reply
        wait_finished(tab, "interrupted_by_user")
        width = tab.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"], f"page is {width}px wide on a {PHONE['width']}px screen"
        # The drawer closes with Escape and gives focus back.
        tab_back_to("toggle-sidebar")
        tab.keyboard.press("Enter")
        expect_ui(tab.locator("#sidebar")).to_be_visible()
        tab.keyboard.press("Escape")
        expect_ui(tab.locator("#sidebar")).to_be_hidden()
        expect_ui(tab.locator("#toggle-sidebar")).to_be_focused()
        assert watch.errors == []
    finally:
        tab.context.close()


def test_memories_used_for_a_question_about_an_earlier_conversation(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, _ = page
    open_chat(tab, server)
    earlier = new_chat(tab)
    send(tab, "My cat is called Miso and she loves sardines.")
    wait_finished(tab, "completed")
    deadline = time.monotonic() + 90
    while True:  # the indexer works asynchronously: wait until the earlier turns are in memory
        conversation = api.get(f"/v1/conversations/{earlier}").json()
        if conversation["indexed_seq"] >= conversation["turn_count"]:
            break
        assert time.monotonic() < deadline, "the earlier conversation was not indexed in 90s"
        time.sleep(0.5)
    new_chat(tab)
    send(tab, "What is my cat called?")
    wait_finished(tab, "completed")
    toggle = tab.locator(".reply").last.locator(".memories-toggle")
    expect_ui(toggle).to_have_text(re.compile(r"Memories \([1-9]\d*\)"), timeout=2_000)
    toggle.click()
    panel = tab.locator(".reply").last.locator("aside.memories")
    expect_ui(panel).to_be_visible()
    expect_ui(panel).to_contain_text("Miso")
    shot(tab, "09-memories")


def test_images_and_files_sent_through_the_responses_api_are_shown(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, watch = page
    pixel = (
        "data:image/png;base64,"
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    )
    content = [
        {"type": "input_text", "text": "what is in these?"},
        {"type": "input_image", "image_url": pixel},
        {
            "type": "input_file",
            "filename": "notes.pdf",
            "file_data": "data:application/pdf;base64,JVBERi0xLjEK",
        },
    ]
    created = api.post(
        "/openai/v1/responses",
        json={"model": "chatmem-demo", "background": True, "input": [{"role": "user", "content": content}]},
    )
    assert created.status_code == 200, created.text
    open_chat(tab, server, created.headers["x-chatmem-conversation-id"])
    message = tab.locator(".message.user").first
    expect_ui(message.locator(".attachments img")).to_have_attribute("src", pixel)
    expect_ui(message.locator(".attachment-chip")).to_have_text("notes.pdf")
    assert api.post(f"/openai/v1/responses/{created.json()['id']}/cancel").status_code == 200
    assert watch.errors == []
