// The open conversation's title in the header: shown (also as the tab's title), renamed with
// an inline form (Enter saves, Escape cancels), and taken from the first message when untitled.

import { api, describe, showBanner, withAuth } from "./connection.js";

const $ = (id) => document.getElementById(id);
const ui = { title: $("chat-title"), rename: $("rename"), form: $("rename-form"), input: $("rename-input") };

export class TitleBar {
  /** `current()` is the open conversation's state; `onSaved()` runs after a title was saved. */
  constructor({ current, onSaved }) {
    this.current = current;
    this.onSaved = onSaved;
    ui.rename.addEventListener("click", () => this.startRename());
    ui.form.addEventListener("submit", async (event) => {
      event.preventDefault();
      this.endRename();
      const state = this.current();
      if (state) await this.save(state, ui.input.value.trim());
    });
    ui.input.addEventListener("keydown", (event) => {
      if (event.key === "Escape") this.endRename();
    });
  }

  show(title) {
    ui.title.textContent = title || "Untitled";
    document.title = `${title || "Untitled"} — chatmem`;
  }

  startRename() {
    const state = this.current();
    if (!state) return;
    ui.input.value = state.conversation?.title || "";
    ui.form.hidden = false;
    ui.title.hidden = true;
    ui.rename.hidden = true;
    ui.input.focus();
    ui.input.select();
  }

  endRename() {
    ui.form.hidden = true;
    ui.title.hidden = false;
    ui.rename.hidden = false;
    ui.rename.focus();
  }

  /** Rename the conversation of `state`; shown if it is still the open one. */
  async save(state, title) {
    try {
      state.conversation = await withAuth(() => api.renameConversation(state.id, title));
      if (this.current() === state) this.show(state.conversation.title);
      await this.onSaved();
    } catch (error) {
      showBanner(`Could not rename: ${describe(error)}`);
    }
  }

  /** An untitled conversation is named after its first message (the person can rename it). */
  async fromFirstMessage(state, text) {
    const title = text.replace(/\s+/g, " ").trim().slice(0, 60);
    if (!title || state.conversation?.title || state.titling) return;
    state.titling = true;
    await this.save(state, title);
  }
}
