// One assistant reply on screen: its steps (assistant turns), tool calls, status and memories.
//
// A reply is drawn either from stored turns (history) or from its SSE events (live, or
// replayed from event 0 after a reload). Events carry increasing ids; `apply` ignores any id
// it has already seen, which is what makes resuming after a cut connection safe: the page
// asks for `?after=<last id seen>` and nothing is drawn twice or skipped.
//
// A reply that calls a tool needing a person's approval pauses (`parked`): its stream ends
// at turn.awaiting_approval, the call shows Approve / Reject, and the decision's response
// carries the rest of the reply with the next event ids, into this same view.

import { CALL_STATE, ENDING_EVENTS, EVENT, STATUS, STOP_REASON } from "./events.js";
import { renderMarkdown } from "./markdown.js";
import { ToolCallView } from "./tool_call_view.js";

const STATUS_LABELS = {
  [STATUS.STREAMING]: "Streaming…",
  [STATUS.COMPLETED]: "Completed",
  [STATUS.INTERRUPTED_BY_USER]: "Interrupted — stopped",
  [STATUS.INTERRUPTED_BY_ERROR]: "Interrupted — error",
  [STATUS.FAILED]: "Failed",
  [STATUS.AWAITING_APPROVAL]: "Waiting for your approval",
};

const REASON_LABELS = {
  [STOP_REASON.USER]: "Interrupted — stopped by you",
  [STOP_REASON.NEW_MESSAGE]: "Interrupted — by your new message",
  [STOP_REASON.CLIENT_DISCONNECTED]: "Interrupted — the page disconnected",
};

let viewCounter = 0;

export class ReplyView {
  /**
   * `loadMemories()` (optional) fetches the memory.retrieved payload of a finished reply;
   * `onDecide(view, call, verb, body)` (optional) sends a person's approve/reject decision;
   * `onRegenerate(view)` (optional) answers the reply's user message again.
   */
  constructor(replyId, { loadMemories, onDecide, onRegenerate } = {}) {
    this.replyId = replyId;
    this.loadMemories = loadMemories;
    this.onDecide = onDecide;
    this.onRegenerate = onRegenerate;
    this.lastEventId = 0;
    this.finished = false;
    this.parked = false; // waits for a decision on a tool call; no stream carries it meanwhile
    this.status = STATUS.STREAMING;
    this.steps = new Map(); // assistant turn id -> step
    this.calls = new Map(); // tool call id -> call view
    this.memories = null; // the memory.retrieved payload, once known
    this.rewrittenQuery = null;
    this.id = `reply-${++viewCounter}`;
    this.element = this.build();
  }

  build() {
    const article = document.createElement("article");
    article.className = "reply";
    article.dataset.replyId = this.replyId;
    article.dataset.status = this.status;
    article.setAttribute("aria-label", "Assistant reply");

    const main = div("reply-main");
    const head = div("reply-head");
    this.modelLabel = span("model-label", "");
    this.statusLabel = span("status-label", STATUS_LABELS.streaming);
    this.memoriesButton = document.createElement("button");
    this.memoriesButton.type = "button";
    this.memoriesButton.className = "memories-toggle";
    this.memoriesButton.textContent = "Memories";
    this.memoriesButton.setAttribute("aria-expanded", "false");
    this.memoriesButton.setAttribute("aria-controls", `${this.id}-memories`);
    this.memoriesButton.addEventListener("click", () => this.toggleMemories());
    // Shown by the page on the active branch's last reply only (the server's rule).
    this.regenerateButton = document.createElement("button");
    this.regenerateButton.type = "button";
    this.regenerateButton.className = "regenerate";
    this.regenerateButton.textContent = "Regenerate";
    this.regenerateButton.setAttribute("aria-label", "Regenerate this reply");
    this.regenerateButton.dataset.branchAction = "regenerate";
    this.regenerateButton.hidden = true;
    this.regenerateButton.addEventListener("click", () => this.onRegenerate?.(this));
    const slot = div("branch-slot");
    head.append(this.modelLabel, this.statusLabel, slot, this.memoriesButton, this.regenerateButton);

    this.body = div("reply-body");
    this.errorLine = document.createElement("p");
    this.errorLine.className = "reply-error";
    this.errorLine.hidden = true;
    main.append(head, this.body, this.errorLine);

    this.memoriesPanel = document.createElement("aside");
    this.memoriesPanel.className = "memories";
    this.memoriesPanel.id = `${this.id}-memories`;
    this.memoriesPanel.setAttribute("aria-label", "Memories used for this reply");
    this.memoriesPanel.hidden = true;

    article.append(main, this.memoriesPanel);
    return article;
  }

  // --- live events -----------------------------------------------------------------

  /** Apply one SSE event ({id, event, data}); events already seen are ignored. */
  apply({ id, event, data }) {
    if (id !== null && id <= this.lastEventId) return;
    if (id !== null) this.lastEventId = id;
    switch (event) {
      case EVENT.TURN_STARTED:
        this.setModel(data.model);
        this.step(data.assistant_turn_id);
        break;
      case EVENT.MEMORY_RETRIEVED:
        this.setMemories(data);
        break;
      case EVENT.STEP_STARTED:
        this.step(data.turn_id);
        break;
      case EVENT.MESSAGE_DELTA:
        this.step(data.turn_id).appendText(data.text);
        break;
      case EVENT.TOOL_CALL_DELTA:
        this.toolDelta(data);
        break;
      case EVENT.TOOL_STARTED:
        this.calls.get(data.call_id)?.setState(CALL_STATE.RUNNING);
        break;
      case EVENT.TOOL_RESULT:
        this.calls.get(data.call_id)?.setResult(data.state, data.result);
        break;
      case EVENT.TOOL_CALL_APPROVAL_REQUIRED:
        this.approvalRequired(data);
        break;
      case EVENT.TURN_AWAITING_APPROVAL:
        this.park();
        break;
      case EVENT.TOOL_CALL_APPROVED:
      case EVENT.TOOL_CALL_REJECTED:
        this.decided(data, event === EVENT.TOOL_CALL_APPROVED ? "approved" : "rejected");
        break;
      case EVENT.ERROR:
        this.showError(data.message || data.code);
        break;
      default:
        if (ENDING_EVENTS.has(event)) this.finish(data.status, data.reason, data.error);
    }
  }

  toolDelta({ turn_id, index, id, name, arguments: fragment }) {
    const step = this.step(turn_id);
    const call = this.callAt(step, index, name, CALL_STATE.STREAMING);
    if (name) call.setName(name);
    if (id) this.identify(call, id);
    call.appendArguments(fragment || "");
  }

  /** The call needs a person: its complete arguments, and Approve / Reject. */
  approvalRequired({ turn_id, index, call_id, name, arguments: args, expires_at }) {
    const call = this.callAt(this.step(turn_id), index, name, CALL_STATE.AWAITING_APPROVAL);
    this.identify(call, call_id);
    call.setName(name);
    call.setArguments(args ?? call.arguments);
    call.awaitApproval(expires_at);
  }

  park() {
    this.parked = true;
    this.setStatus(STATUS.AWAITING_APPROVAL);
    for (const step of this.steps.values()) step.renderNow();
  }

  decided({ call_id, by, reason, arguments: args, arguments_edited: edited }, decision) {
    const call = this.calls.get(call_id);
    if (edited && args) call?.setArguments(args); // what runs is what the person approved
    call?.setDecision({ decision, by, reason, arguments_edited: edited });
    // The last decision resumes the reply (the server's rule): the next events follow.
    if (this.parked && this.waitingCalls().length === 0) {
      this.parked = false;
      this.setStatus(STATUS.STREAMING);
    }
  }

  /** The calls that still wait for a decision. */
  waitingCalls() {
    return [...this.calls.values()].filter((call) => call.state === CALL_STATE.AWAITING_APPROVAL);
  }

  callAt(step, index, name, state) {
    let call = step.calls.get(index);
    if (!call) {
      call = new ToolCallView(name, state, step.turnId, (c, verb, body) => this.onDecide?.(this, c, verb, body));
      step.calls.set(index, call);
      step.element.append(call.element);
    }
    return call;
  }

  identify(call, id) {
    call.callId = id;
    if (this.calls.get(id) !== call) this.calls.set(id, call);
  }

  // --- stored history --------------------------------------------------------------

  /** Add a stored assistant or tool turn (GET /turns), in sequence order. */
  addStoredTurn(turn) {
    // A stored reply takes no live events, except one that waits for a decision: the
    // decision's stream carries only events after the stored ones (their ids are not known
    // here, so any id is accepted until the first one arrives).
    this.lastEventId = turn.status === STATUS.AWAITING_APPROVAL ? 0 : Number.MAX_SAFE_INTEGER;
    if (turn.role === "tool") {
      const call = this.calls.get(turn.tool_call_id);
      call?.setResult(null, turn.content);
      return;
    }
    this.setModel(turn.model);
    if (turn.rewritten_query) this.rewrittenQuery = turn.rewritten_query;
    const step = this.step(turn.id);
    step.setText(turn.content);
    for (const stored of turn.tool_calls || []) {
      const call = this.callAt(step, stored.index, stored.name, stored.state);
      this.identify(call, stored.id);
      call.setArguments(stored.arguments || "");
      call.setState(stored.state);
      if (stored.approval?.decision) call.setDecision(stored.approval);
      if (stored.state === CALL_STATE.AWAITING_APPROVAL) call.awaitApproval(stored.approval?.expires_at);
      if (![STATUS.STREAMING, STATUS.COMPLETED, STATUS.AWAITING_APPROVAL].includes(turn.status)) call.interrupt();
    }
    this.setStatus(turn.status, turn.interrupt_reason, turn.error);
    this.parked = turn.status === STATUS.AWAITING_APPROVAL;
    this.finished = turn.status !== STATUS.STREAMING && !this.parked;
  }

  // --- parts -----------------------------------------------------------------------

  step(turnId) {
    let step = this.steps.get(turnId);
    if (!step) {
      step = new StepView(turnId);
      this.steps.set(turnId, step);
      this.body.append(step.element);
    }
    return step;
  }

  /** The whole visible text of the reply, every step joined (what the person read). */
  text() {
    return [...this.steps.values()].map((s) => s.text).join("");
  }

  setModel(model) {
    if (!model) return;
    this.modelLabel.textContent = model === "chatmem-demo" ? "[demo model]" : model;
  }

  finish(status, reason, error) {
    this.finished = true;
    this.parked = false;
    // Mirror what the server stores: a call whose arguments were still streaming stays
    // incomplete (shown as cut off); calls that were ready, running or waiting are cancelled.
    if (status !== STATUS.COMPLETED) {
      for (const step of this.steps.values()) for (const call of step.calls.values()) call.interrupt();
    }
    this.setStatus(status, reason, error);
    for (const step of this.steps.values()) step.renderNow();
  }

  setStatus(status, reason, error) {
    this.status = status;
    this.element.dataset.status = status;
    let label = STATUS_LABELS[status] || status;
    if (status === STATUS.INTERRUPTED_BY_USER && REASON_LABELS[reason]) label = REASON_LABELS[reason];
    this.statusLabel.textContent = label;
    if (error && status !== STATUS.COMPLETED) this.showError(error.message || error.code || String(error));
  }

  showError(message) {
    this.errorLine.hidden = false;
    this.errorLine.textContent = message;
  }

  // --- memories --------------------------------------------------------------------

  setMemories(payload) {
    this.memories = payload || { items: [] };
    if (payload?.rewritten_query) this.rewrittenQuery = payload.rewritten_query;
    const count = (payload?.items || []).length + (payload?.standing || []).length;
    this.memoriesButton.textContent = `Memories (${count})`;
    this.renderMemories();
  }

  async toggleMemories() {
    const open = this.memoriesPanel.hidden;
    this.memoriesPanel.hidden = !open;
    this.memoriesButton.setAttribute("aria-expanded", String(open));
    this.element.classList.toggle("with-memories", open);
    if (open && this.memories === null && (this.finished || this.parked) && this.loadMemories) {
      this.memoriesPanel.textContent = "Loading…";
      try {
        this.setMemories(await this.loadMemories());
      } catch (error) {
        this.memoriesPanel.textContent = `Could not load the memories: ${error.message}`;
        return;
      }
    }
    this.renderMemories();
  }

  renderMemories() {
    if (this.memoriesPanel.hidden) return;
    const panel = this.memoriesPanel;
    panel.replaceChildren(heading("Memories used"));
    if (this.rewrittenQuery) {
      const query = document.createElement("p");
      query.className = "rewritten-query";
      query.append(span("field-name", "Rewritten query: "), document.createTextNode(this.rewrittenQuery));
      panel.append(query);
    }
    const items = this.memories?.items || [];
    // A chat's first reply may open with what the user said about themselves in earlier chats.
    const standing = this.memories?.standing || [];
    if (this.memories === null && !this.finished && !this.parked) {
      panel.append(paragraph("Not known yet."));
    } else if (items.length === 0 && standing.length === 0) {
      panel.append(paragraph("No memories were used for this reply."));
    } else {
      if (standing.length > 0) {
        const list = document.createElement("ol");
        list.className = "memory-items standing-items";
        list.setAttribute("aria-label", "What you said about yourself, given to this chat");
        for (const item of standing) list.append(memoryItem({ ...item, score: undefined }));
        panel.append(subheading("About you, from earlier chats"), list);
      }
      if (items.length > 0) {
        const list = document.createElement("ol");
        list.className = "memory-items";
        for (const item of items) list.append(memoryItem(item));
        if (standing.length > 0) panel.append(subheading("Found for this message"));
        panel.append(list);
      }
    }
  }
}

/** One assistant turn: its text and its tool calls. */
class StepView {
  constructor(turnId) {
    this.turnId = turnId;
    this.text = "";
    this.calls = new Map(); // index -> ToolCallView
    this.element = div("step");
    this.element.dataset.turnId = turnId;
    this.content = div("content markdown");
    this.element.append(this.content);
    this.pending = false;
  }

  appendText(text) {
    this.text += text;
    this.renderSoon();
  }

  setText(text) {
    this.text = text || "";
    this.renderNow();
  }

  // Re-rendering the Markdown at every word is wasteful; once per frame is enough.
  renderSoon() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => this.renderNow());
  }

  renderNow() {
    this.pending = false;
    this.content.replaceChildren(renderMarkdown(this.text));
    this.content.hidden = this.text === "";
  }
}

// --- small DOM builders ------------------------------------------------------------------

function memoryItem(item) {
  const li = document.createElement("li");
  const text = item.text ?? item.content ?? item.chunk ?? "";
  li.append(paragraph(String(text)));
  const meta = document.createElement("p");
  meta.className = "memory-meta";
  const parts = [];
  if (item.role) parts.push(item.role);
  if (item.created_at) parts.push(new Date(item.created_at).toLocaleString());
  if (typeof item.score === "number") parts.push(`score ${item.score.toFixed(3)}`);
  meta.textContent = parts.join(" · ");
  li.append(meta);
  if (item.conversation_id) {
    const link = document.createElement("a");
    link.href = `#/c/${encodeURIComponent(item.conversation_id)}`;
    link.textContent = "open that conversation";
    li.append(link);
  }
  return li;
}

function div(className) {
  const node = document.createElement("div");
  node.className = className;
  return node;
}

function span(className, text) {
  const node = document.createElement("span");
  node.className = className;
  node.textContent = text;
  return node;
}

function paragraph(text) {
  const node = document.createElement("p");
  node.textContent = text;
  return node;
}

function heading(text) {
  const node = document.createElement("h3");
  node.textContent = text;
  return node;
}

function subheading(text) {
  const node = document.createElement("h4");
  node.textContent = text;
  return node;
}
