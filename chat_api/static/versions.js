// What the person does with versions of a conversation: Regenerate the last reply, Edit a
// message, switch between versions. Regenerate and edit start a reply on a new branch through
// the page's one reply path (`streamReply`); what followed the message gives way to the new
// branch's once the server accepts. A switch activates a branch and draws the stored history
// again. All of them wait while a reply streams or waits for an approval (the server says
// 409 conversation_busy otherwise); a refusal is said plainly and the conversation re-read.

import { ApiError, NetworkError } from "./api.js";
import { focusSwitcher, versionGroups, versionSwitcher } from "./branches.js";
import { api, describe, showBanner, withAuth } from "./connection.js";

/** A regenerate, edit or switch cannot start now (something streams, waits, or is on its way). */
export function isBusy(state) {
  return state.pending || state.live.size > 0 || state.waiting.size > 0;
}

export class Versions {
  /**
   * `page`: `{messages, input, current(), streamReply(state, request, onStarted),
   * open(id, focus), update(), say(text), userMessage(state, text, turnId)}`.
   */
  constructor(page) {
    this.page = page;
  }

  /** Answer the last reply's message again; the new reply takes the old one's place (kept on its branch). */
  regenerate(state, view) {
    const request = (key, onEvent, signal) => api.regenerate(state.id, view.replyId, key, onEvent, signal);
    return this.branchReply(state, view.element, null, request, "Could not regenerate the reply");
  }

  /** Replace a message of the person with `text`: what follows it gives way to the new branch's. */
  edit(state, turnId, text) {
    const from = state.userMessages.get(turnId)?.element;
    const request = (key, onEvent, signal) => api.editMessage(state.id, turnId, text, key, onEvent, signal);
    if (from) return this.branchReply(state, from, text, request, "Could not edit the message");
  }

  async branchReply(state, from, text, request, failed) {
    const page = this.page;
    if (page.current() !== state || isBusy(state)) return;
    state.pending = true;
    page.update();
    const error = await page.streamReply(state, request, (started) => {
      state.pending = false;
      while (from.nextElementSibling) from.nextElementSibling.remove();
      from.remove();
      for (const [id, view] of state.views) if (!view.element.isConnected) state.views.delete(id);
      if (text !== null) page.messages.append(page.userMessage(state, text, started.user_turn_id).element);
      page.input.focus(); // the button pressed is gone; the person may write the next message
      page.say(text === null ? "Regenerating the reply." : "Message edited. The new reply is coming.");
    });
    state.pending = false;
    if (error) return this.problem(state, error, failed);
    await this.refresh(state);
  }

  /** Show the version `step` (-1 or 1) away in `group`: activate its branch, draw the history again. */
  async switchTo(state, group, step) {
    const page = this.page;
    if (page.current() !== state || isBusy(state)) return;
    state.pending = true;
    page.update();
    try {
      await withAuth(() => api.activateBranch(state.id, group.targets[group.index + step]));
    } catch (error) {
      state.pending = false;
      return this.problem(state, error, "Could not switch versions");
    }
    state.pending = false;
    // Focus stays on the switcher pressed, so the arrows can be pressed again.
    await page.open(state.id, () => focusSwitcher(page.messages, group.key, step));
    page.say(`Version ${group.index + step + 1} of ${group.targets.length} is shown.`);
  }

  /** Say why an action failed, and show the conversation as the server has it now. */
  async problem(state, error, failed) {
    let why = describe(error);
    if (error instanceof ApiError && error.code === "conversation_busy") {
      why =
        "a reply is streaming or waits for an approval in this conversation (perhaps in another tab). " +
        "Try again once it has ended.";
    } else if (error instanceof ApiError && error.status === 404) {
      why = "that message or version no longer exists.";
    } else if (error instanceof ApiError && error.status === 409) {
      why = "the conversation changed elsewhere.";
    }
    if (this.page.current() === state) await this.page.open(state.id);
    const shown = error instanceof NetworkError ? "" : " The conversation is shown as it is now.";
    showBanner(`${failed}: ${why}${shown}`);
    this.page.say(`${failed}: ${why}`);
  }

  /** Draw the switchers again from the stored turns and branches (after a new branch was made). */
  async refresh(state) {
    try {
      const [turns, branches] = await withAuth(() =>
        Promise.all([api.listTurns(state.id), api.listBranches(state.id)]),
      );
      if (this.page.current() === state) this.show(state, turns.items, branches);
    } catch {
      // Not reachable now: the switchers are drawn at the next load.
    }
  }

  /** Put a switcher on the first message that differs, wherever the history has versions. */
  show(state, turns, branches) {
    for (const slot of this.page.messages.querySelectorAll(".branch-slot")) slot.replaceChildren();
    for (const group of versionGroups(branches, turns)) {
      const { turn } = group;
      const owner =
        turn.role === "user" ? state.userMessages.get(turn.id) : state.views.get(turn.reply_id || turn.id);
      const switcher = versionSwitcher(group, (step) => this.switchTo(state, group, step));
      owner?.element.querySelector(".branch-slot").append(switcher);
    }
    this.page.update();
  }
}
