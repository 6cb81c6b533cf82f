// Clients that send the whole history with every message, on a long chat: the AI SDK's
// DefaultChatTransport (all `messages`) and AG-UI's HttpAgent (the whole thread, run and
// connect). A history over MAX_BODY_BYTES is answered; one over MAX_HISTORY_BODY_BYTES is the
// door's 413 before any stream, and nothing is written. The pytest side sets the limits and
// passes them as CHATMEM_OVER_BODY (a history size between the two) and CHATMEM_OVER_HISTORY.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { DefaultChatTransport, generateId } from 'ai';
import { HttpAgent, runHttpRequest, transformHttpEventStream } from '@ag-ui/client';
import { Chat } from './ai_sdk_chat.mjs';
import { BASE, call as callAs } from './chatmem.mjs';

const TOKEN = process.env.CHATMEM_TOKEN;
const OVER_BODY = Number(process.env.CHATMEM_OVER_BODY);
const OVER_HISTORY = Number(process.env.CHATMEM_OVER_HISTORY);
const BOUND = { timeout: 60_000 };
const call = (method, path, options = {}) => callAs(method, path, { token: TOKEN, ...options });

// A code answer of a few KB, as real chats have them.
const ANSWER = 'def double(x):\n    return x * 2  # and why it works\n'.repeat(70);
const QUESTION = 'Why does this fail, and how do I fix it? ';
const turnsFor = (bytes) => Math.ceil(bytes / (ANSWER.length + QUESTION.length + 200)) * 2; // question, answer

function uiHistory(bytes) {
  return Array.from({ length: turnsFor(bytes) }, (_, i) => ({
    id: generateId(),
    role: i % 2 ? 'assistant' : 'user',
    parts: [{ type: 'text', text: i % 2 ? ANSWER : QUESTION }],
  }));
}

const sentBytes = (messages) => JSON.stringify(messages).length;
const textOf = (message) => message.parts.filter((p) => p.type === 'text').map((p) => p.text).join('');

async function aiSdkChat(historyBytes) {
  const transport = new DefaultChatTransport({
    api: `${BASE}/v1/ai-sdk/chat`,
    headers: { Authorization: `Bearer ${TOKEN}` },
  });
  const chat = new Chat({ id: generateId(), transport, messages: uiHistory(historyBytes) });
  await chat.sendMessage({ text: 'the newest question' });
  return chat;
}

test('AI SDK: the whole history past MAX_BODY_BYTES gets its reply; past the history limit, a 413 and nothing stored', BOUND, async () => {
  const chat = await aiSdkChat(OVER_BODY);
  assert.ok(sentBytes(chat.messages) > OVER_BODY);
  assert.equal(chat.error, undefined);
  assert.equal(chat.status, 'ready');
  const reply = chat.messages.at(-1);
  assert.equal(reply.role, 'assistant');
  assert.match(textOf(reply), /the newest question/);

  const refused = await aiSdkChat(OVER_HISTORY);
  assert.equal(refused.status, 'error');
  assert.match(refused.error.message, /payload_too_large/);
  const stored = await call('GET', `/v1/ai-sdk/chat/${refused.id}/messages`);
  assert.equal(stored.status, 200);
  assert.deepEqual(stored.body, []);
});

// HttpAgent, plus connect (POST /v1/ag-ui/{threadId}/connect) through the client's own transforms.
class ChatmemAgent extends HttpAgent {
  constructor(config) {
    super({ url: `${BASE}/v1/ag-ui`, headers: { Authorization: `Bearer ${TOKEN}` }, threadId: randomUUID(), ...config });
  }
  connect(input) {
    const url = `${this.url}/${encodeURIComponent(this.threadId)}/connect`;
    return transformHttpEventStream(runHttpRequest(() => this.fetch(url, this.requestInit(input))));
  }
}

function agUiHistory(bytes) {
  return Array.from({ length: turnsFor(bytes) }, (_, i) => ({
    id: randomUUID(),
    role: i % 2 ? 'assistant' : 'user',
    content: i % 2 ? ANSWER : QUESTION,
  }));
}

async function agUiRun(historyBytes) {
  const agent = new ChatmemAgent({ initialMessages: agUiHistory(historyBytes) });
  agent.addMessage({ id: randomUUID(), role: 'user', content: 'the newest question' });
  let text = '';
  const result = await agent.runAgent({}, { onTextMessageContentEvent: ({ event }) => void (text += event.delta) });
  return { agent, text, result };
}

test('AG-UI: a run and a connect with the whole thread past MAX_BODY_BYTES are answered; past the history limit, a 413', BOUND, async () => {
  const { agent, text } = await agUiRun(OVER_BODY);
  assert.ok(sentBytes(agent.messages) > OVER_BODY);
  assert.match(text, /the newest question/);
  // A reloaded page joins the thread with everything it holds (nothing runs: the thread at once).
  const rejoined = new ChatmemAgent({ threadId: agent.threadId, initialMessages: agent.messages });
  await rejoined.connectAgent();
  assert.match(rejoined.messages.at(-1).content, /the newest question/);

  const threadId = randomUUID();
  const over = new ChatmemAgent({ threadId, initialMessages: agUiHistory(OVER_HISTORY) });
  over.addMessage({ id: randomUUID(), role: 'user', content: 'the newest question' });
  await assert.rejects(over.runAgent({}), (error) => /413/.test(String(error?.message ?? error)));
  const joinOver = new ChatmemAgent({ threadId, initialMessages: agUiHistory(OVER_HISTORY) });
  await assert.rejects(joinOver.connectAgent(), (error) => /413/.test(String(error?.message ?? error)));
  // The door's error shape, before any event; and the thread was never made.
  const body = { threadId, runId: randomUUID(), state: {}, messages: agUiHistory(OVER_HISTORY), tools: [], context: [], forwardedProps: {} };
  const answer = await call('POST', '/v1/ag-ui', { body });
  assert.equal(answer.status, 413);
  assert.match(answer.type, /application\/json/);
  assert.equal(answer.body.error.code, 'payload_too_large');
  assert.deepEqual((await call('GET', `/v1/ai-sdk/chat/${threadId}/messages`)).body, []);
});
