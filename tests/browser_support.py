"""A real `chatmem up` in a subprocess, Debian's headless Chromium, and the page steps the
browser tests share. Playwright is imported only inside functions: this module must import
where it is missing, so the tests can skip with the reason."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.conftest import free_port

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
INSTALL_SCRIPT = ROOT / "scripts" / "install-browser.sh"
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]
WIDE = {"width": 1280, "height": 860}
PHONE = {"width": 390, "height": 844}


def _has_playwright() -> bool:
    importlib.invalidate_caches()  # it may have been installed by this very process
    return importlib.util.find_spec("playwright") is not None


def browser_missing() -> str | None:
    """Why the browser tests cannot run here (after trying the install script), or None."""
    if not (CHROMIUM.exists() and _has_playwright()):
        subprocess.run(["bash", str(INSTALL_SCRIPT)], cwd=ROOT, check=False, timeout=900)
    if not CHROMIUM.exists():
        return "Debian's chromium is not installed and scripts/install-browser.sh could not install it"
    if not _has_playwright():
        return "the playwright package is not installed and could not be installed"
    return None


class ChatmemUp:
    """`chatmem up` on a free port with its own data directory; stopped with Ctrl-C (SIGINT)."""

    def __init__(self, **env: Any) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.data_dir = Path(tempfile.mkdtemp(prefix="chatmem-browser-"))
        self.log_path = self.data_dir / "server.log"
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "LOG_LEVEL": "WARNING",
            **{k.upper(): str(v) for k, v in env.items()},
        }
        for name in ("DATABASE_URL", "JWT_SECRET", "LLM_PROVIDER", "KAFKA_BOOTSTRAP_SERVERS"):
            self.env.pop(name, None)
        self.proc: subprocess.Popen[bytes] | None = None
        self.token = ""

    def start(self, timeout: float = 120.0) -> None:
        # `python -m chat_api.cli` is the `chatmem` console script, without needing it on PATH.
        command = [sys.executable, "-m", "chat_api.cli", "up"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--data-dir", str(self.data_dir)]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.base_url, timeout=5) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"chatmem up exited early:\n{self.log()[-3000:]}")
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chatmem up not ready in {timeout}s:\n{self.log()[-3000:]}")
                time.sleep(0.2)
            self.token = client.get("/ui/config").json()["token"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """Ctrl-C, as a person would: the embedded Postgres is stopped by the process itself."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> ChatmemUp:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def client(self) -> httpx.Client:
        """The API as the page's user (the embedded installation's token)."""
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30
        )


# --- the browser and its pages ----------------------------------------------------------------


@contextmanager
def served_example(example: Path) -> Iterator[str]:
    """An example page bundled and served by its own pinned esbuild (its `npm run serve`), on a free port."""
    esbuild = example / "node_modules" / ".bin" / "esbuild"
    assert esbuild.exists(), f"run `npm ci` in {example.relative_to(ROOT)} (make js-deps)"
    port = free_port()
    command = [str(esbuild), "src/main.jsx", "--bundle", "--jsx=automatic", "--outfile=public/app.js"]
    command += ["--servedir=public", f"--serve=127.0.0.1:{port}", "--log-level=warning"]
    # esbuild's server stops when its stdin closes: a pipe held open keeps it serving.
    proc = subprocess.Popen(command, cwd=example, stdin=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/app.js", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the example's esbuild server did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def example_up(example_url: str) -> ChatmemUp:
    """`chatmem up` as an example page needs it: the page's origin allowed, `transfer_funds`
    waiting for approval, and replies slow enough to stop mid-way."""
    return ChatmemUp(
        CORS_ORIGINS=f'["{example_url}"]',
        TOOL_MODULES='["tests.approval_tools"]',
        TOOLS_REQUIRING_APPROVAL='["transfer_funds"]',
        DEMO_TOKENS_PER_SECOND=40,
    )


@contextmanager
def launch_chromium() -> Iterator[Browser]:
    """Debian's Chromium, headless, through Playwright."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


class PageWatch:
    """What the page did besides rendering: requests, dialogs, script errors."""

    def __init__(self, page: Page) -> None:
        self.requests: list[str] = []
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        page.on("request", lambda request: self.requests.append(request.url))
        page.on("dialog", self._on_dialog)
        page.on("pageerror", lambda error: self.errors.append(str(error)))

    def _on_dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()


def new_page(browser: Browser, server: ChatmemUp, viewport: dict[str, int] = WIDE) -> tuple[Page, PageWatch]:
    """A page in a fresh browser context (its own storage), watched."""
    context = browser.new_context(viewport=viewport)  # type: ignore[arg-type]
    page = context.new_page()
    return page, PageWatch(page)


@contextmanager
def watched_page(browser: Browser, server: ChatmemUp) -> Iterator[tuple[Page, PageWatch]]:
    """A page that, at the end, must have fetched nothing from another host and had no script error."""
    opened, watch = new_page(browser, server)
    try:
        yield opened, watch
        outside = [url for url in watch.requests if not url.startswith((server.base_url, "data:"))]
        assert outside == [], f"requests to other hosts: {outside}"
        assert watch.errors == [], f"page errors: {watch.errors}"
    finally:
        opened.context.close()


def open_chat(page: Page, server: ChatmemUp, conversation_id: str | None = None) -> None:
    """Load the page (optionally on a conversation) and wait until it has started."""
    page.goto(server.base_url + (f"/#/c/{conversation_id}" if conversation_id else "/"))
    page.wait_for_selector("body[data-ready=true]", timeout=20_000)


def new_chat(page: Page) -> str:
    """Start a new conversation with the button; its id."""
    before = page.evaluate("location.hash")
    page.click("#new-chat")
    page.wait_for_function("h => location.hash !== h && location.hash.startsWith('#/c/')", arg=before)
    conversation_id = str(page.evaluate("location.hash.slice(4)"))
    page.wait_for_selector(f"body[data-conversation='{conversation_id}']")
    return conversation_id


def send(page: Page, text: str) -> None:
    page.fill("#composer-input", text)
    page.press("#composer-input", "Enter")


def reply_text(page: Page, index: int = -1) -> str:
    """The reply's visible text (every step), exactly as rendered."""
    return str(
        page.evaluate(
            "i => { const r = [...document.querySelectorAll('.reply')].at(i);"
            " return r ? [...r.querySelectorAll('.content')].map(e => e.textContent).join('') : ''; }",
            index,
        )
    )


def rendered_text(page: Page, text: str) -> str:
    """What the page shows for a text it renders as Markdown: its visible characters (a fence's
    ```` ```json ```` line, the ``**`` of bold, a list's ``- `` are markup, not text)."""
    return str(
        page.evaluate("async t => (await import('/static/markdown.js')).renderMarkdown(t).textContent", text)
    )


def last_reply_id(page: Page) -> str:
    """The id of the last reply on the page (its first assistant turn)."""
    return str(page.locator(".reply").last.get_attribute("data-reply-id"))


def wait_finished(page: Page, status: str, timeout: float = 40_000) -> None:
    page.wait_for_selector(f".reply:last-of-type[data-status={status}]", timeout=timeout)


def stored_turn(api: httpx.Client, turn_id: str) -> dict[str, Any]:
    response = api.get(f"/v1/turns/{turn_id}")
    response.raise_for_status()
    return dict(response.json())


def shot(page: Page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=False)


# --- the example pages (examples/*: a frontend library's own page on chatmem) -----------------


def example_send(page: Page, text: str) -> None:
    page.fill("#composer", text)
    page.press("#composer", "Enter")


def example_reply_text(page: Page) -> str:
    """The last assistant message's text, exactly as an example page renders it."""
    return str(
        page.evaluate(
            "() => { const m = [...document.querySelectorAll('.message.assistant')].at(-1);"
            " return m ? [...m.querySelectorAll('.text')].map(e => e.textContent).join('') : ''; }"
        )
    )


def stored_chat_reply(server: ChatmemUp, chat_id: str) -> dict[str, Any]:
    """chatmem's own record of a chat's (or AG-UI thread's) last message, with its stored status."""
    with server.client() as api:
        response = api.get(f"/v1/ai-sdk/chat/{chat_id}/messages")
        response.raise_for_status()
        return dict(response.json()[-1])


def stored_text(reply: dict[str, Any]) -> str:
    return "".join(p["text"] for p in reply["parts"] if p["type"] == "text")


# --- fixtures shared by the browser test modules (each defines its own `server`) -------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launch_chromium() as chromium:
        yield chromium


@pytest.fixture
def api(server: ChatmemUp) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture
def page(browser: Browser, server: ChatmemUp) -> Iterator[tuple[Page, PageWatch]]:
    with watched_page(browser, server) as opened:
        yield opened
