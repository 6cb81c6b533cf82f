// The Responses API with the official `openai` npm package (`client.responses`), against a live chatmem.
// Started by tests/test_openai_js.py with the chat-completions suite (one server), which passes
// CHATMEM_URL and CHATMEM_KEY (an API key).
import assert from 'node:assert/strict';
import { test } from 'node:test';
import OpenAI from 'openai';
import { BASE, storedTurns as storedTurnsWith } from './chatmem.mjs';

const key = process.env.CHATMEM_KEY; // chatmem's own API accepts the same key
const MODEL = 'chatmem-demo';
const storedTurns = (conversationId) => storedTurnsWith(conversationId, key);
const client = new OpenAI({ baseURL: `${BASE}/openai/v1`, apiKey: key, maxRetries: 0, timeout: 30_000 });
const WEATHER = {
  type: 'function',
  name: 'get_weather',
  description: 'The weather in a city.',
  parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
  strict: false,
};


test('responses: streamed events are numbered and the stored reply is the text received', async () => {
  const { data: stream, response } = await client.responses
    .create({ model: MODEL, input: 'hello from node', stream: true })
    .withResponse();
  const conversationId = response.headers.get('x-chatmem-conversation-id');
  const events = [];
  for await (const event of stream) events.push(event);
  assert.deepEqual(
    events.map((e) => e.sequence_number),
    events.map((_, i) => i),
  );
  const last = events.at(-1);
  assert.equal(last.type, 'response.completed');
  const text = events
    .filter((e) => e.type === 'response.output_text.delta')
    .map((e) => e.delta)
    .join('');
  assert.equal(last.response.output_text ?? text, text);
  const turns = await storedTurns(conversationId);
  assert.equal(turns.at(-1).content, text);
  const again = await client.responses.retrieve(last.response.id);
  assert.equal(again.output_text, text);
});

test('responses: a function tool round trip chained by previous_response_id', async () => {
  const first = await client.responses.create({
    model: MODEL,
    input: 'What is the weather in Oslo?',
    tools: [WEATHER],
    tool_choice: { type: 'function', name: 'get_weather' },
  });
  const call = first.output.find((item) => item.type === 'function_call');
  assert.ok(call, 'no function_call item');
  assert.equal(call.name, 'get_weather');
  assert.deepEqual(Object.keys(JSON.parse(call.arguments)), ['city']);
  const second = await client.responses.create({
    model: MODEL,
    previous_response_id: first.id,
    input: [{ type: 'function_call_output', call_id: call.call_id, output: 'cold and clear' }],
    tools: [WEATHER],
  });
  assert.equal(second.status, 'completed');
  assert.match(second.output_text, /cold and clear/);
});

test('responses: aborting the stream stops the reply; the response reads incomplete with the text sent', async () => {
  const controller = new AbortController();
  const stream = await client.responses.create(
    { model: MODEL, input: '/long tell me a story', stream: true },
    { signal: controller.signal },
  );
  let received = '';
  let id = null;
  try {
    for await (const event of stream) {
      if (event.type === 'response.created') id = event.response.id;
      if (event.type === 'response.output_text.delta') received += event.delta;
      if (received.split(' ').length >= 12) controller.abort();
    }
  } catch (error) {
    assert.ok(error instanceof OpenAI.APIUserAbortError || error.name === 'AbortError', String(error));
  }
  const deadline = Date.now() + 20_000;
  let stopped = await client.responses.retrieve(id);
  while (stopped.status === 'in_progress') {
    assert.ok(Date.now() < deadline, 'the reply did not stop');
    await new Promise((resolve) => setTimeout(resolve, 50));
    stopped = await client.responses.retrieve(id);
  }
  assert.equal(stopped.status, 'incomplete');
  assert.ok(stopped.output_text.startsWith(received));
  const next = await client.responses.create({ model: MODEL, input: 'go on', previous_response_id: id });
  assert.equal(next.status, 'completed');
});

test('responses: background, resume from a sequence number, cancel', async () => {
  const started = await client.responses.create({ model: MODEL, input: '/long background story', background: true });
  assert.ok(['queued', 'in_progress'].includes(started.status));
  const head = [];
  const stream = await client.responses.retrieve(started.id, { stream: true });
  for await (const event of stream) {
    head.push(event);
    if (head.length === 6) break;
  }
  const tail = [];
  const resumed = await client.responses.retrieve(started.id, { stream: true, starting_after: 3 });
  for await (const event of resumed) {
    tail.push(event);
    if (tail.length === 2) break;
  }
  assert.deepEqual(tail, head.slice(4, 6));
  const cancelled = await client.responses.cancel(started.id);
  assert.equal(cancelled.status, 'cancelled');
});

test('responses: bad input raises the SDK error classes before any stream', async () => {
  await assert.rejects(
    client.responses.create({ model: MODEL, input: [{ type: 'nonsense' }], stream: true }),
    (error) => error instanceof OpenAI.BadRequestError && error.error?.param === 'input[0].type',
  );
  await assert.rejects(client.responses.retrieve('resp_00000000000000000000000000000000'), OpenAI.NotFoundError);
});
