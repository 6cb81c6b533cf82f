// Versions of a message: where a conversation's branches diverge, and the small switcher
// ("‹ 2 / 3 ›") shown on the first message that differs.
//
// Branches come from GET …/branches: each has a fork point (`parent_branch_id`, `fork_seq`)
// and its history is the parent's turns up to `fork_seq`, then its own. The versions at one
// fork point are the parent's line (the parent, or a branch that goes on with its turns past
// that point) and every branch forked there; they differ from the first turn after
// `fork_seq` on. Regenerating a reply forks just after its user message, editing a message
// just before it; the server forks from the nearest branch with turns of its own there, so
// versions share a fork point. In a fork of another conversation that parent may be the
// original's branch: not listed, but the fork's own branches that go on past it stand for it.

/**
 * The groups of versions the active branch's history passes through: `[{turn, key, index,
 * targets}]`, where `turn` is the first differing turn shown, `targets[i]` the branch to
 * activate to show version i, and `index` the version shown now.
 */
export function versionGroups(branchList, turns) {
  const byId = new Map(branchList.items.map((branch) => [branch.id, branch]));
  const limits = lineageLimits(byId, branchList.active_branch_id);
  const forks = new Map(); // "parent:fork_seq" -> branches forked there, oldest first
  for (const branch of branchList.items) {
    if (!branch.parent_branch_id) continue; // the conversation's first branch
    const key = `${branch.parent_branch_id}:${branch.fork_seq}`;
    if (!forks.has(key)) forks.set(key, []);
    forks.get(key).push(branch);
  }
  const groups = [];
  for (const [key, children] of forks) {
    const parentId = children[0].parent_branch_id;
    const seq = children[0].fork_seq;
    const parentLine = continuers(byId, parentId, seq).filter((b) => !children.includes(b));
    const lines = parentLine.length ? [parentLine, ...children.map((c) => [c])] : children.map((c) => [c]);
    if (lines.length < 2) continue;
    for (const line of lines) line.push(...continuers(byId, line[0].id, seq).filter((b) => !line.includes(b)));
    // The version shown: a branch forked here that is in the active lineage, else the parent's
    // line when the active history goes on with the parent's turns past the fork point.
    let index = children.findIndex((child) => limits.has(child.id));
    if (index >= 0) index += lines.length - children.length;
    else if (parentLine.length && (limits.get(parentId) ?? -1) > seq) index = 0;
    const first = turns.find((turn) => turn.seq > seq);
    if (index < 0 || !first) continue;
    // Coming back to a version shows its newest line of history, not its oldest.
    const targets = lines.map((line) => line.reduce((a, b) => (b.created_at > a.created_at ? b : a)).id);
    groups.push({ turn: first, key, index, targets });
  }
  return groups;
}

/** Branch id -> the highest seq of its turns in the active history (Infinity for the active one). */
function lineageLimits(byId, activeId) {
  const limits = new Map();
  let branch = byId.get(activeId);
  let limit = Infinity;
  while (branch && !limits.has(branch.id)) {
    limits.set(branch.id, limit);
    limit = Math.min(limit, branch.fork_seq);
    if (branch.parent_branch_id && !byId.has(branch.parent_branch_id)) limits.set(branch.parent_branch_id, limit);
    branch = byId.get(branch.parent_branch_id);
  }
  return limits;
}

/** The listed branches that go on with branch `id`'s turns past `seq`: itself, or forked from it later. */
function continuers(byId, id, seq) {
  const found = [];
  const self = byId.get(id);
  if (self && (self.head_seq ?? 0) > seq) found.push(self);
  for (const branch of byId.values()) {
    let child = branch;
    for (let depth = 0; depth < byId.size && child; depth++) {
      if (child.parent_branch_id === id) {
        if (child.fork_seq > seq) found.push(branch);
        break;
      }
      child = byId.get(child.parent_branch_id);
    }
  }
  return found;
}

/** The switcher for one group: ‹ and › call `onSwitch(-1 | 1)` for the version before or after. */
export function versionSwitcher(group, onSwitch) {
  const element = document.createElement("div");
  element.className = "version-switcher";
  element.dataset.group = group.key;
  element.setAttribute("role", "group");
  element.setAttribute("aria-label", "Versions of this message");
  const count = group.targets.length;
  const button = (step, text, label) => {
    const node = document.createElement("button");
    node.type = "button";
    node.className = step < 0 ? "version-previous" : "version-next";
    node.textContent = text;
    node.setAttribute("aria-label", label);
    node.dataset.branchAction = "switch";
    const target = group.index + step;
    node.dataset.edge = String(target < 0 || target >= count);
    if (node.dataset.edge === "false") node.addEventListener("click", () => onSwitch(step));
    return node;
  };
  const position = document.createElement("span");
  position.className = "version-position";
  position.textContent = `${group.index + 1} / ${count}`;
  position.setAttribute("aria-label", `version ${group.index + 1} of ${count}`);
  element.append(button(-1, "‹", "Previous version"), position, button(1, "›", "Next version"));
  return element;
}

/** Enable or disable every branch action on the page (disabled while a reply streams or waits). */
export function enableBranchActions(root, enabled) {
  for (const node of root.querySelectorAll("[data-branch-action]")) {
    node.disabled = !enabled || node.dataset.edge === "true";
  }
}

/** After a switch, focus the same control of the redrawn switcher (or its other arrow at an end). */
export function focusSwitcher(root, key, step) {
  const switcher = [...root.querySelectorAll(".version-switcher")].find((s) => s.dataset.group === key);
  if (!switcher) return false;
  const same = switcher.querySelector(step < 0 ? ".version-previous" : ".version-next");
  const other = switcher.querySelector(step < 0 ? ".version-next" : ".version-previous");
  (same.disabled ? other : same).focus();
  return true;
}
