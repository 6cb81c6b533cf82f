// "What chatmem remembers": the person's memory items in a dialog (list, search, correct,
// forget, remember something new), and the open conversation's two memory switches.
//
// Everything goes through /v1/memory/items and PATCH /v1/conversations/{id}; every change
// is committed by the server before it answers, so the next reply already uses it. Forget
// asks once more inline (no browser confirm()): forgetting cannot be undone.

import { api, describe, withAuth } from "./connection.js";

const $ = (id) => document.getElementById(id);
const PAGE_SIZE = 30;

export class MemoryView {
  constructor() {
    this.ui = {
      open: $("open-memory"),
      dialog: $("memory-dialog"),
      close: $("memory-close"),
      searchForm: $("memory-search"),
      query: $("memory-query"),
      clear: $("memory-clear"),
      rememberForm: $("memory-remember"),
      fact: $("memory-fact"),
      list: $("memory-list"),
      more: $("memory-more"),
      status: $("memory-status"),
    };
    this.nextCursor = null;
    this.query = "";
    const ui = this.ui;
    ui.open.addEventListener("click", () => this.open());
    ui.close.addEventListener("click", () => ui.dialog.close());
    ui.more.addEventListener("click", () => this.load(this.nextCursor));
    ui.searchForm.addEventListener("submit", (event) => {
      event.preventDefault();
      this.query = ui.query.value.trim();
      this.load();
    });
    ui.clear.addEventListener("click", () => {
      ui.query.value = "";
      this.query = "";
      this.load();
    });
    ui.rememberForm.addEventListener("submit", (event) => {
      event.preventDefault();
      this.remember(ui.fact.value.trim());
    });
  }

  async open() {
    this.ui.dialog.showModal();
    this.ui.query.focus();
    await this.load();
  }

  /** The first page (or, with a query, the best matches); `cursor` appends the next page. */
  async load(cursor = null) {
    const query = new URLSearchParams({ limit: String(PAGE_SIZE) });
    if (this.query) query.set("q", this.query);
    if (cursor) query.set("cursor", cursor);
    this.status(cursor ? "Loading more…" : "Loading…");
    try {
      const page = await withAuth(() => api.request("GET", `/v1/memory/items?${query}`));
      if (!cursor) this.ui.list.replaceChildren();
      for (const item of page.items) this.ui.list.append(this.itemElement(item));
      this.nextCursor = page.next_cursor;
      this.ui.more.hidden = !this.nextCursor;
      const count = this.ui.list.children.length;
      if (count === 0) this.status(this.query ? "Nothing remembered matches." : "Nothing is remembered yet.");
      else this.status(this.query ? `${count} best matches.` : `${count} remembered items shown.`);
      this.ui.dialog.dataset.loaded = "true"; // tests wait on this
    } catch (error) {
      this.status(`Could not load memory: ${describe(error)}`);
    }
  }

  async remember(text) {
    if (!text) return;
    try {
      const item = await withAuth(() => api.request("POST", "/v1/memory/items", { text }));
      this.ui.fact.value = "";
      this.ui.list.prepend(this.itemElement(item));
      this.status("Remembered.");
    } catch (error) {
      this.status(`Not remembered: ${describe(error)}`);
    }
  }

  itemElement(item) {
    const li = document.createElement("li");
    li.className = "memory-item";
    li.dataset.itemId = String(item.id);
    const text = document.createElement("p");
    text.className = "memory-text";
    text.textContent = item.text;
    const meta = document.createElement("p");
    meta.className = "memory-meta";
    meta.textContent = describeItem(item);
    const actions = document.createElement("div");
    actions.className = "memory-actions";
    const edit = button("Edit", "memory-edit");
    const forget = button("Forget", "memory-forget");
    actions.append(edit, forget);
    li.append(text, meta, actions);
    edit.addEventListener("click", () => this.startEdit(li, item, text));
    forget.addEventListener("click", () => this.askForget(li, item, actions));
    return li;
  }

  startEdit(li, item, text) {
    const form = document.createElement("form");
    form.className = "memory-edit-form";
    const label = document.createElement("label");
    label.className = "visually-hidden";
    label.textContent = "Corrected text";
    const area = document.createElement("textarea");
    area.maxLength = 2000;
    area.rows = 3;
    area.value = item.text;
    label.append(area);
    const save = button("Save", "memory-save");
    save.type = "submit";
    const cancel = button("Cancel", "memory-cancel");
    form.append(label, save, cancel);
    text.hidden = true;
    li.querySelector(".memory-actions").hidden = true;
    text.after(form);
    area.focus();
    const done = () => {
      form.remove();
      text.hidden = false;
      li.querySelector(".memory-actions").hidden = false;
    };
    cancel.addEventListener("click", () => {
      done();
      li.querySelector(".memory-edit").focus();
    });
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const corrected = area.value.trim();
      if (!corrected || corrected === item.text) return cancel.click();
      try {
        const saved = await withAuth(() => api.request("PATCH", `/v1/memory/items/${item.id}`, { text: corrected }));
        Object.assign(item, saved);
        text.textContent = saved.text;
        li.querySelector(".memory-meta").textContent = describeItem(saved);
        done();
        li.querySelector(".memory-edit").focus();
        this.status("Corrected. Replies use the new text from now on.");
      } catch (error) {
        this.status(`Not saved: ${describe(error)}`);
      }
    });
  }

  askForget(li, item, actions) {
    const ask = document.createElement("div");
    ask.className = "memory-confirm";
    const question = document.createElement("span");
    question.textContent = "Forget this for good?";
    const yes = button("Forget for good", "memory-forget-confirm");
    const no = button("Keep", "memory-keep");
    ask.append(question, yes, no);
    actions.hidden = true;
    actions.after(ask);
    no.focus();
    no.addEventListener("click", () => {
      ask.remove();
      actions.hidden = false;
      actions.querySelector(".memory-forget").focus();
    });
    yes.addEventListener("click", async () => {
      try {
        await withAuth(() => api.request("DELETE", `/v1/memory/items/${item.id}`));
        const next = li.nextElementSibling || li.previousElementSibling;
        li.remove();
        (next?.querySelector(".memory-edit") || this.ui.query).focus();
        this.status("Forgotten.");
      } catch (error) {
        this.status(`Not forgotten: ${describe(error)}`);
      }
    });
  }

  status(message) {
    this.ui.status.textContent = message;
  }
}

/**
 * One of the open conversation's memory switches, saved as a boolean field of the conversation:
 * "Remember this chat" (`remember`: what is said here reaches long-term memory) and "Use memory
 * in this chat" (`use_memory`: its replies recall long-term memory).
 */
export class ChatSwitch {
  constructor(id, field) {
    this.box = $(id);
    this.field = field;
    this.state = null;
    this.box.addEventListener("change", () => this.save());
  }

  show(state) {
    this.state = state;
    this.box.checked = state.conversation?.[this.field] !== false;
    this.box.disabled = false;
  }

  async save() {
    const state = this.state;
    if (!state) return;
    this.box.disabled = true;
    try {
      state.conversation = await withAuth(() =>
        api.request("PATCH", `/v1/conversations/${state.id}`, { [this.field]: this.box.checked }),
      );
    } catch (error) {
      this.box.checked = !this.box.checked; // not saved: show what is true
      $("notice").textContent = `Not changed: ${describe(error)}`;
    } finally {
      this.box.disabled = false;
    }
    if (this.state === state) this.box.checked = state.conversation?.[this.field] !== false;
  }
}

function describeItem(item) {
  const when = new Date(item.created_at).toLocaleDateString();
  const where = item.source === "stated" ? "you told chatmem" : `in “${item.conversation_title || "Untitled"}”`;
  const edited = item.edited_at ? " · corrected" : "";
  const score = item.score == null ? "" : ` · relevance ${item.score.toFixed(2)}`;
  return `${when} · ${where}${edited}${score}`;
}

function button(label, className) {
  const element = document.createElement("button");
  element.type = "button";
  element.className = className;
  element.textContent = label;
  return element;
}
