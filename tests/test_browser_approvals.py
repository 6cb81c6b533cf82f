"""Tool calls that wait for a person, in the chat page, in Debian's headless Chromium.

A real `chatmem up` loads `tests.approval_tools` (TOOL_MODULES) and makes `transfer_funds`
wait for approval (TOOLS_REQUIRING_APPROVAL); each run of the tool appends a line, with the
turn that ran it, to APPROVAL_TOOL_LOG, so a test counts the runs of its own call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser_support import ChatmemUp, browser_missing

pytestmark = pytest.mark.browser

_missing = browser_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

from playwright.sync_api import Browser, Locator, Page  # noqa: E402
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
    watched_page,
)

ASK = '/tool transfer_funds {"amount": 5, "to": "bob"}'
ARGUMENTS = '{"amount": 5, "to": "bob"}'


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("approvals") / "runs.jsonl"


def approval_server(runs_log: Path, **settings: Any) -> ChatmemUp:
    return ChatmemUp(
        TOOL_MODULES='["tests.approval_tools"]',
        TOOLS_REQUIRING_APPROVAL='["transfer_funds"]',
        APPROVAL_TOOL_LOG=str(runs_log),
        DEMO_TOKENS_PER_SECOND=40,
        **settings,
    )


@pytest.fixture(scope="module")
def server(runs_log: Path) -> Iterator[ChatmemUp]:
    with approval_server(runs_log) as up:
        yield up


@pytest.fixture(scope="module")
def timeout_server(runs_log: Path) -> Iterator[ChatmemUp]:
    """Silence counts as a rejection after 3 s, checked every 0.2 s."""
    timeouts = '{"transfer_funds": 3}'
    with approval_server(runs_log, TOOL_APPROVAL_TIMEOUTS=timeouts, APPROVAL_SWEEP_SECONDS=0.2) as up:
        yield up


# --- helpers -------------------------------------------------------------------------------


def waiting_card(tab: Page) -> Locator:
    """The last reply's tool call, once it shows that it waits for approval."""
    card = tab.locator(".reply").last.locator("details.tool-call")
    expect_ui(card).to_have_attribute("data-state", "awaiting_approval", timeout=30_000)
    return card


def approve_button(card: Locator) -> Locator:
    return card.get_by_role("button", name="Approve transfer_funds")


def reject_button(card: Locator) -> Locator:
    return card.get_by_role("button", name="Reject transfer_funds")


def turns(api: httpx.Client, conversation_id: str) -> list[dict[str, Any]]:
    response = api.get(f"/v1/conversations/{conversation_id}/turns")
    response.raise_for_status()
    return list(response.json()["items"])


def parked_turn(api: httpx.Client, conversation_id: str) -> dict[str, Any]:
    [turn] = [t for t in turns(api, conversation_id) if t["status"] == "awaiting_approval"]
    return turn


def runs_of(runs_log: Path, turn_id: str) -> list[dict[str, Any]]:
    """The arguments of every run of transfer_funds for this turn."""
    if not runs_log.exists():
        return []
    lines = [json.loads(line) for line in runs_log.read_text().splitlines()]
    return [line["args"] for line in lines if line["turn_id"] == turn_id]


def expect_waiting_page(tab: Page, card: Locator) -> None:
    """Everything that says the reply waits: its status, the call's arguments and buttons, the composer."""
    reply = tab.locator(".reply").last
    expect_ui(reply).to_have_attribute("data-status", "awaiting_approval")
    expect_ui(reply.locator(".status-label")).to_have_text("Waiting for your approval")
    expect_ui(card).to_have_attribute("open", "")
    expect_ui(card.locator(".tool-arguments")).to_have_text(ARGUMENTS)  # complete
    expect_ui(card.locator("summary")).to_contain_text("transfer_funds — waiting for your approval")
    expect_ui(approve_button(card)).to_be_enabled()
    expect_ui(reject_button(card)).to_be_enabled()
    expect_ui(tab.locator("#composer-status")).to_contain_text("waits for your approval")
    expect_ui(tab.locator("#stop")).to_be_visible()


def expect_free_composer(tab: Page) -> None:
    expect_ui(tab.locator("#composer-status")).to_be_hidden()
    expect_ui(tab.locator("#stop")).to_be_hidden()


# --- tests ---------------------------------------------------------------------------------


def test_approve_from_the_keyboard_runs_the_tool_once_and_the_reply_completes(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client, runs_log: Path
) -> None:
    tab, watch = page
    open_chat(tab, server)
    conversation_id = new_chat(tab)
    send(tab, ASK)
    card = waiting_card(tab)
    expect_waiting_page(tab, card)
    # Focus is on the question, not on Approve: an Enter meant for the composer approves nothing.
    expect_ui(card.get_by_role("group")).to_be_focused()
    parked = parked_turn(api, conversation_id)
    assert parked["tool_calls"][0]["state"] == "awaiting_approval"
    assert runs_of(runs_log, parked["id"]) == []
    shot(tab, "10-approval-waiting")

    tab.keyboard.press("Tab")
    expect_ui(approve_button(card)).to_be_focused()
    tab.keyboard.press("Enter")
    wait_finished(tab, "completed")
    expect_ui(card).to_have_attribute("data-state", "succeeded")
    expect_ui(card.locator(".tool-decision")).to_have_text("Approved by you.")
    expect_ui(card.locator("summary")).to_contain_text("succeeded · approved by you")
    expect_ui(card.locator(".tool-result")).to_contain_text('"transferred": 5')
    expect_ui(card.get_by_role("button")).to_have_count(0)
    expect_free_composer(tab)
    shot(tab, "11-approval-approved")
    assert runs_of(runs_log, parked["id"]) == [{"amount": 5, "to": "bob"}]
    # The page shows exactly what was stored: the parked step and the one after the tool.
    stored = turns(api, conversation_id)
    assert [(t["role"], t["status"]) for t in stored] == [
        ("user", "completed"),
        ("assistant", "completed"),
        ("tool", "completed"),
        ("assistant", "completed"),
    ]
    call = stored[1]["tool_calls"][0]
    assert call["state"] == "succeeded" and call["approval"]["decision"] == "approved"
    shown = reply_text(tab)
    assert "The tool answered" in shown
    assert shown == "".join(t["content"] for t in stored if t["role"] == "assistant")
    assert tab.locator(".reply").count() == 1  # the rest streamed into the same reply
    assert any(f"/tool_calls/{call['id']}/approve" in url for url in watch.requests)
    # The conversation is free again.
    send(tab, "thanks")
    expect_ui(tab.locator(".reply")).to_have_count(2)
    wait_finished(tab, "completed")


def test_reject_with_a_reason_typed_inline_reaches_the_stored_tool_turn(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client, runs_log: Path
) -> None:
    tab, watch = page
    open_chat(tab, server)
    conversation_id = new_chat(tab)
    send(tab, ASK)
    card = waiting_card(tab)
    reject_button(card).click()
    reason = card.get_by_label("Reason")
    expect_ui(reason).to_be_focused()
    expect_ui(approve_button(card)).to_be_hidden()
    tab.keyboard.press("Escape")  # changed my mind: the form closes, focus goes back
    expect_ui(reason).to_be_hidden()
    expect_ui(reject_button(card)).to_be_focused()
    tab.keyboard.press("Enter")
    expect_ui(reason).to_be_focused()
    tab.keyboard.type("too much")
    shot(tab, "12-approval-reject-reason")
    tab.keyboard.press("Enter")
    wait_finished(tab, "completed")
    expect_ui(card).to_have_attribute("data-state", "rejected")
    expect_ui(card.locator(".tool-decision")).to_have_text("Rejected by you. Reason: too much")
    expect_ui(card.locator("summary")).to_contain_text("rejected · rejected by you")
    expect_free_composer(tab)
    assert "did not approve" in reply_text(tab)
    assert watch.dialogs == []  # the reason was asked inline, never with prompt()

    assistant, tool = turns(api, conversation_id)[1:3]
    assert assistant["tool_calls"][0]["approval"]["reason"] == "too much"
    assert assistant["tool_calls"][0]["approval"]["by"] == "user"
    refusal = {"error": "the user did not approve this tool call", "reason": "too much"}
    assert json.loads(tool["content"]) == refusal
    assert runs_of(runs_log, assistant["id"]) == []
    # Reloaded, the decided call says what was decided, from the stored turns.
    tab.reload()
    tab.wait_for_selector("body[data-ready=true]")
    card = tab.locator(".reply").last.locator("details.tool-call")
    expect_ui(card).to_have_attribute("data-state", "rejected")
    expect_ui(card.locator(".tool-decision")).to_have_text("Rejected by you. Reason: too much")
    expect_ui(card.get_by_role("button")).to_have_count(0)


def test_reload_shows_the_waiting_call_and_approving_there_finishes_the_reply(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client, runs_log: Path
) -> None:
    tab, watch = page
    open_chat(tab, server)
    conversation_id = new_chat(tab)
    send(tab, ASK)
    waiting_card(tab)
    tab.reload()
    tab.wait_for_selector(f"body[data-conversation='{conversation_id}']")
    card = waiting_card(tab)
    expect_waiting_page(tab, card)
    parked = parked_turn(api, conversation_id)
    # Drawn from the stored turns: no event stream is opened for a reply that waits.
    assert not any(f"/v1/turns/{parked['reply_id']}/events" in url for url in watch.requests)
    shot(tab, "13-approval-after-reload")

    # A new message meanwhile is refused (409 conversation_busy), and the page says why.
    send(tab, "are you still there?")
    note = tab.locator(".message.user").last.locator(".message-note")
    expect_ui(note).to_contain_text("Not sent: the reply above waits for your approval")
    expect_ui(tab.locator("#composer-input")).to_have_value("are you still there?")
    tab.fill("#composer-input", "")

    approve_button(card).click()
    wait_finished(tab, "completed")
    expect_ui(card).to_have_attribute("data-state", "succeeded")
    expect_free_composer(tab)
    assert runs_of(runs_log, parked["id"]) == [{"amount": 5, "to": "bob"}]
    stored = turns(api, conversation_id)
    assert reply_text(tab) == "".join(t["content"] for t in stored if t["role"] == "assistant")


def test_stop_ends_a_waiting_reply_live_and_after_a_reload(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client, runs_log: Path
) -> None:
    tab, _ = page
    open_chat(tab, server)
    conversation_id = new_chat(tab)
    for reload in (False, True):
        send(tab, ASK)
        card = waiting_card(tab)
        parked = parked_turn(api, conversation_id)
        if reload:
            tab.reload()
            tab.wait_for_selector(f"body[data-conversation='{conversation_id}']")
            card = waiting_card(tab)
        tab.click("#stop")
        wait_finished(tab, "interrupted_by_user")
        expect_ui(tab.locator(".reply").last.locator(".status-label")).to_have_text(
            "Interrupted — stopped by you"
        )
        expect_ui(card).to_have_attribute("data-state", "cancelled")
        expect_ui(card.get_by_role("button")).to_have_count(0)
        expect_free_composer(tab)
        turn = stored_turn(api, parked["id"])
        assert turn["status"] == "interrupted_by_user" and turn["interrupt_reason"] == "user"
        assert turn["tool_calls"][0]["state"] == "cancelled"
        assert runs_of(runs_log, parked["id"]) == []


def test_a_call_decided_elsewhere_says_so_and_shows_what_happened(
    page: tuple[Page, PageWatch], server: ChatmemUp, api: httpx.Client, runs_log: Path
) -> None:
    tab, _ = page
    open_chat(tab, server)
    conversation_id = new_chat(tab)
    send(tab, ASK)
    card = waiting_card(tab)
    parked = parked_turn(api, conversation_id)
    call_id = parked["tool_calls"][0]["id"]
    # Another tab (here: the API) approves first; the reply completes there.
    decided = api.post(f"/v1/turns/{parked['id']}/tool_calls/{call_id}/approve", json={"stream": False})
    assert decided.status_code == 200 and decided.json()["status"] == "completed", decided.text
    approve_button(card).click()  # 409 tool_call_not_awaiting_approval
    expect_ui(card.locator(".tool-problem")).to_contain_text("already decided elsewhere")
    # The page reads what happened: approved, ran, and the reply completed.
    wait_finished(tab, "completed")
    expect_ui(card).to_have_attribute("data-state", "succeeded")
    expect_ui(card.locator(".tool-decision")).to_have_text("Approved by you.")
    expect_free_composer(tab)
    assert runs_of(runs_log, parked["id"]) == [{"amount": 5, "to": "bob"}]
    stored = turns(api, conversation_id)
    assert reply_text(tab) == "".join(t["content"] for t in stored if t["role"] == "assistant")


def test_a_call_nobody_decides_in_time_shows_as_timed_out_without_a_reload(
    browser: Browser, timeout_server: ChatmemUp, runs_log: Path
) -> None:
    with watched_page(browser, timeout_server) as (tab, _), timeout_server.client() as api:
        open_chat(tab, timeout_server)
        conversation_id = new_chat(tab)
        send(tab, ASK)
        card = waiting_card(tab)
        expect_ui(card.locator(".approval-expiry")).to_contain_text("counts as rejected")
        # Nobody clicks: the server rejects the call and the reply goes on; the page sees it.
        wait_finished(tab, "completed", timeout=30_000)
        expect_ui(card).to_have_attribute("data-state", "rejected")
        expect_ui(card).to_have_attribute("data-decision", "timed_out")
        expect_ui(card.locator(".tool-decision")).to_contain_text("Timed out: nobody decided in time")
        expect_ui(card.locator("summary")).to_contain_text("rejected · timed out")
        expect_free_composer(tab)
        stored = turns(api, conversation_id)
        assert stored[1]["tool_calls"][0]["approval"]["by"] == "timeout"
        assert reply_text(tab) == "".join(t["content"] for t in stored if t["role"] == "assistant")
        assert runs_of(runs_log, stored[1]["id"]) == []
        # Reloaded, the stored turns say the same.
        tab.reload()
        tab.wait_for_selector("body[data-ready=true]")
        card = tab.locator(".reply").last.locator("details.tool-call")
        expect_ui(card).to_have_attribute("data-decision", "timed_out")
        expect_ui(card.locator(".tool-decision")).to_contain_text("Timed out: nobody decided in time")
