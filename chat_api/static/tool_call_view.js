// One tool call inside a reply: its name, state, arguments (raw, maybe partial) and result,
// collapsed by default. A call to a tool that needs a person opens itself and shows
// Approve / Reject (Reject asks for an optional reason inline, never a prompt() dialog);
// once decided, it says what was decided, by whom, and why.

import { CALL_STATE } from "./events.js";

// What the page shows for each state; `cut_off` is the page's own (a call interrupted while
// its arguments were still streaming).
const CUT_OFF = "cut_off";
const CALL_STATE_LABELS = {
  [CALL_STATE.STREAMING]: "arguments streaming…",
  [CALL_STATE.READY]: "ready",
  [CALL_STATE.RUNNING]: "running…",
  [CALL_STATE.SUCCEEDED]: "succeeded",
  [CALL_STATE.FAILED]: "failed",
  [CALL_STATE.CANCELLED]: "cancelled",
  [CUT_OFF]: "cut off — arguments incomplete",
  [CALL_STATE.AWAITING_APPROVAL]: "waiting for your approval",
  [CALL_STATE.REJECTED]: "rejected",
};

let callCounter = 0;

export class ToolCallView {
  /** `decide(call, verb, body)` sends a decision on this call: verb "approve" or "reject". */
  constructor(name, state, turnId, decide) {
    this.id = `call-${++callCounter}`;
    this.turnId = turnId;
    this.callId = null; // known from the first delta that carries it
    this.decide = decide;
    this.arguments = "";
    this.approval = null; // the Approve / Reject panel, while the call waits
    this.expiresAt = null; // when the server counts silence as a rejection (ISO time), if ever

    this.element = document.createElement("details");
    this.element.className = "tool-call";
    const summary = document.createElement("summary");
    this.nameLabel = node("span", "tool-name");
    this.stateLabel = node("span", "tool-state");
    this.decisionTag = node("span", "tool-decision-tag");
    summary.append(node("span", "tool-icon", "Tool call "), this.nameLabel, this.stateLabel, this.decisionTag);
    this.argumentsBlock = node("pre", "tool-arguments");
    this.decisionLine = node("p", "tool-decision");
    this.decisionLine.hidden = true;
    this.decisionLine.tabIndex = -1; // focus lands here when the buttons it replaces go away
    this.problemLine = node("p", "tool-problem");
    this.problemLine.setAttribute("role", "alert");
    this.resultBlock = node("pre", "tool-result");
    this.resultBlock.hidden = true;
    this.element.append(
      summary,
      node("small", "", "Arguments"),
      this.argumentsBlock,
      this.decisionLine,
      this.problemLine,
      this.resultBlock,
    );
    this.setName(name);
    this.setState(state);
  }

  get name() {
    return this.nameLabel.textContent;
  }

  setName(name) {
    this.nameLabel.textContent = name || "(unnamed)";
  }

  appendArguments(fragment) {
    this.setArguments(this.arguments + fragment);
  }

  setArguments(text) {
    this.arguments = text;
    this.argumentsBlock.textContent = text;
  }

  setState(state) {
    this.state = state;
    this.element.dataset.state = state;
    this.stateLabel.textContent = ` — ${CALL_STATE_LABELS[state] || state}`;
    if (state !== CALL_STATE.AWAITING_APPROVAL) this.dropApproval();
  }

  setResult(state, result) {
    if (state) this.setState(state);
    this.resultBlock.hidden = false;
    this.resultBlock.textContent = `Result: ${prettyJson(result)}`;
  }

  interrupt() {
    if (this.state === CALL_STATE.STREAMING) this.setState(CUT_OFF);
    else if ([CALL_STATE.READY, CALL_STATE.RUNNING, CALL_STATE.AWAITING_APPROVAL].includes(this.state)) {
      this.setState(CALL_STATE.CANCELLED);
    }
  }

  // --- approval ------------------------------------------------------------------------

  /** The call waits for a person: open it (its arguments are what they approve) and ask. */
  awaitApproval(expiresAt) {
    this.expiresAt = expiresAt || null;
    this.setState(CALL_STATE.AWAITING_APPROVAL);
    this.element.open = true;
    if (!this.approval) {
      this.approval = new ApprovalPanel(this, expiresAt);
      this.element.insertBefore(this.approval.element, this.decisionLine);
    } else {
      this.approval.setBusy(null); // asked again after a decision that did not go through
    }
  }

  /** Move focus to the question (not to Approve: an Enter meant for the composer must not approve). */
  focusApproval() {
    this.approval?.element.focus();
  }

  /** The decision is being sent. */
  deciding(verb) {
    this.problemLine.textContent = "";
    this.approval?.setBusy(verb);
  }

  /** The decision did not go through (or was already taken elsewhere): say why. */
  showProblem(message) {
    this.problemLine.textContent = message;
    this.approval?.setBusy(null);
  }

  /** What was decided: `{decision: "approved"|"rejected", by: "user"|"timeout", reason, arguments_edited}`. */
  setDecision({ decision, by, reason, arguments_edited: edited }) {
    this.element.dataset.decision = by === "timeout" ? "timed_out" : decision;
    let tag;
    let line;
    if (by === "timeout") {
      tag = "timed out";
      line = "Timed out: nobody decided in time, so it counts as rejected.";
    } else if (decision === "approved") {
      tag = "approved by you";
      line = edited ? "Approved by you, with edited arguments." : "Approved by you.";
    } else {
      tag = "rejected by you";
      line = reason ? `Rejected by you. Reason: ${reason}` : "Rejected by you (no reason given).";
    }
    this.decisionTag.textContent = ` · ${tag}`;
    this.decisionLine.textContent = line;
    this.decisionLine.hidden = false;
    // An approved call is ready to run (then running, succeeded…); a rejected one never runs.
    if (decision === "rejected") this.setState(CALL_STATE.REJECTED);
    else if (this.state === CALL_STATE.AWAITING_APPROVAL) this.setState(CALL_STATE.READY);
  }

  dropApproval() {
    if (!this.approval) return;
    const hadFocus = this.approval.element.contains(document.activeElement);
    this.approval.element.remove();
    this.approval = null;
    if (!hadFocus) return;
    if (this.decisionLine.hidden) this.element.querySelector("summary").focus();
    else this.decisionLine.focus();
  }
}

/** The question, Approve, and Reject with its inline reason form. */
class ApprovalPanel {
  constructor(call, expiresAt) {
    this.call = call;
    const id = call.id;
    this.element = node("div", "approval");
    this.element.setAttribute("role", "group");
    this.element.setAttribute("aria-labelledby", `${id}-ask`);
    this.element.tabIndex = -1;

    const ask = node("p", "approval-ask", `Run ${call.name} with these arguments? It waits for your approval.`);
    ask.id = `${id}-ask`;
    this.element.append(ask);
    if (expiresAt) {
      const until = new Date(expiresAt).toLocaleTimeString();
      this.element.append(node("p", "approval-expiry", `Decide by ${until}; after that it counts as rejected.`));
    }

    this.actions = node("div", "approval-actions");
    this.approveButton = button("Approve", "approve");
    this.approveButton.setAttribute("aria-label", `Approve ${call.name}`);
    this.rejectButton = button("Reject", "reject");
    this.rejectButton.setAttribute("aria-label", `Reject ${call.name}`);
    this.rejectButton.setAttribute("aria-expanded", "false");
    this.rejectButton.setAttribute("aria-controls", `${id}-reject`);
    this.actions.append(this.approveButton, this.rejectButton);

    this.form = node("form", "reject-form");
    this.form.id = `${id}-reject`;
    this.form.hidden = true;
    const label = node("label", "", "Reason (optional; the model is told)");
    label.htmlFor = `${id}-reason`;
    this.reason = document.createElement("input");
    this.reason.id = `${id}-reason`;
    this.reason.maxLength = 2000; // the server's limit
    this.reason.autocomplete = "off";
    this.confirmButton = button("Reject", "reject");
    this.confirmButton.type = "submit";
    this.cancelButton = button("Cancel", "cancel");
    this.form.append(label, this.reason, this.confirmButton, this.cancelButton);

    this.status = node("p", "approval-status");
    this.status.setAttribute("role", "status");
    this.status.tabIndex = -1;
    this.element.append(this.actions, this.form, this.status);

    this.approveButton.addEventListener("click", () => this.send("approve", {}));
    this.rejectButton.addEventListener("click", () => this.openReason());
    this.cancelButton.addEventListener("click", () => this.closeReason());
    this.reason.addEventListener("keydown", (event) => {
      if (event.key === "Escape") {
        event.preventDefault();
        event.stopPropagation();
        this.closeReason();
      }
    });
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.send("reject", { reason: this.reason.value.trim() });
    });
  }

  openReason() {
    this.actions.hidden = true;
    this.form.hidden = false;
    this.rejectButton.setAttribute("aria-expanded", "true");
    this.reason.focus();
  }

  closeReason() {
    this.form.hidden = true;
    this.actions.hidden = false;
    this.rejectButton.setAttribute("aria-expanded", "false");
    this.rejectButton.focus();
  }

  send(verb, body) {
    this.call.deciding(verb);
    this.call.decide?.(this.call, verb, body);
  }

  /** `verb` while a decision is on its way (everything disabled), null to ask again. */
  setBusy(verb) {
    // Focus first: a focused button that becomes disabled drops focus to the page.
    if (verb && this.element.contains(document.activeElement)) this.status.focus();
    for (const control of [this.approveButton, this.rejectButton, this.reason, this.confirmButton, this.cancelButton]) {
      control.disabled = Boolean(verb);
    }
    this.status.textContent = verb === "approve" ? "Approving…" : verb === "reject" ? "Rejecting…" : "";
  }
}

function prettyJson(raw) {
  try {
    return JSON.stringify(typeof raw === "string" ? JSON.parse(raw) : raw, null, 2);
  } catch {
    return String(raw);
  }
}

function node(tag, className, text) {
  const element = document.createElement(tag);
  if (className) element.className = className;
  if (text !== undefined) element.textContent = text;
  return element;
}

function button(text, className) {
  const element = node("button", className, text);
  element.type = "button";
  return element;
}
