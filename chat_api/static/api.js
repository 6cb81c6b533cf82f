// The backend, as the page uses it: authenticated JSON calls and SSE streams over fetch.
//
// Why fetch and not EventSource: sending a message is a POST with a JSON body and an
// Authorization header, which EventSource cannot do. The same reader serves the resume
// endpoint (GET /v1/turns/{id}/events?after=N), so live and resumed streams share one path.

const TOKEN_KEY = "chatmem.token";

/** An HTTP error with the backend's machine-readable body ({error: {code, message, details}}). */
export class ApiError extends Error {
  constructor(status, body) {
    const error = body?.error ?? {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || "http_error";
    this.details = error.details || {};
  }
}

/** The server could not be reached at all (network down, server stopped). */
export class NetworkError extends Error {}

export class Api {
  constructor() {
    this.token = null;
  }

  /** Find a token: the embedded installation hands one out; otherwise the one the person gave. */
  async loadToken() {
    const config = await this.request("GET", "/ui/config", undefined, { auth: false });
    this.config = config;
    this.token = config.token || localStorage.getItem(TOKEN_KEY);
    return { token: this.token, config };
  }

  rememberToken(token) {
    this.token = token;
    localStorage.setItem(TOKEN_KEY, token);
  }

  forgetToken() {
    this.token = null;
    localStorage.removeItem(TOKEN_KEY);
  }

  headers(extra = {}) {
    const headers = { Accept: "application/json", ...extra };
    if (this.token) headers.Authorization = `Bearer ${this.token}`;
    return headers;
  }

  /** A JSON call; throws ApiError for 4xx/5xx and NetworkError when nothing answered. */
  async request(method, path, body, { auth = true, signal } = {}) {
    const init = { method, signal, headers: auth ? this.headers() : { Accept: "application/json" } };
    if (body !== undefined) {
      init.body = JSON.stringify(body);
      init.headers["Content-Type"] = "application/json";
    }
    const response = await send(path, init);
    if (response.status === 204) return null;
    const data = await response.json().catch(() => null);
    if (!response.ok) throw new ApiError(response.status, data);
    return data;
  }

  listConversations(cursor) {
    const query = new URLSearchParams({ limit: "30" });
    if (cursor) query.set("cursor", cursor);
    return this.request("GET", `/v1/conversations?${query}`);
  }

  createConversation(title) {
    return this.request("POST", "/v1/conversations", { title });
  }

  getConversation(id) {
    return this.request("GET", `/v1/conversations/${id}`);
  }

  renameConversation(id, title) {
    return this.request("PATCH", `/v1/conversations/${id}`, { title });
  }

  /** The active branch's whole history, oldest first: its pages (newest first) put together. */
  async listTurns(conversationId) {
    const pages = [];
    let cursor = null;
    do {
      const query = `limit=500${cursor ? `&cursor=${encodeURIComponent(cursor)}` : ""}`;
      const page = await this.request("GET", `/v1/conversations/${conversationId}/turns?${query}`);
      pages.unshift(page.items);
      cursor = page.next_cursor;
    } while (cursor);
    return { items: pages.flat() };
  }

  getTurn(turnId) {
    return this.request("GET", `/v1/turns/${turnId}`);
  }

  stopReply(turnId) {
    return this.request("POST", `/v1/turns/${turnId}/stop`);
  }

  /**
   * Send a message and stream the reply: calls onEvent({id, event, data}) per SSE event.
   * No on_busy is sent, so the server's ON_BUSY_DEFAULT decides what happens while another
   * reply streams. The Idempotency-Key makes a retry after a network failure safe: the
   * server re-attaches to the reply the first attempt started instead of starting another.
   */
  async sendMessage(conversationId, content, idempotencyKey, onEvent, signal) {
    const response = await send(`/v1/conversations/${conversationId}/messages`, {
      method: "POST",
      signal,
      headers: this.headers({
        "Content-Type": "application/json",
        Accept: "text/event-stream",
        "Idempotency-Key": idempotencyKey,
      }),
      // on_disconnect=continue: closing or reloading the tab must not stop the reply.
      body: JSON.stringify({ content, stream: true, on_disconnect: "continue" }),
    });
    await readEvents(response, onEvent);
  }

  listBranches(conversationId) {
    return this.request("GET", `/v1/conversations/${conversationId}/branches`);
  }

  activateBranch(conversationId, branchId) {
    return this.request("POST", `/v1/conversations/${conversationId}/branches/${branchId}/activate`);
  }

  /**
   * Answer the last reply's user message again (`turnId`: a turn of that reply) on a new
   * branch of the conversation; the new reply streams like sendMessage's. The conversation is
   * named because a fork shares turns with its original: the turn's own would be branched.
   * on_busy=reject: a version is never made by stopping a reply that streams.
   */
  regenerate(conversationId, turnId, idempotencyKey, onEvent, signal) {
    const body = { conversation_id: conversationId };
    return this.startBranch(`/v1/turns/${turnId}/regenerate`, body, idempotencyKey, onEvent, signal);
  }

  /** Replace a user message (`turnId`) with `content` on a new branch, and stream its reply. */
  editMessage(conversationId, turnId, content, idempotencyKey, onEvent, signal) {
    const body = { conversation_id: conversationId, content };
    return this.startBranch(`/v1/turns/${turnId}/edit`, body, idempotencyKey, onEvent, signal);
  }

  async startBranch(path, body, idempotencyKey, onEvent, signal) {
    const response = await send(path, {
      method: "POST",
      signal,
      headers: this.headers({
        "Content-Type": "application/json",
        Accept: "text/event-stream",
        "Idempotency-Key": idempotencyKey,
      }),
      body: JSON.stringify({ ...body, stream: true, on_busy: "reject", on_disconnect: "continue" }),
    });
    await readEvents(response, onEvent);
  }

  /**
   * Approve or reject (`verb`) a tool call that waits for a person; the reply goes on in the
   * response's SSE events (from the decision on, with the reply's next event ids).
   */
  async decideToolCall(turnId, callId, verb, body, onEvent, signal) {
    const path = `/v1/turns/${turnId}/tool_calls/${encodeURIComponent(callId)}/${verb}`;
    const response = await send(path, {
      method: "POST",
      signal,
      headers: this.headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
      body: JSON.stringify({ ...body, stream: true }),
    });
    await readEvents(response, onEvent);
  }

  /** Follow a reply's events after event id `after` (replay, then live until it ends). */
  async followReply(turnId, after, onEvent, signal) {
    const response = await send(`/v1/turns/${turnId}/events?after=${after}`, {
      method: "GET",
      signal,
      headers: this.headers({ Accept: "text/event-stream" }),
    });
    await readEvents(response, onEvent);
  }
}

async function send(path, init) {
  try {
    return await fetch(path, init);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new NetworkError("the server cannot be reached");
  }
}

async function readEvents(response, onEvent) {
  if (!response.ok) {
    throw new ApiError(response.status, await response.json().catch(() => null));
  }
  try {
    await parseEventStream(response.body, onEvent);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    // A stream cut in the middle (network down, server restarting) is resumable.
    throw new NetworkError("the stream was interrupted");
  }
}

/**
 * Parse a text/event-stream body as the SSE spec says: lines end with CRLF, LF or CR,
 * a blank line dispatches the event, lines starting with ':' are comments (pings).
 */
export async function parseEventStream(body, onEvent) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = { id: null, event: "message", data: [] };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let match;
    // A trailing lone '\r' may be half of a CRLF split across chunks: wait for more.
    while ((match = buffer.match(/\r\n|\n|\r(?!$)/))) {
      const line = buffer.slice(0, match.index);
      buffer = buffer.slice(match.index + match[0].length);
      if (line === "") {
        if (event.data.length) dispatch(event, onEvent);
        event = { id: null, event: "message", data: [] };
      } else if (!line.startsWith(":")) {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const raw = colon < 0 ? "" : line.slice(colon + 1);
        const value = raw.startsWith(" ") ? raw.slice(1) : raw;
        if (field === "id") event.id = Number(value);
        else if (field === "event") event.event = value;
        else if (field === "data") event.data.push(value);
      }
    }
  }
}

function dispatch(event, onEvent) {
  const text = event.data.join("\n");
  let data;
  try {
    data = JSON.parse(text);
  } catch {
    data = text;
  }
  onEvent({ id: event.id, event: event.event, data });
}
