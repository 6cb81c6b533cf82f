// chatmem's reference chat page. Plain ES modules, no build step, no outside requests.
//
// How a reply reaches the screen, in every case, through one path (ReplyView.apply):
//   - sending: POST /messages answers with the reply's SSE events;
//   - the connection drops mid-reply: GET /v1/turns/{reply}/events?after=<last id seen>;
//   - the page is reloaded mid-reply: the stored turns draw the history, and the reply still
//     streaming is drawn from GET …/events?after=0, which replays every event and then follows
//     live. Text is drawn only from events (never from the stored checkpoint, which may lag
//     the stream), so the reloaded reply has no duplicated and no missing text.
//   - a tool call waits for a person: the stream ends at turn.awaiting_approval and the reply
//     waits (no stream open, the conversation busy); Approve / Reject POSTs the decision and
//     draws the rest of the reply from that response's events. A waiting reply found on load
//     is drawn from its stored turns, which do not change while it waits.
// The page never stops a reply by going away (on_disconnect=continue): only Stop does.
//
// Versions (branches): Regenerate and Edit start a reply on a new branch through the same
// path as sending; the page replaces what follows the message with the new branch's and,
// once the reply ends, draws the version switchers from GET …/branches. Switching versions
// activates a branch and draws the history again from the stored turns.

import { ApiError, NetworkError } from "./api.js";
import { CALL_STATE, EVENT, STATUS } from "./events.js";
import { enableApiKeys } from "./api_keys.js";
import { busyNote, refusedAsBusy, showComposerState } from "./composer.js";
import { api, askForToken, clearBanner, describe, showBanner, waitToRetry, withAuth } from "./connection.js";
import { enableBranchActions } from "./branches.js";
import { ChatSwitch, MemoryView } from "./memory_view.js";
import { ReplyView } from "./reply_view.js";
import { Sidebar } from "./sidebar.js";
import { TitleBar } from "./title.js";
import { userMessage } from "./user_message.js";
import { isBusy, Versions } from "./versions.js";

const $ = (id) => document.getElementById(id);
const ui = {
  messages: $("messages"),
  composer: $("composer"),
  input: $("composer-input"),
  send: $("send"),
  stop: $("stop"),
  notice: $("notice"),
  model: $("model-badge"),
  newChat: $("new-chat"),
};

// The open conversation. Replaced (and its streams aborted) when another one is opened.
let current = null;

function newConversationState(id) {
  return {
    id,
    conversation: null,
    views: new Map(),
    userMessages: new Map(), // user turn id -> message on screen
    pending: false, // a regenerate, edit or switch is on its way to the server
    live: new Set(), // views whose events this page is reading
    waiting: new Set(), // views waiting for a decision on a tool call (no stream open)
    aborter: new AbortController(),
  };
}

// --- notices for screen readers ---------------------------------------------------------

function say(message) {
  ui.notice.textContent = message;
}

// --- conversations ----------------------------------------------------------------------

const sidebar = new Sidebar(api, { onOpen: (id) => openConversation(id) });
const titleBar = new TitleBar({ current: () => current, onSaved: () => sidebar.refresh() });
const memorySwitches = [
  new ChatSwitch("remember-chat", "remember"), // write: this chat reaches long-term memory
  new ChatSwitch("use-memory", "use_memory"), // read: replies here recall long-term memory
];
new MemoryView();
const versions = new Versions({
  messages: ui.messages,
  input: ui.input,
  current: () => current,
  streamReply: (state, request, onStarted) => streamReply(state, request, onStarted),
  open: (id, focus) => openConversation(id, focus),
  update: () => updateComposer(),
  say,
  userMessage: (state, text, turnId) => newUserMessage(state, text, turnId),
});

/** Open a conversation; `focus()` (optional) moves focus once drawn, else the composer takes it. */
async function openConversation(id, focus) {
  current?.aborter.abort(); // leaving: stop reading its streams (the replies go on server-side)
  const state = newConversationState(id);
  current = state;
  sidebar.markCurrent(id);
  if (location.hash !== `#/c/${id}`) history.replaceState(null, "", `#/c/${id}`);
  ui.messages.replaceChildren();
  try {
    const [conversation, turns, branches] = await withAuth(() =>
      Promise.all([api.getConversation(id), api.listTurns(id), api.listBranches(id)]),
    );
    if (current !== state) return;
    state.conversation = conversation;
    titleBar.show(conversation.title);
    for (const memorySwitch of memorySwitches) memorySwitch.show(state);
    renderHistory(state, turns.items, conversation.active_reply_id);
    versions.show(state, turns.items, branches);
    clearBanner();
  } catch (error) {
    if (current === state) showBanner(`Could not open the conversation: ${describe(error)}`);
    return;
  }
  updateComposer();
  if (!focus?.()) ui.input.focus();
  for (const view of state.waiting) waitForDecision(state, view);
  document.body.dataset.conversation = id; // loaded (tests wait on this)
}

function renderHistory(state, turns, activeReplyId) {
  // A reply waiting for a decision holds the conversation (it is the active reply) but has
  // nothing to stream: it is drawn from its stored turns, buttons included.
  const parked = new Set(turns.filter((t) => t.status === STATUS.AWAITING_APPROVAL).map((t) => t.reply_id || t.id));
  for (const turn of turns) {
    if (turn.role === "user") {
      const attachments = turn.metadata?.attachments ?? [];
      ui.messages.append(newUserMessage(state, turn.content, turn.id, attachments).element);
      continue;
    }
    const replyId = turn.reply_id || turn.id;
    const live = !parked.has(replyId) && (replyId === activeReplyId || turn.status === STATUS.STREAMING);
    let view = state.views.get(replyId);
    if (!view) {
      view = addReplyView(state, replyId);
      if (live) followToEnd(state, view); // drawn from its events, from the first one
    }
    if (!state.live.has(view)) view.addStoredTurn(turn);
  }
  for (const replyId of parked) state.waiting.add(state.views.get(replyId));
  scrollToEnd();
}

function addReplyView(state, replyId) {
  const view = newReplyView(state, replyId);
  state.views.set(replyId, view);
  ui.messages.append(view.element);
  return view;
}

function newReplyView(state, replyId) {
  return new ReplyView(replyId, {
    loadMemories: () => loadMemories(replyId),
    onDecide: (view, call, verb, body) => decideCall(state, view, call, verb, body),
    onRegenerate: (view) => versions.regenerate(state, view),
  });
}

function newUserMessage(state, text, turnId = null, attachments = []) {
  const onEdit = (id, edited) => versions.edit(state, id, edited);
  const message = userMessage(text, { turnId, onEdit, attachments });
  if (turnId) state.userMessages.set(turnId, message);
  return message;
}

/** The memory.retrieved payload of a finished reply: its events replay, then the stream ends. */
async function loadMemories(replyId) {
  let payload = { items: [] };
  await withAuth(() =>
    api.followReply(replyId, 0, (event) => {
      if (event.event === EVENT.MEMORY_RETRIEVED) payload = event.data;
    }),
  );
  return payload;
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

// --- messages and replies ---------------------------------------------------------------

async function sendMessage(text) {
  const state = current;
  const waiting = state.waiting.size > 0;
  const message = newUserMessage(state, text);
  ui.messages.append(message.element);
  if (waiting || state.live.size > 0) message.note(busyNote(waiting, api.config?.on_busy));
  scrollToEnd();
  const request = (key, onEvent, signal) => api.sendMessage(state.id, text, key, onEvent, signal);
  const error = await streamReply(state, request, (started) => {
    message.note("");
    message.setTurn(started.user_turn_id);
    state.userMessages.set(started.user_turn_id, message);
    // Accepted while a reply waited: the server ended that one (on_busy=interrupt); show how.
    for (const parked of state.waiting) catchUp(state, parked);
    titleBar.fromFirstMessage(state, text);
  });
  if (error) notSent(message, text, error, waiting);
}

/**
 * Draw the reply a POST answers with (`request(key, onEvent, signal)`) from its events,
 * calling `onStarted(turn.started data)` first, and follow it to its end. The error when the
 * server refused it (nothing started), else null.
 */
async function streamReply(state, request, onStarted) {
  const key = idempotencyKey();
  let view = null;
  const onEvent = (event) => {
    if (event.event === EVENT.TURN_STARTED && !view) {
      onStarted(event.data);
      view = addReplyView(state, event.data.reply_id);
      state.live.add(view);
      updateComposer();
    }
    view?.apply(event);
    scrollToEnd();
  };
  try {
    await withAuth(() => request(key, onEvent, state.aborter.signal));
  } catch (error) {
    if (error.name === "AbortError") return null;
    if (!view) return error;
    // Started, then the stream broke: the reply goes on server-side; resume below.
  }
  if (view && !view.finished && !view.parked) await followToEnd(state, view);
  else afterReply(state, view);
  return null;
}

function notSent(message, text, error, waiting) {
  if (error instanceof ApiError && error.code === "conversation_busy") {
    message.note(refusedAsBusy(waiting || error.details.awaiting_approval), "error");
  } else {
    message.note(`Not sent: ${describe(error)}`, "error");
  }
  if (!ui.input.value) ui.input.value = text; // give the text back, nothing is lost
  say("Your message was not sent.");
}

/**
 * Follow a reply's events to its end (or until it waits for a decision), reconnecting after
 * the last event seen when cut off.
 */
async function followToEnd(state, view) {
  state.waiting.delete(view);
  state.live.add(view);
  updateComposer();
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
      if (view.parked) break; // nothing more until a person decides
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
  if (view) {
    state.live.delete(view);
    if (view.parked) state.waiting.add(view);
    else state.waiting.delete(view);
  }
  updateComposer();
  if (view?.parked && current === state) waitForDecision(state, view);
  if (current === state) sidebar.refresh().catch(() => {});
}

/** Say which calls wait, bring the first question into focus unless the person types, watch timeouts. */
function waitForDecision(state, view) {
  const calls = view.waitingCalls();
  if (calls.length === 0) return;
  watchTimeout(state, view);
  say(`${calls.map((call) => call.name).join(", ")} waits for your approval.`);
  // Focus goes to the question, never onto Approve: an Enter meant for sending must not approve.
  // It moves only from where nothing is being typed: the page, an empty composer, or this
  // reply (after deciding one of several calls, the next one is asked).
  const active = document.activeElement;
  const idle =
    !active ||
    active === document.body ||
    (active === ui.input && !ui.input.value) ||
    (view.element.contains(active) && !calls.some((call) => call.element.contains(active)));
  if (idle) calls[0].focusApproval();
}

// --- approvals --------------------------------------------------------------------------

/**
 * A call with an approval timeout is rejected by the server once it expires, and no stream
 * tells this page: from the earliest expiry on, re-read the turn (backing off) until it has
 * changed, then catch up with what happened.
 */
function watchTimeout(state, view) {
  const due = view.waitingCalls().map((call) => Date.parse(call.expiresAt)).filter(Number.isFinite);
  if (due.length === 0 || view.timeoutWatch) return;
  let delay = 2000;
  const check = async () => {
    view.timeoutWatch = null;
    if (current !== state || !state.waiting.has(view)) return;
    const calls = view.waitingCalls();
    try {
      const turn = await withAuth(() => api.getTurn(calls[0].turnId));
      const stillWaiting = new Set(
        turn.tool_calls.filter((c) => c.state === CALL_STATE.AWAITING_APPROVAL).map((c) => c.id),
      );
      if (current !== state || !state.waiting.has(view)) return;
      if (!calls.every((call) => stillWaiting.has(call.callId))) return catchUp(state, view);
    } catch {
      // Not reachable right now: look again later.
    }
    view.timeoutWatch = setTimeout(check, delay);
    delay = Math.min(delay * 2, 60_000);
  };
  view.timeoutWatch = setTimeout(check, Math.max(0, Math.min(...due) - Date.now()) + 500);
}

/** Send a person's decision on a waiting call; the rest of the reply streams into its view. */
async function decideCall(state, view, call, verb, body) {
  if (current !== state) return;
  state.waiting.delete(view);
  state.live.add(view);
  updateComposer();
  const before = view.lastEventId;
  const onEvent = (event) => {
    view.apply(event);
    scrollToEnd();
  };
  try {
    await withAuth(() =>
      api.decideToolCall(call.turnId, call.callId, verb, body, onEvent, state.aborter.signal),
    );
  } catch (error) {
    if (error.name === "AbortError") return;
    // The decision was taken and its stream then broke: the reply goes on; resume it.
    if (view.lastEventId !== before) return followToEnd(state, view);
    const problem = decisionProblem(error, verb);
    call.showProblem(problem);
    say(problem);
    return catchUp(state, view, problem);
  }
  if (!view.finished && !view.parked) return followToEnd(state, view);
  afterReply(state, view);
}

function decisionProblem(error, verb) {
  const done = verb === "approve" ? "approved" : "rejected";
  if (error instanceof ApiError && error.code === "tool_call_not_awaiting_approval") {
    return `Not ${done}: this call was already decided elsewhere, or its reply was stopped. ` +
      "The page shows what happened instead.";
  }
  if (error instanceof NetworkError) {
    return `Not ${done}: the server cannot be reached, so the decision may not have been recorded. ` +
      "The page shows the call as soon as the server answers again.";
  }
  return `Not ${done}: ${describe(error)}`;
}

/** Draw what happened to a reply while this page was not reading its events (a decision elsewhere, a stop). */
async function catchUp(state, view, problem) {
  if (current !== state) return;
  // Drawn from its events: the ones after the last seen say what happened.
  if (view.lastEventId > 0) return followToEnd(state, view);
  // Drawn from stored turns, its event ids are unknown: draw it again from its first event.
  const fresh = newReplyView(state, view.replyId);
  state.live.delete(view);
  state.waiting.delete(view);
  state.views.set(view.replyId, fresh);
  view.element.replaceWith(fresh.element);
  if (problem) fresh.showError(problem);
  return followToEnd(state, fresh);
}

async function reloadAfterUnknownEnd(state) {
  // The server closed the stream without a terminal event (it could not store one): the
  // stored turns are the truth, so draw them again.
  if (current === state) await openConversation(state.id);
}

async function stopReply() {
  const state = current;
  // A streaming reply first; otherwise the one waiting for a decision (Stop ends it).
  const view = [...(state?.live || [])].at(-1) || [...(state?.waiting || [])].at(-1);
  if (!view) return;
  const waiting = state.waiting.has(view);
  ui.stop.disabled = true;
  ui.stop.textContent = "Stopping…";
  try {
    await withAuth(() => api.stopReply(view.replyId));
    say("Reply stopped.");
    if (waiting) catchUp(state, view); // no stream is open to carry its ending
  } catch (error) {
    showBanner(`Could not stop the reply: ${describe(error)}`);
  } finally {
    ui.stop.disabled = false;
    ui.stop.textContent = "Stop";
  }
}

/** The composer's state from the open conversation's replies. */
function updateComposer() {
  const streaming = (current?.live.size || 0) > 0;
  const waiting = !streaming && (current?.waiting.size || 0) > 0;
  showComposerState(streaming, waiting, api.config?.on_busy);
  // Versions change only while nothing streams or waits (the server answers 409 otherwise);
  // Regenerate is offered on the last reply alone, once it has ended.
  enableBranchActions(ui.messages, Boolean(current) && !isBusy(current));
  const replies = [...ui.messages.querySelectorAll(".reply")];
  replies.forEach((reply, i) => {
    const ended = ![STATUS.STREAMING, STATUS.AWAITING_APPROVAL].includes(reply.dataset.status);
    reply.querySelector(".regenerate").hidden = i !== replies.length - 1 || !ended;
  });
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
  enableApiKeys();
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
