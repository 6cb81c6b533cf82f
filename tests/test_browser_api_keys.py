"""The chat page shows how to use chatmem from other apps and makes an API key that works, in
Debian's headless Chromium against a real `chatmem up`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from tests.browser_support import ChatmemUp, browser_missing

pytestmark = pytest.mark.browser

_missing = browser_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

from playwright.sync_api import Page  # noqa: E402
from playwright.sync_api import expect as expect_ui  # noqa: E402

from tests.browser_support import PageWatch, open_chat  # noqa: E402


@pytest.fixture(scope="module")
def server() -> Iterator[ChatmemUp]:
    with ChatmemUp() as up:
        yield up


def test_the_page_makes_an_api_key_an_openai_client_can_use(
    page: tuple[Page, PageWatch], server: ChatmemUp
) -> None:
    tab, _ = page
    open_chat(tab, server)
    tab.click("#api-keys summary")
    expect_ui(tab.locator("#openai-base-url")).to_have_text(f"{server.base_url}/openai/v1")
    tab.click("#create-key")
    field = tab.locator("#new-key")
    expect_ui(field).to_be_visible()
    key = field.input_value()
    assert key.startswith("cmk_")
    expect_ui(tab.locator("#key-note")).to_contain_text("shown only once")
    client = OpenAI(base_url=f"{server.base_url}/openai/v1", api_key=key, max_retries=0)
    completion = client.chat.completions.create(
        model="chatmem-demo", messages=[{"role": "user", "content": "hello from a key"}]
    )
    assert "hello from a key" in (completion.choices[0].message.content or "")
