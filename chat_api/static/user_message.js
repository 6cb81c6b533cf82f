// One message of the person on screen: the text (safe Markdown) and a note under it that says
// when it was not sent, or how the server treats it while another reply is busy.

import { renderMarkdown } from "./markdown.js";

/** `{element, note(text, kind)}`: kind "info" or "error"; an empty text hides the note. */
export function userMessage(text) {
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
