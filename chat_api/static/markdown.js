// A small, safe Markdown renderer for model and user text.
//
// Why build DOM nodes instead of an HTML string: text only ever enters the page through
// `document.createTextNode` / `textContent`, so nothing a model or a user writes can become
// markup — `<script>` or `<img onerror=…>` stays visible text. There is no innerHTML here.
//
// Supported (what chat replies use): paragraphs, line breaks, ``` fenced code ```, `inline
// code`, **bold**, *italic* / _italic_, headings (#), bulleted and numbered lists, and
// [links](https://…) with http(s) targets only. Anything else is shown as typed.
// It is called again on the whole text at every streamed delta, so it must tolerate
// half-written syntax: an unclosed fence renders the rest as code.

const FENCE = /^\s*```(.*)$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const SAFE_URL = /^https?:\/\/[^\s]+$/i;

/** Render Markdown `text` into a DocumentFragment of safe nodes. */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  const lines = String(text ?? "").replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (FENCE.test(line)) {
      i = renderFence(lines, i, fragment);
    } else if (HEADING.test(line)) {
      const [, hashes, body] = line.match(HEADING);
      fragment.append(element(`h${Math.min(hashes.length + 2, 6)}`, inline(body)));
      i += 1;
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      i = renderList(lines, i, fragment);
    } else if (line.trim() === "") {
      i += 1;
    } else {
      i = renderParagraph(lines, i, fragment);
    }
  }
  return fragment;
}

function renderFence(lines, start, into) {
  const language = lines[start].match(FENCE)[1].trim();
  const body = [];
  let i = start + 1;
  while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) {
    body.push(lines[i]);
    i += 1;
  }
  const code = element("code", [document.createTextNode(body.join("\n"))]);
  if (/^[\w+-]{1,30}$/.test(language)) code.dataset.language = language;
  into.append(element("pre", [code]));
  return i + 1; // past the closing fence (or the end, if the model has not written it yet)
}

function renderList(lines, start, into) {
  const ordered = NUMBERED.test(lines[start]) && !BULLET.test(lines[start]);
  const pattern = ordered ? NUMBERED : BULLET;
  const list = document.createElement(ordered ? "ol" : "ul");
  if (ordered) list.start = Number(lines[start].match(NUMBERED)[1]);
  let i = start;
  while (i < lines.length && pattern.test(lines[i])) {
    const match = lines[i].match(pattern);
    list.append(element("li", inline(ordered ? match[2] : match[1])));
    i += 1;
  }
  into.append(list);
  return i;
}

function renderParagraph(lines, start, into) {
  const paragraph = document.createElement("p");
  let i = start;
  while (
    i < lines.length &&
    lines[i].trim() !== "" &&
    !FENCE.test(lines[i]) &&
    !HEADING.test(lines[i]) &&
    !(i > start && (BULLET.test(lines[i]) || NUMBERED.test(lines[i])))
  ) {
    if (i > start) paragraph.append(document.createElement("br"));
    paragraph.append(...inline(lines[i]));
    i += 1;
  }
  into.append(paragraph);
  return i;
}

// Inline syntax, earliest match first. Code spans win over everything inside them.
const INLINE = [
  { kind: "code", pattern: /`([^`\n]+)`/ },
  { kind: "link", pattern: /\[([^\]\n]+)\]\(([^)\s]+)\)/ },
  { kind: "strong", pattern: /\*\*([^*\n]+?)\*\*|__([^_\n]+?)__/ },
  { kind: "em", pattern: /\*([^*\n]+?)\*|(?<![\w])_([^_\n]+?)_(?![\w])/ },
];

/** Inline Markdown of one line as an array of safe nodes. */
function inline(text) {
  const nodes = [];
  let rest = text;
  while (rest) {
    const found = earliestMatch(rest);
    if (!found) {
      nodes.push(document.createTextNode(rest));
      break;
    }
    const { kind, match } = found;
    if (match.index > 0) nodes.push(document.createTextNode(rest.slice(0, match.index)));
    nodes.push(inlineNode(kind, match));
    rest = rest.slice(match.index + match[0].length);
  }
  return nodes;
}

function earliestMatch(text) {
  let best = null;
  for (const { kind, pattern } of INLINE) {
    const match = text.match(pattern);
    if (match && (best === null || match.index < best.match.index)) best = { kind, match };
  }
  return best;
}

function inlineNode(kind, match) {
  if (kind === "code") return element("code", [document.createTextNode(match[1])]);
  if (kind === "link") return linkNode(match[1], match[2], match[0]);
  return element(kind, inline(match[1] ?? match[2]));
}

function linkNode(label, url, original) {
  // Only http(s): `javascript:`, `data:` and relative targets are shown as plain text.
  if (!SAFE_URL.test(url)) return document.createTextNode(original);
  const link = element("a", inline(label));
  link.href = url;
  link.target = "_blank";
  link.rel = "noopener noreferrer nofollow";
  return link;
}

function element(tag, children) {
  const node = document.createElement(tag);
  node.append(...children);
  return node;
}
