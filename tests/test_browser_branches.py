"""Versions of a conversation in the chat page (Regenerate, Edit, the ‹ n / m › switcher), in
Debian's headless Chromium against a real `chatmem up` with the demo model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.browser_support import ChatmemUp, browser_missing

pytestmark = pytest.mark.browser

_missing = browser_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

from playwright.sync_api import Locator, Page  # noqa: E402
from playwright.sync_api import expect as expect_ui  # noqa: E402

from tests.browser_support import (  # noqa: E402
    PageWatch,
    new_chat,
    open_chat,
    reply_text,
    send,
    shot,
    stored_turn,
    wait_finished,
)

# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ChatmemUp]:
    with ChatmemUp(DEMO_TOKENS_PER_SECOND=40, CHECKPOINT_INTERVAL_MS=200) as up:
        yield up


# --- helpers -------------------------------------------------------------------------------


def stored_turns(api: httpx.Client, conversation_id: str) -> list[dict[str, Any]]:
    response = api.get(f"/v1/conversations/{conversation_id}/turns")
    response.raise_for_status()
    return list(response.json()["items"])


def branches(api: httpx.Client, conversation_id: str) -> dict[str, Any]:
    response = api.get(f"/v1/conversations/{conversation_id}/branches")
    response.raise_for_status()
    return dict(response.json())


def context_ids(api: httpx.Client, conversation_id: str) -> list[str]:
    response = api.get(f"/v1/conversations/{conversation_id}/context")
    response.raise_for_status()
    return [str(i) for i in response.json()["window_turn_ids"]]


def ask(tab: Page, text: str) -> None:
    """Send a message and wait until its reply has completed."""
    replies = tab.locator(".reply").count()
    send(tab, text)
    expect_ui(tab.locator(".reply")).to_have_count(replies + 1)
    wait_finished(tab, "completed")


def switcher(scope: Locator) -> Locator:
    return scope.locator(".version-switcher")


def user_texts(tab: Page) -> list[str]:
    return [text.strip() for text in tab.locator(".message.user .bubble").all_inner_texts()]


def branch_buttons_disabled(tab: Page) -> list[bool]:
    """For every Edit / Save / switcher button shown, whether it is disabled."""
    return list(
        tab.evaluate(
            "() => [...document.querySelectorAll('[data-branch-action]:not(.regenerate)')]"
            ".filter(b => !b.hidden && b.offsetParent !== null).map(b => b.disabled)"
        )
    )


# --- tests ---------------------------------------------------------------------------------


def test_regenerate_gives_a_second_reply_and_the_switcher_goes_back_to_the_first(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, _ = page
    open_chat(tab, server)
    conversation_id = new_chat(tab)
    ask(tab, "tell me about otters")
    first_reply = tab.locator(".reply").last
    first_id = str(first_reply.get_attribute("data-reply-id"))
    first_text = reply_text(tab)
    assert stored_turn(api, first_id)["content"] == first_text
    expect_ui(switcher(first_reply)).to_have_count(0)  # one version only: no switcher

    first_reply.get_by_role("button", name="Regenerate this reply").click()
    expect_ui(tab.locator("#composer-input")).to_be_focused()  # the button pressed gives way
    # The new reply streams in where the old one was (which stays on its branch).
    tab.wait_for_function(
        "id => { const r = [...document.querySelectorAll('.reply')];"
        " return r.length === 1 && r[0].dataset.replyId !== id; }",
        arg=first_id,
    )
    wait_finished(tab, "completed")
    reply = tab.locator(".reply").last
    second_id = str(reply.get_attribute("data-reply-id"))
    assert second_id != first_id
    expect_ui(switcher(reply).locator(".version-position")).to_have_text("2 / 2")
    expect_ui(reply.get_by_role("button", name="Next version")).to_be_disabled()
    assert stored_turn(api, second_id)["content"] == reply_text(tab)
    listed = branches(api, conversation_id)
    assert len(listed["items"]) == 2 and listed["active_branch_id"] != conversation_id
    user_turn = stored_turns(api, conversation_id)[0]
    assert context_ids(api, conversation_id) == [user_turn["id"], second_id]
    shot(tab, "branches-01-regenerated")

    # Back to the first reply: the same text as its stored turn, and the server switched too.
    reply.get_by_role("button", name="Previous version").click()
    expect_ui(switcher(tab.locator(".reply").last).locator(".version-position")).to_have_text("1 / 2")
    reply = tab.locator(".reply").last
    assert reply.get_attribute("data-reply-id") == first_id
    assert reply_text(tab) == stored_turn(api, first_id)["content"] == first_text
    assert branches(api, conversation_id)["active_branch_id"] == conversation_id
    assert context_ids(api, conversation_id) == [user_turn["id"], first_id]
    # Regenerate sits on the last reply only, whichever version it is.
    expect_ui(tab.get_by_role("button", name="Regenerate this reply")).to_have_count(1)

    # Keyboard: focus stayed on the switcher (on › now that ‹ is at its end); Enter goes forward.
    focused = tab.evaluate("document.activeElement.getAttribute('aria-label')")
    assert focused == "Next version"
    tab.keyboard.press("Enter")
    expect_ui(switcher(tab.locator(".reply").last).locator(".version-position")).to_have_text("2 / 2")
    assert tab.locator(".reply").last.get_attribute("data-reply-id") == second_id
    assert branches(api, conversation_id)["active_branch_id"] != conversation_id
    assert tab.evaluate("document.activeElement.getAttribute('aria-label')") == "Previous version"


def test_edit_a_message_inline_replaces_what_follows_and_the_old_version_stays_reachable(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, watch = page
    open_chat(tab, server)
    conversation_id = new_chat(tab)
    ask(tab, "I live in Lyon")
    ask(tab, "recommend a bakery")
    original = stored_turns(api, conversation_id)
    second = tab.locator(".message.user").nth(1)

    # Escape cancels the editor: nothing is sent, focus goes back to Edit.
    second.get_by_role("button", name="Edit this message").click()
    editor = second.get_by_label("Edited message")
    expect_ui(editor).to_be_focused()
    expect_ui(editor).to_have_value("recommend a bakery")
    tab.keyboard.press("Escape")
    expect_ui(editor).to_have_count(0)
    expect_ui(second.get_by_role("button", name="Edit this message")).to_be_focused()
    assert [t["id"] for t in stored_turns(api, conversation_id)] == [t["id"] for t in original]

    # Keyboard only: Enter on Edit opens the editor, the text is replaced, Save sends it.
    tab.keyboard.press("Enter")
    expect_ui(editor).to_be_focused()
    editor.fill("recommend a bistro")
    second.get_by_role("button", name="Save").click()
    tab.wait_for_function(
        "() => [...document.querySelectorAll('.message.user .bubble')].map(b => b.textContent.trim())"
        ".join('|') === 'I live in Lyon|recommend a bistro'"
    )
    expect_ui(tab.locator("#composer-input")).to_be_focused()
    wait_finished(tab, "completed")
    expect_ui(tab.locator(".reply")).to_have_count(2)
    assert "recommend a bistro" in reply_text(tab)
    edited = stored_turns(api, conversation_id)
    assert [t["id"] for t in edited[:2]] == [t["id"] for t in original[:2]]
    assert edited[2]["content"] == "recommend a bistro" and edited[3]["content"] == reply_text(tab)
    edited_message = tab.locator(".message.user").nth(1)
    expect_ui(switcher(edited_message).locator(".version-position")).to_have_text("2 / 2")
    expect_ui(switcher(tab.locator(".message.user").first)).to_have_count(0)
    assert watch.dialogs == []  # no prompt(), no confirm()
    shot(tab, "branches-02-edited")

    # The old version is reachable through the switcher, with its own reply.
    edited_message.get_by_role("button", name="Previous version").click()
    position = switcher(tab.locator(".message.user").nth(1)).locator(".version-position")
    expect_ui(position).to_have_text("1 / 2")
    assert user_texts(tab) == ["I live in Lyon", "recommend a bakery"]
    assert reply_text(tab) == original[3]["content"]
    assert branches(api, conversation_id)["active_branch_id"] == conversation_id
    assert context_ids(api, conversation_id) == [t["id"] for t in original]

    # An empty text is not sent.
    tab.locator(".message.user").nth(1).get_by_role("button", name="Edit this message").click()
    tab.get_by_label("Edited message").fill("   ")
    tab.keyboard.press("Enter")
    expect_ui(tab.locator(".edit-form .message-note")).to_have_text("A message cannot be empty.")
    assert len(branches(api, conversation_id)["items"]) == 2
    tab.keyboard.press("Escape")

    # A switch that cannot reach the server is said, and the version shown stays as it was.
    tab.route("**/branches/*/activate", lambda route: route.abort())
    tab.locator(".message.user").nth(1).get_by_role("button", name="Next version").click()
    banner = tab.locator("#banner")
    expect_ui(banner).to_contain_text("Could not switch versions: The server cannot be reached")
    expect_ui(position).to_have_text("1 / 2")
    assert user_texts(tab) == ["I live in Lyon", "recommend a bakery"]
    assert branches(api, conversation_id)["active_branch_id"] == conversation_id


def test_version_actions_are_disabled_while_a_reply_streams_and_a_refusal_is_said(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, _ = page
    open_chat(tab, server)
    conversation_id = new_chat(tab)
    ask(tab, "hello")
    assert branch_buttons_disabled(tab) == [False]  # Edit on the message
    expect_ui(tab.get_by_role("button", name="Regenerate this reply")).to_be_enabled()

    # A reply the page streams: every version action waits for it.
    send(tab, "/long tell me everything")
    expect_ui(tab.locator(".reply").last.locator(".status-label")).to_have_text("Streaming…")
    tab.wait_for_function(
        "() => document.querySelectorAll('.message.user .edit-message:not([hidden])').length === 2"
    )
    assert branch_buttons_disabled(tab) == [True, True]
    expect_ui(tab.get_by_role("button", name="Regenerate this reply")).to_have_count(0)
    tab.click("#stop")
    wait_finished(tab, "interrupted_by_user")
    assert branch_buttons_disabled(tab) == [False, False]
    # An interrupted last reply can be regenerated too.
    expect_ui(tab.locator(".reply").last.get_by_role("button", name="Regenerate this reply")).to_be_enabled()

    # A reply started elsewhere, unknown to the page: the server refuses (409) and the page says
    # so, then shows the conversation as it is, the other reply streaming and actions disabled.
    with api.stream(
        "POST",
        f"/v1/conversations/{conversation_id}/messages",
        json={"content": "/long from another tab", "on_disconnect": "continue"},
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: turn.started"):
                break
    tab.locator(".reply").last.get_by_role("button", name="Regenerate this reply").click()
    expect_ui(tab.locator("#banner")).to_contain_text("Could not regenerate the reply: a reply is streaming")
    expect_ui(tab.locator(".reply")).to_have_count(3)
    expect_ui(tab.locator(".reply").last.locator(".status-label")).to_have_text("Streaming…")
    assert branch_buttons_disabled(tab) == [True, True, True]
    assert len(branches(api, conversation_id)["items"]) == 1
    tab.click("#stop")
    wait_finished(tab, "interrupted_by_user")
    assert branch_buttons_disabled(tab) == [False, False, False]


def test_regenerate_in_a_fork_branches_the_fork_and_leaves_the_original_alone(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client
) -> None:
    tab, _ = page
    open_chat(tab, server)
    original_id = new_chat(tab)
    ask(tab, "tell me about seals")
    original = stored_turns(api, original_id)
    response = api.post(f"/v1/conversations/{original_id}/fork", json={"turn_id": original[1]["id"]})
    assert response.status_code == 201, response.text
    fork_id = response.json()["id"]
    tab.evaluate("id => { location.hash = `#/c/${id}`; }", fork_id)
    tab.wait_for_selector(f"body[data-conversation='{fork_id}']")
    expect_ui(tab.locator(".reply")).to_have_count(1)

    # The shared reply is regenerated in the fork (the page names the conversation).
    tab.get_by_role("button", name="Regenerate this reply").click()
    tab.wait_for_function(
        "id => { const r = document.querySelector('.reply'); return r && r.dataset.replyId !== id; }",
        arg=original[1]["id"],
    )
    wait_finished(tab, "completed")
    expect_ui(switcher(tab.locator(".reply").last).locator(".version-position")).to_have_text("2 / 2")
    assert len(branches(api, fork_id)["items"]) == 2
    assert len(branches(api, original_id)["items"]) == 1
    assert [t["id"] for t in stored_turns(api, original_id)] == [t["id"] for t in original]

    # ‹ shows the fork's first version again: the reply it shares with the original.
    tab.locator(".reply").last.get_by_role("button", name="Previous version").click()
    expect_ui(switcher(tab.locator(".reply").last).locator(".version-position")).to_have_text("1 / 2")
    assert tab.locator(".reply").last.get_attribute("data-reply-id") == original[1]["id"]
    assert branches(api, fork_id)["active_branch_id"] == fork_id
