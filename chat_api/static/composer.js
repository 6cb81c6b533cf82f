// The message box's surroundings: Stop beside Send while a reply streams or waits for an
// approval, the line above the box that says the conversation waits for a person, and the
// notes a message gets when another reply holds the conversation (the server's on_busy).

const BUSY_NOTES = {
  reject: "A reply is still streaming; the server's policy is to refuse new messages until it ends.",
  interrupt: "A reply is still streaming; the server's policy stops it to answer this message.",
  enqueue: "Queued: the server will answer once the current reply has ended.",
};

// A reply waiting for an approval is busy until a person decides, which may take hours.
const WAITING_NOTES = {
  reject: "The reply above waits for your approval; the server refuses new messages until then.",
  interrupt: "The reply above waits for your approval; the server's policy ends it to answer this message.",
  enqueue: "The reply above waits for your approval; the server does not queue behind it.",
};

const $ = (id) => document.getElementById(id);
const ui = { composer: $("composer"), stop: $("stop"), status: $("composer-status") };

/** Stop shows while a reply streams or waits; the line above the box says when it waits. */
export function showComposerState(streaming, waiting, onBusy) {
  ui.stop.hidden = !streaming && !waiting;
  ui.composer.dataset.streaming = String(streaming);
  ui.composer.dataset.waiting = String(waiting);
  ui.status.hidden = !waiting;
  ui.status.textContent = !waiting
    ? ""
    : onBusy === "interrupt"
      ? "The reply above waits for your approval of a tool call. Approve or reject it, press Stop to " +
        "end the reply, or send a new message, which ends it."
      : "The reply above waits for your approval of a tool call. Approve or reject it, or press Stop " +
        "to end the reply; new messages are refused until then.";
}

/** The note on a message sent while another reply streams (or waits for an approval). */
export function busyNote(waiting, onBusy) {
  if (waiting) return WAITING_NOTES[onBusy] || WAITING_NOTES.reject;
  return BUSY_NOTES[onBusy] || "A reply is still streaming…";
}

/** Why the server refused a message with 409 conversation_busy. */
export function refusedAsBusy(waiting) {
  return waiting
    ? "Not sent: the reply above waits for your approval of a tool call. Approve or reject it, or Stop it, then send again."
    : "Not sent: a reply is still streaming (the server refuses new messages meanwhile). Stop it or wait, then send again.";
}
