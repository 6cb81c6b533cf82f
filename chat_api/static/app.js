// chatmem's reference chat page. Plain ES modules, no build step, no outside requests.
//
// How a reply reaches the screen, in every case, through one path (ReplyView.apply):
//   - sending: POST /messages answers with the reply's SSE events;
//   - the connection drops mid-reply: GET /v1/turns/{reply}/events?after=<last id seen>;
//   - the page is reloaded mid-reply: the stored turns draw the history, and the reply still
//     streaming is drawn from GET …/events?after=0, which replays every event and then follows
//     live. Text is drawn only from events (never from the stored checkpoint, which may lag
//     the stream), so the reloaded reply has no duplicated and no missing text.
// The page never stops a reply by going away (on_disconnect=continue): only Stop does.

import { Api, ApiError, NetworkError } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { ReplyView } from "./reply_view.js";
import { Sidebar } from "./sidebar.js";

const api = new Api();
const $ = (id) => document.getElementById(id);
const ui = {
  messages: $("messages"),
  title: $("chat-title"),
  rename: $("rename"),
  renameForm: $("rename-form"),
  renameInput: $("rename-input"),
  composer: $("composer"),
  input: $("composer-input"),
  send: $("send"),
  stop: $("stop"),
  banner: $("banner"),
  notice: $("notice"),
  model: $("model-badge"),
  newChat: $("new-chat"),
  tokenDialog: $("token-dialog"),
  tokenForm: $("token-form"),
  tokenInput: $("token-input"),
  tokenError: $("token-error"),
};

const BUSY_NOTES = {
  reject: "A reply is still streaming; the server's policy is to refuse new messages until it ends.",
  interrupt: "A reply is still streaming; the server's policy stops it to answer this message.",
  enqueue: "Queued: the server will answer once the current reply has ended.",
};

// The open conversation. Replaced (and its streams aborted) when another one is opened.
let current = null;

function newConversationState(id) {
  return { id, conversation: null, views: new Map(), live: new Set(), aborter: new AbortController() };
}

// --- banner: connection and request errors, said plainly ---------------------------------

function showBanner(message) {
  ui.banner.textContent = message;
  ui.banner.hidden = false;
}

function clearBanner() {
  ui.banner.hidden = true;
  ui.banner.textContent = "";
}

function say(message) {
  ui.notice.textContent = message;
}

function describe(error) {
  if (error instanceof NetworkError) return "The server cannot be reached. Retrying when the network returns…";
  if (error instanceof ApiError) return `${error.message} (${error.status} ${error.code})`;
  return String(error.message || error);
}

/** Wait `ms`, or less if the browser says the network is back. */
function waitToRetry(ms, signal) {
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      window.removeEventListener("online", done);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    window.addEventListener("online", done);
    signal?.addEventListener("abort", done);
  });
}

// --- token ------------------------------------------------------------------------------

async function askForToken(reason) {
  ui.tokenError.textContent = reason || "";
  ui.tokenInput.value = "";
  if (!ui.tokenDialog.open) ui.tokenDialog.showModal();
  return new Promise((resolve) => {
    ui.tokenForm.onsubmit = async (event) => {
      event.preventDefault();
      api.rememberToken(ui.tokenInput.value.trim());
      try {
        await api.listConversations();
      } catch (error) {
        ui.tokenError.textContent = describe(error);
        if (error instanceof ApiError && error.status === 401) api.forgetToken();
        return;
      }
      ui.tokenDialog.close();
      resolve();
    };
  });
}

/** Run an API call; a 401 asks for a (new) token and tries once more. */
async function withAuth(call) {
  try {
    return await call();
  } catch (error) {
    if (!(error instanceof ApiError) || error.status !== 401) throw error;
    api.forgetToken();
    await askForToken("The token was refused. Paste a valid access token (`chatmem token`).");
    return call();
  }
}

// --- conversations ----------------------------------------------------------------------

const sidebar = new Sidebar(api, { onOpen: (id) => openConversation(id) });

async function openConversation(id) {
  current?.aborter.abort(); // leaving: stop reading its streams (the replies go on server-side)
  const state = newConversationState(id);
  current = state;
  sidebar.markCurrent(id);
  if (location.hash !== `#/c/${id}`) history.replaceState(null, "", `#/c/${id}`);
  ui.messages.replaceChildren();
  try {
    const [conversation, turns] = await withAuth(() =>
      Promise.all([api.getConversation(id), api.listTurns(id)]),
    );
    if (current !== state) return;
    state.conversation = conversation;
    showTitle(conversation.title);
    renderHistory(state, turns.items, conversation.active_reply_id);
    clearBanner();
  } catch (error) {
    if (current === state) showBanner(`Could not open the conversation: ${describe(error)}`);
    return;
  }
  updateStopButton();
  ui.input.focus();
  document.body.dataset.conversation = id; // loaded (tests wait on this)
}

function renderHistory(state, turns, activeReplyId) {
  for (const turn of turns) {
    if (turn.role === "user") {
      ui.messages.append(userMessage(turn.content).element);
      continue;
    }
    const replyId = turn.reply_id || turn.id;
    const live = replyId === activeReplyId || turn.status === "streaming";
    let view = state.views.get(replyId);
    if (!view) {
      view = addReplyView(state, replyId);
      if (live) followToEnd(state, view); // drawn from its events, from the first one
    }
    if (!state.live.has(view)) view.addStoredTurn(turn);
  }
  scrollToEnd();
}

function addReplyView(state, replyId) {
  const view = new ReplyView(replyId, { loadMemories: () => loadMemories(replyId) });
  state.views.set(replyId, view);
  ui.messages.append(view.element);
  return view;
}

/** The memory.retrieved payload of a finished reply: its events replay, then the stream ends. */
async function loadMemories(replyId) {
  let payload = { items: [] };
  await withAuth(() =>
    api.followReply(replyId, 0, (event) => {
      if (event.event === "memory.retrieved") payload = event.data;
    }),
  );
  return payload;
}

function showTitle(title) {
  ui.title.textContent = title || "Untitled";
  document.title = `${title || "Untitled"} — chatmem`;
}

async function createConversation() {
  sidebar.setOpen(false);
  try {
    const conversation = await withAuth(() => api.createConversation(""));
    await sidebar.refresh();
    await openConversation(conversation.id);
  } catch (error) {
    showBanner(`Could not create a conversation: ${describe(error)}`);
  }
}

// Rename: an inline form in the header; Enter saves, Escape cancels.
function startRename() {
  if (!current) return;
  ui.renameInput.value = current.conversation?.title || "";
  ui.renameForm.hidden = false;
  ui.title.hidden = true;
  ui.rename.hidden = true;
  ui.renameInput.focus();
  ui.renameInput.select();
}

function endRename() {
  ui.renameForm.hidden = true;
  ui.title.hidden = false;
  ui.rename.hidden = false;
  ui.rename.focus();
}

async function saveRename(state, title) {
  try {
    state.conversation = await withAuth(() => api.renameConversation(state.id, title));
    if (current === state) showTitle(state.conversation.title);
    await sidebar.refresh();
  } catch (error) {
    showBanner(`Could not rename: ${describe(error)}`);
  }
}

// --- messages and replies ---------------------------------------------------------------

function userMessage(text) {
  const element = document.createElement("div");
  element.className = "message user";
  const bubble = document.createElement("div");
  bubble.className = "bubble markdown";
  bubble.append(renderMarkdown(text));
  const note = document.createElement("p");
  note.className = "message-note";
  note.hidden = true;
  element.append(bubble, note);
  return {
    element,
    note(text, kind = "info") {
      note.hidden = !text;
      note.textContent = text || "";
      note.dataset.kind = kind;
    },
  };
}

async function sendMessage(text) {
  const state = current;
  const busy = state.live.size > 0;
  const message = userMessage(text);
  ui.messages.append(message.element);
  if (busy) message.note(BUSY_NOTES[api.config?.on_busy] || "A reply is still streaming…");
  scrollToEnd();
  const key = idempotencyKey();
  let view = null;
  const onEvent = (event) => {
    if (event.event === "turn.started" && !view) {
      message.note("");
      view = addReplyView(state, event.data.reply_id);
      state.live.add(view);
      updateStopButton();
      autoTitle(state, text);
    }
    view?.apply(event);
    scrollToEnd();
  };
  try {
    await withAuth(() => api.sendMessage(state.id, text, key, onEvent, state.aborter.signal));
  } catch (error) {
    if (error.name === "AbortError") return;
    if (!view) return notSent(message, text, error);
    // Started, then the stream broke: the reply goes on server-side; resume below.
  }
  if (view && !view.finished) await followToEnd(state, view);
  else afterReply(state, view);
}

function notSent(message, text, error) {
  if (error instanceof ApiError && error.code === "conversation_busy") {
    message.note("Not sent: a reply is still streaming (the server refuses new messages meanwhile). " +
      "Stop it or wait, then send again.", "error");
  } else {
    message.note(`Not sent: ${describe(error)}`, "error");
  }
  if (!ui.input.value) ui.input.value = text; // give the text back, nothing is lost
  say("Your message was not sent.");
}

/** Follow a reply's events to its end, reconnecting after the last event seen when cut off. */
async function followToEnd(state, view) {
  state.live.add(view);
  updateStopButton();
  let delay = 500;
  while (!view.finished && !state.aborter.signal.aborted) {
    try {
      await withAuth(() =>
        api.followReply(view.replyId, view.lastEventId, (event) => {
          view.apply(event);
          scrollToEnd();
        }, state.aborter.signal),
      );
      clearBanner();
      if (!view.finished) return reloadAfterUnknownEnd(state); // stream ended without an ending
    } catch (error) {
      if (error.name === "AbortError") return;
      if (!(error instanceof NetworkError)) {
        view.showError(describe(error));
        break;
      }
      showBanner("Connection lost. Reconnecting — the reply goes on and will resume where it was…");
      await waitToRetry(delay, state.aborter.signal);
      delay = Math.min(delay * 2, 8000);
    }
  }
  afterReply(state, view);
}

function afterReply(state, view) {
  if (view) state.live.delete(view);
  updateStopButton();
  if (current === state) sidebar.refresh().catch(() => {});
}

async function reloadAfterUnknownEnd(state) {
  // The server closed the stream without a terminal event (it could not store one): the
  // stored turns are the truth, so draw them again.
  if (current === state) await openConversation(state.id);
}

/** An untitled conversation is named after its first message (the person can rename it). */
async function autoTitle(state, text) {
  const title = text.replace(/\s+/g, " ").trim().slice(0, 60);
  if (!title || state.conversation?.title || state.titling) return;
  state.titling = true;
  await saveRename(state, title);
}

async function stopReply() {
  const view = [...(current?.live || [])].at(-1);
  if (!view) return;
  ui.stop.disabled = true;
  ui.stop.textContent = "Stopping…";
  try {
    await withAuth(() => api.stopReply(view.replyId));
    say("Reply stopped.");
  } catch (error) {
    showBanner(`Could not stop the reply: ${describe(error)}`);
  } finally {
    ui.stop.disabled = false;
    ui.stop.textContent = "Stop";
  }
}

function updateStopButton() {
  const streaming = (current?.live.size || 0) > 0;
  ui.stop.hidden = !streaming;
  ui.composer.dataset.streaming = String(streaming);
}

function scrollToEnd() {
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function idempotencyKey() {
  // crypto.randomUUID needs a secure context; a LAN address over http is not one.
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// --- wiring -----------------------------------------------------------------------------

function wire() {
  // The skip link moves focus itself: following its #fragment would replace the
  // conversation's address (#/c/<id>) and lose it on the next reload.
  document.querySelector(".skip-link").addEventListener("click", (event) => {
    event.preventDefault();
    ui.input.focus();
  });
  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = ui.input.value;
    if (!text.trim() || !current) return;
    ui.input.value = "";
    sendMessage(text);
  });
  ui.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      ui.composer.requestSubmit();
    } else if (event.key === "Escape" && !ui.stop.hidden) {
      event.preventDefault();
      stopReply();
    }
  });
  ui.stop.addEventListener("click", stopReply);
  ui.newChat.addEventListener("click", createConversation);
  ui.rename.addEventListener("click", startRename);
  ui.renameForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    endRename();
    if (current) await saveRename(current, ui.renameInput.value.trim());
  });
  ui.renameInput.addEventListener("keydown", (event) => {
    if (event.key === "Escape") endRename();
  });
  window.addEventListener("hashchange", () => {
    const id = idFromHash();
    if (id && id !== current?.id) openConversation(id);
  });
  window.addEventListener("offline", () => showBanner("You are offline. The page will recover when the network returns."));
  window.addEventListener("online", recover);
}

/** After the network returns: reopen the conversation if it never loaded; streams resume by themselves. */
async function recover() {
  // A stream still cut will say so again at its next reconnection attempt.
  clearBanner();
  try {
    await sidebar.refresh();
    if (current && !current.conversation) await openConversation(current.id);
  } catch (error) {
    showBanner(describe(error));
  }
}

function idFromHash() {
  const match = location.hash.match(/^#\/c\/([0-9a-f-]{36})$/i);
  return match ? match[1] : null;
}

async function start() {
  wire();
  // Keep trying until the server answers: the page may be opened while it starts.
  for (let delay = 500; ; delay = Math.min(delay * 2, 8000)) {
    try {
      const { token, config } = await api.loadToken();
      ui.model.textContent = config.model === "chatmem-demo" ? "[demo model]" : config.model || "";
      if (!token) await askForToken("This server needs an access token.");
      const items = await withAuth(() => sidebar.refresh());
      clearBanner();
      const id = idFromHash() || items[0]?.id;
      if (id) await openConversation(id);
      else await createConversation();
      document.body.dataset.ready = "true";
      return;
    } catch (error) {
      showBanner(`Cannot start: ${describe(error)}`);
      await waitToRetry(delay);
    }
  }
}

start();
