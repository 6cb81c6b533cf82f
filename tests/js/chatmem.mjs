// What every client suite needs from the live chatmem that the pytest side started: its URL,
// a plain call to chatmem's own API (to read back what was stored), and waiting for a condition.
// CHATMEM_URL, and CHATMEM_TOKEN or CHATMEM_KEY, come from the environment.
import assert from 'node:assert/strict';

export const BASE = process.env.CHATMEM_URL;

// A call to chatmem's own API; a body that is not JSON (an SSE stream) is returned as text.
export async function call(method, path, { token, body, raw, base = BASE } = {}) {
  const response = await fetch(`${base}${path}`, {
    method,
    headers: { Authorization: `Bearer ${token}`, 'content-type': 'application/json' },
    body: raw ?? (body === undefined ? undefined : JSON.stringify(body)),
  });
  const text = await response.text();
  let parsed = text || null;
  try {
    parsed = JSON.parse(text);
  } catch {
    // an SSE body, or none
  }
  return { status: response.status, type: response.headers.get('content-type'), body: parsed };
}

export async function until(condition, what, ms = 15_000) {
  const deadline = Date.now() + ms;
  while (!(await condition())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

// A conversation's stored turns once its reply has ended (none is still streaming).
export async function storedTurns(conversationId, token) {
  let items;
  await until(async () => {
    const { status, body } = await call('GET', `/v1/conversations/${conversationId}/turns`, { token });
    assert.equal(status, 200);
    items = body.items;
    return !items.some((t) => t.status === 'streaming');
  }, 'the reply to end', 20_000);
  return items;
}
