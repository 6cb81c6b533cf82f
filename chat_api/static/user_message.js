// One message of the person on screen: the text (safe Markdown), a note under it that says
// when it was not sent, or how the server treats it while another reply is busy, and, once
// the server knows the message (its turn id), an Edit action with an inline editor.

import { renderMarkdown } from "./markdown.js";

let editorCounter = 0;

/**
 * `{element, note(text, kind), setTurn(id)}`: kind "info" or "error"; an empty text hides the
 * note. `onEdit(turnId, text)` (optional) is called when the person saves an edited text.
 */
export function userMessage(text, { turnId = null, onEdit = null, attachments = [] } = {}) {
  const element = document.createElement("div");
  element.className = "message user";
  const bubble = document.createElement("div");
  bubble.className = "bubble markdown";
  bubble.append(renderMarkdown(text));
  if (attachments.length) bubble.append(attachmentList(attachments));
  const note = document.createElement("p");
  note.className = "message-note";
  note.hidden = true;
  const actions = document.createElement("div");
  actions.className = "message-actions";
  const slot = document.createElement("div");
  slot.className = "branch-slot";
  const editButton = document.createElement("button");
  editButton.type = "button";
  editButton.className = "edit-message";
  editButton.textContent = "Edit";
  editButton.setAttribute("aria-label", "Edit this message");
  editButton.dataset.branchAction = "edit";
  editButton.hidden = true;
  actions.append(slot, editButton);
  element.append(bubble, note, actions);

  let id = turnId;
  const editor = () => editForm(text, {
    save: (edited) => onEdit(id, edited),
    close: () => {
      form.remove();
      bubble.hidden = false;
      actions.hidden = false;
      editButton.focus();
    },
  });
  let form = null;
  editButton.addEventListener("click", () => {
    form = editor();
    bubble.hidden = true;
    actions.hidden = true;
    element.insertBefore(form, note);
    form.querySelector("textarea").focus();
  });
  const setTurn = (newId) => {
    id = newId;
    element.dataset.turnId = newId;
    editButton.hidden = !onEdit || !newId;
  };
  setTurn(id);
  return {
    element,
    note(text, kind = "info") {
      note.hidden = !text;
      note.textContent = text || "";
      note.dataset.kind = kind;
    },
    setTurn,
  };
}

/**
 * Images and files sent with the message (through the Responses API): an image sent as a
 * data: URL is shown (the page's CSP allows data: images, never another host), anything
 * else is named.
 */
function attachmentList(attachments) {
  const list = document.createElement("ul");
  list.className = "attachments";
  list.setAttribute("aria-label", "Attachments");
  for (const item of attachments) {
    const entry = document.createElement("li");
    if (item.type === "image" && String(item.url || "").startsWith("data:image/")) {
      const image = document.createElement("img");
      image.src = item.url;
      image.alt = "Attached image";
      entry.append(image);
    } else {
      entry.className = "attachment-chip";
      entry.textContent = item.type === "image" ? "Image (link)" : item.filename || "File";
    }
    list.append(entry);
  }
  return list;
}

/** The inline editor: a textarea, Save and Cancel; Enter saves, Shift+Enter adds a line, Escape cancels. */
function editForm(text, { save, close }) {
  const id = `edit-${++editorCounter}`;
  const form = document.createElement("form");
  form.className = "edit-form";
  const label = document.createElement("label");
  label.htmlFor = id;
  label.className = "visually-hidden";
  label.textContent = "Edited message";
  const input = document.createElement("textarea");
  input.id = id;
  input.rows = Math.min(8, Math.max(2, text.split("\n").length));
  input.maxLength = 100000;
  input.value = text;
  const problem = document.createElement("p");
  problem.className = "message-note";
  problem.dataset.kind = "error";
  problem.hidden = true;
  const saveButton = document.createElement("button");
  saveButton.type = "submit";
  saveButton.className = "send";
  saveButton.textContent = "Save";
  saveButton.dataset.branchAction = "save";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.textContent = "Cancel";
  cancel.addEventListener("click", close);
  const buttons = document.createElement("div");
  buttons.className = "edit-actions";
  buttons.append(saveButton, cancel);
  form.append(label, input, problem, buttons);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (saveButton.disabled) return; // a reply streams: the server would refuse it
    if (!input.value.trim()) {
      problem.hidden = false;
      problem.textContent = "A message cannot be empty.";
      input.focus();
      return;
    }
    save(input.value);
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Escape") {
      event.preventDefault();
      close();
    } else if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  return form;
}
