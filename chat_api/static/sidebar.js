// The list of conversations: newest first, paged with the API's cursor, one button each.

export class Sidebar {
  /** `onOpen(id)` is called when the person picks a conversation. */
  constructor(api, { onOpen }) {
    this.api = api;
    this.onOpen = onOpen;
    this.list = document.getElementById("conversation-list");
    this.moreButton = document.getElementById("load-more");
    this.panel = document.getElementById("sidebar");
    this.toggleButton = document.getElementById("toggle-sidebar");
    this.currentId = null;
    this.nextCursor = null;
    this.moreButton.addEventListener("click", () => this.loadMore());
    this.toggleButton.addEventListener("click", () => this.setOpen(!this.isOpen()));
    this.panel.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && this.isOpen()) {
        this.setOpen(false);
        this.toggleButton.focus();
      }
    });
  }

  /** Reload the first page (after a create, a rename, or a reply that moved one to the top). */
  async refresh() {
    const page = await this.api.listConversations();
    this.list.replaceChildren();
    this.append(page);
    return page.items;
  }

  async loadMore() {
    if (!this.nextCursor) return;
    this.append(await this.api.listConversations(this.nextCursor));
  }

  append(page) {
    for (const conversation of page.items) this.list.append(this.item(conversation));
    this.nextCursor = page.next_cursor;
    this.moreButton.hidden = !this.nextCursor;
  }

  item(conversation) {
    const li = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.className = "conversation";
    button.dataset.conversationId = conversation.id;
    const title = document.createElement("span");
    title.className = "conversation-title";
    title.textContent = conversation.title || "Untitled";
    const meta = document.createElement("span");
    meta.className = "conversation-meta";
    const streaming = conversation.active_reply_id ? " · replying…" : "";
    meta.textContent = `${new Date(conversation.updated_at).toLocaleString()}${streaming}`;
    button.append(title, meta);
    if (conversation.id === this.currentId) button.setAttribute("aria-current", "page");
    button.addEventListener("click", () => {
      this.setOpen(false);
      this.onOpen(conversation.id);
    });
    li.append(button);
    return li;
  }

  markCurrent(id) {
    this.currentId = id;
    for (const button of this.list.querySelectorAll("button.conversation")) {
      if (button.dataset.conversationId === id) button.setAttribute("aria-current", "page");
      else button.removeAttribute("aria-current");
    }
  }

  // On a narrow screen the list is a drawer over the chat; on a wide one it is always shown.
  isOpen() {
    return this.panel.classList.contains("open");
  }

  setOpen(open) {
    this.panel.classList.toggle("open", open);
    this.toggleButton.setAttribute("aria-expanded", String(open));
    if (open) this.panel.querySelector("button")?.focus();
  }
}
