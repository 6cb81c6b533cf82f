"""What chatmem remembers, in the chat page: list, search, correct, forget, remember, and the
conversation's two switches, "Remember this chat" (write) and "Use memory in this chat" (read),
in Debian's headless Chromium against a real `chatmem up` (its in-process indexer and the real
embedding model)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.browser_support import PHONE, ChatmemUp, browser_missing

pytestmark = pytest.mark.browser

_missing = browser_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

from playwright.sync_api import Browser, Locator, Page  # noqa: E402
from playwright.sync_api import expect as expect_ui  # noqa: E402

from tests.browser_support import (  # noqa: E402
    PageWatch,
    last_reply_id,
    new_chat,
    new_page,
    open_chat,
    send,
    shot,
    wait_finished,
)
from tests.sse import parse_sse  # noqa: E402

FACT = "My sister Ingrid keeps honeybees in Reykjavik."
CORRECTED = "My sister Ingrid keeps honeybees in Tromsø."
STATED = "I am vegetarian."
OTHER_FACT = "My bicycle is a green Bianchi from 1998."
PETS = "I keep three ferrets called Ada, Bo and Cy."


@pytest.fixture(scope="module")
def server() -> Iterator[ChatmemUp]:
    # New chats open with the person's own statements (test_a_new_chat_opens_with_...).
    with ChatmemUp(DEMO_TOKENS_PER_SECOND=200, MEMORY_STANDING_TOKENS=300) as up:
        yield up


def wait_indexed(api: httpx.Client, conversation_id: str) -> None:
    deadline = time.monotonic() + 90
    while True:  # the indexer works asynchronously
        conversation = api.get(f"/v1/conversations/{conversation_id}").json()
        if conversation["indexed_seq"] >= conversation["turn_count"]:
            return
        assert time.monotonic() < deadline, "the conversation was not indexed in 90s"
        time.sleep(0.3)


def open_memory(tab: Page) -> None:
    tab.evaluate("document.getElementById('memory-dialog').dataset.loaded = ''")
    tab.click("#open-memory")
    expect_ui(tab.locator("#memory-dialog")).to_be_visible()
    tab.wait_for_selector("#memory-dialog[data-loaded=true]")


def item_saying(tab: Page, text: str) -> Locator:
    """The listed item whose text is exactly `text` (the demo model's replies quote it too)."""
    return tab.locator(".memory-item").filter(has=tab.get_by_text(text, exact=True))


def test_list_search_correct_forget_and_remember(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, _ = page
    open_chat(tab, server)
    conversation = new_chat(tab)
    send(tab, FACT)
    wait_finished(tab, "completed")
    wait_indexed(api, conversation)

    open_memory(tab)
    fact = item_saying(tab, FACT)
    expect_ui(fact).to_have_count(1)
    expect_ui(fact.locator(".memory-meta")).to_contain_text("in “")
    tab.fill("#memory-query", "Where are the honeybees?")
    tab.press("#memory-query", "Enter")
    expect_ui(tab.locator(".memory-item").first.locator(".memory-meta")).to_contain_text("relevance")
    best = tab.locator(".memory-item .memory-text").all_inner_texts()[:2]
    assert FACT in best, best  # the message, or the demo reply quoting it, then the message
    shot(tab, "memory-01-search")

    # Correct it: the stored item changes, the conversation's turn does not.
    fact = item_saying(tab, FACT)
    item_id = fact.get_attribute("data-item-id")
    fact.locator(".memory-edit").click()
    fact.locator("textarea").fill(CORRECTED)
    fact.locator(".memory-save").click()
    fact = tab.locator(f".memory-item[data-item-id='{item_id}']")
    expect_ui(fact.locator(".memory-text")).to_have_text(CORRECTED)
    expect_ui(fact.locator(".memory-meta")).to_contain_text("corrected")
    expect_ui(fact.locator(".memory-edit")).to_be_focused()
    assert api.get(f"/v1/memory/items/{item_id}").json()["text"] == CORRECTED
    turns = api.get(f"/v1/conversations/{conversation}/turns").json()["items"]
    assert turns[0]["content"] == FACT

    # Forget asks once more; "Keep" keeps it.
    fact.locator(".memory-forget").click()
    fact.locator(".memory-keep").click()
    assert api.get(f"/v1/memory/items/{item_id}").status_code == 200
    fact.locator(".memory-forget").click()
    fact.locator(".memory-forget-confirm").click()
    expect_ui(tab.locator(f".memory-item[data-item-id='{item_id}']")).to_have_count(0)
    expect_ui(tab.locator("#memory-status")).to_have_text("Forgotten.")
    assert api.get(f"/v1/memory/items/{item_id}").status_code == 404

    # Something the person tells chatmem directly.
    tab.click("#memory-clear")
    tab.fill("#memory-fact", STATED)
    tab.press("#memory-fact", "Enter")
    expect_ui(tab.locator(".memory-item").first.locator(".memory-text")).to_have_text(STATED)
    expect_ui(tab.locator(".memory-item").first.locator(".memory-meta")).to_contain_text("you told chatmem")
    listed = api.get("/v1/memory/items", params={"limit": 200}).json()["items"]
    texts = [i["text"] for i in listed]
    assert STATED in texts and CORRECTED not in texts
    shot(tab, "memory-02-list")
    tab.keyboard.press("Escape")
    expect_ui(tab.locator("#memory-dialog")).to_be_hidden()


def switch_and_saved(tab: Page, conversation: str, box: str, *, on: bool) -> dict[str, object]:
    """Flip a memory switch on the page; the body of the PATCH it sent (once saved)."""
    with tab.expect_request(
        lambda r: r.method == "PATCH" and r.url.endswith(f"/v1/conversations/{conversation}")
    ) as patched:
        tab.locator(box).set_checked(on)
    expect_ui(tab.locator(box)).to_be_enabled()  # the answer came back
    return dict(json.loads(patched.value.post_data or "{}"))


def recalled(api: httpx.Client, reply_id: str) -> list[list[str]]:
    """The texts of every `memory.retrieved` event in a reply's stored event log."""
    raw = api.get(f"/v1/turns/{reply_id}/events", params={"after": 0}).content
    return [
        [item["text"] for item in event.data["items"]]
        for event in parse_sse(raw)
        if event.event == "memory.retrieved"
    ]


def test_remember_this_chat_switch(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, _ = page
    open_chat(tab, server)
    conversation = new_chat(tab)
    switch = tab.locator("#remember-chat")
    expect_ui(switch).to_be_checked()
    expect_ui(switch).to_be_enabled()
    assert switch_and_saved(tab, conversation, "#remember-chat", on=False) == {"remember": False}
    stored = api.get(f"/v1/conversations/{conversation}").json()
    assert (stored["remember"], stored["memory_mode"], stored["use_memory"]) == (False, "none", True)
    send(tab, "Nobody should remember that I like liquorice.")
    wait_finished(tab, "completed")
    wait_indexed(api, conversation)
    assert api.get("/v1/memory/items", params={"conversation_id": conversation}).json()["items"] == []
    tab.reload()
    tab.wait_for_selector(f"body[data-conversation='{conversation}']")
    expect_ui(tab.locator("#remember-chat")).not_to_be_checked()
    expect_ui(tab.locator("#use-memory")).to_be_checked()  # the other switch is its own
    assert switch_and_saved(tab, conversation, "#remember-chat", on=True) == {"remember": True}
    assert api.get(f"/v1/conversations/{conversation}").json()["memory_mode"] == "persistent"


def test_use_memory_in_this_chat_switch(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    """Off: the chat's replies recall nothing (no search, no memory event), the chat is still
    remembered; on again: the next reply recalls what the person told chatmem."""
    assert api.post("/v1/memory/items", json={"text": OTHER_FACT}).status_code == 201
    tab, _ = page
    open_chat(tab, server)
    conversation = new_chat(tab)
    reading = tab.locator("#use-memory")
    expect_ui(reading).to_be_checked()
    expect_ui(reading).to_be_enabled()
    assert switch_and_saved(tab, conversation, "#use-memory", on=False) == {"use_memory": False}
    stored = api.get(f"/v1/conversations/{conversation}").json()
    assert (stored["use_memory"], stored["remember"]) == (False, True)

    send(tab, "Which bicycle do I ride?")
    wait_finished(tab, "completed")
    assert recalled(api, last_reply_id(tab)) == []
    tab.reload()
    tab.wait_for_selector(f"body[data-conversation='{conversation}']")
    expect_ui(tab.locator("#use-memory")).not_to_be_checked()
    expect_ui(tab.locator("#remember-chat")).to_be_checked()

    assert switch_and_saved(tab, conversation, "#use-memory", on=True) == {"use_memory": True}
    send(tab, "Which bicycle do I ride, again?")
    expect_ui(tab.locator(".reply")).to_have_count(2)  # the new reply, not the first one
    wait_finished(tab, "completed")
    (found,) = recalled(api, last_reply_id(tab))
    assert OTHER_FACT in found
    wait_indexed(api, conversation)  # remembered all along: both questions are memories
    items = api.get("/v1/memory/items", params={"conversation_id": conversation}).json()["items"]
    assert {"Which bicycle do I ride?", "Which bicycle do I ride, again?"} <= {i["text"] for i in items}


def test_a_new_chat_opens_with_what_you_said_about_yourself(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    """A new chat's first reply is given the person's own statements from earlier chats; its
    memories panel lists them apart from what recall found for the message."""
    tab, _ = page
    open_chat(tab, server)
    earlier = new_chat(tab)
    send(tab, PETS)
    wait_finished(tab, "completed")
    wait_indexed(api, earlier)
    new_chat(tab)
    send(tab, "Hello again.")
    wait_finished(tab, "completed")
    reply = tab.locator(".reply").last
    reply.locator(".memories-toggle").click()
    panel = reply.locator("aside.memories")
    expect_ui(panel).to_contain_text("About you, from earlier chats")
    expect_ui(panel.locator(".standing-items")).to_contain_text(PETS)
    expect_ui(panel.locator(".standing-items")).not_to_contain_text("score")
    shot(tab, "memory-04-standing")


def test_memory_view_fits_a_phone(browser: Browser, server: ChatmemUp) -> None:
    tab, watch = new_page(browser, server, PHONE)
    try:
        open_chat(tab, server)
        tab.click("#toggle-sidebar")
        open_memory(tab)
        shot(tab, "memory-03-phone")
        width = tab.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"], f"page is {width}px wide on a {PHONE['width']}px screen"
        tab.click("#memory-close")
        expect_ui(tab.locator("#memory-dialog")).to_be_hidden()
        assert watch.errors == []
    finally:
        tab.context.close()
