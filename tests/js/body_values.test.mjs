// Bodies of very many tiny values, well within MAX_HISTORY_BODY_BYTES, from the clients that send
// the whole history with every message: the AI SDK's DefaultChatTransport and AG-UI's HttpAgent.
// 100,000 one-letter messages held every stream of the process while the door parsed and
// validated them, and were then answered. Past MAX_BODY_VALUES the door refuses the body before
// any stream, nothing stored; a long chat of tool calls (~170,000 values in 7.5 MB) is answered.
// The pytest side passes CHATMEM_MAX_BODY_VALUES.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { DefaultChatTransport, generateId } from 'ai';
import { HttpAgent, runHttpRequest, transformHttpEventStream } from '@ag-ui/client';
import { Chat } from './ai_sdk_chat.mjs';
import { BASE, call as callAs } from './chatmem.mjs';

const TOKEN = process.env.CHATMEM_TOKEN;
const MAX_VALUES = Number(process.env.CHATMEM_MAX_BODY_VALUES);
const TINY = 100_000;
const BOUND = { timeout: 60_000 };
const call = (method, path, options = {}) => callAs(method, path, { token: TOKEN, ...options });
const textOf = (message) => message.parts.filter((p) => p.type === 'text').map((p) => p.text).join('');

function aiSdkChat(messages) {
  const transport = new DefaultChatTransport({
    api: `${BASE}/v1/ai-sdk/chat`,
    headers: { Authorization: `Bearer ${TOKEN}` },
  });
  return new Chat({ id: generateId(), transport, messages });
}

const tinyUiMessages = (n) => Array.from({ length: n }, (_, i) => ({ id: `m${i}`, role: 'user', parts: [{ type: 'text', text: 'a' }] }));

// An agent's chat as useChat keeps it: each answer a search and its five results, then text.
function toolChat(bytes) {
  const results = Array.from({ length: 5 }, (_, i) => ({ title: `Result ${i} `.repeat(4), url: `https://example.com/${'p'.repeat(30)}`, snippet: 's'.repeat(200) }));
  const exchange = () => [
    { id: generateId(), role: 'user', parts: [{ type: 'text', text: 'q'.repeat(200) }] },
    {
      id: generateId(),
      role: 'assistant',
      parts: [
        { type: 'step-start' },
        { type: 'tool-search', toolCallId: `call_${generateId()}`, state: 'output-available', input: { query: 'weather paris' }, output: { results } },
        { type: 'text', text: 'a'.repeat(1500), state: 'done' },
      ],
    },
  ];
  const size = JSON.stringify(exchange()).length;
  return Array.from({ length: Math.floor(bytes / size) }, exchange).flat();
}

test('AI SDK: 100,000 tiny messages are refused before any stream, nothing stored; a long chat of tool calls is answered', BOUND, async () => {
  const refused = aiSdkChat(tinyUiMessages(TINY));
  await refused.sendMessage({ text: 'the newest question' });
  assert.equal(refused.status, 'error');
  assert.match(refused.error.message, /json_out_of_bounds/);
  assert.match(refused.error.message, new RegExp(`more than ${MAX_VALUES} JSON values`));
  assert.deepEqual((await call('GET', `/v1/ai-sdk/chat/${refused.id}/messages`)).body, []);

  const history = toolChat(7_500_000);
  const chat = aiSdkChat(history);
  await chat.sendMessage({ text: 'the newest question' });
  assert.equal(chat.error, undefined);
  assert.equal(chat.status, 'ready');
  assert.match(textOf(chat.messages.at(-1)), /the newest question/);
});

class ChatmemAgent extends HttpAgent {
  constructor(config) {
    super({ url: `${BASE}/v1/ag-ui`, headers: { Authorization: `Bearer ${TOKEN}` }, threadId: randomUUID(), ...config });
  }
  connect(input) {
    const url = `${this.url}/${encodeURIComponent(this.threadId)}/connect`;
    return transformHttpEventStream(runHttpRequest(() => this.fetch(url, this.requestInit(input))));
  }
}

const tinyAgUiMessages = (n) => Array.from({ length: n }, (_, i) => ({ id: `m${i}`, role: 'user', content: 'a' }));

test('AG-UI: a run and a connect with 100,000 tiny messages are refused before any event, nothing stored', BOUND, async () => {
  const threadId = randomUUID();
  const agent = new ChatmemAgent({ threadId, initialMessages: tinyAgUiMessages(TINY) });
  agent.addMessage({ id: randomUUID(), role: 'user', content: 'the newest question' });
  await assert.rejects(agent.runAgent({}), (error) => /422/.test(String(error?.message ?? error)));
  const joining = new ChatmemAgent({ threadId, initialMessages: tinyAgUiMessages(TINY) });
  await assert.rejects(joining.connectAgent(), (error) => /422/.test(String(error?.message ?? error)));
  // The door's error shape, before any event; and the thread was never made.
  const body = { threadId, runId: randomUUID(), state: {}, messages: tinyAgUiMessages(TINY), tools: [], context: [], forwardedProps: {} };
  const answer = await call('POST', '/v1/ag-ui', { body });
  assert.equal(answer.status, 422);
  assert.match(answer.type, /application\/json/);
  assert.equal(answer.body.error.code, 'json_out_of_bounds');
  assert.equal(answer.body.error.details.max_values, MAX_VALUES);
  assert.deepEqual((await call('GET', `/v1/ai-sdk/chat/${threadId}/messages`)).body, []);
});
