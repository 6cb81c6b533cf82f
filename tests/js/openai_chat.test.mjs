// The OpenAI-compatible API with the official `openai` npm package, against a live chatmem.
// Started by tests/test_openai_js.py, which passes CHATMEM_URL and CHATMEM_KEY (an API key).
import assert from 'node:assert/strict';
import { test } from 'node:test';
import OpenAI from 'openai';
import { BASE, storedTurns as storedTurnsWith } from './chatmem.mjs';

const key = process.env.CHATMEM_KEY; // chatmem's own API accepts the same key
const MODEL = 'chatmem-demo';
const storedTurns = (conversationId) => storedTurnsWith(conversationId, key);
const client = new OpenAI({ baseURL: `${BASE}/openai/v1`, apiKey: key, maxRetries: 0, timeout: 30_000 });

test('models lists the demo model', async () => {
  const models = [];
  for await (const model of client.models.list()) models.push(model.id);
  assert.deepEqual(models, [MODEL]);
});

test('streaming: chunks, usage, and the stored reply equals the text received', async () => {
  const { data: stream, response } = await client.chat.completions
    .create({
      model: MODEL,
      messages: [{ role: 'user', content: 'hello from node' }],
      stream: true,
      stream_options: { include_usage: true },
    })
    .withResponse();
  const conversationId = response.headers.get('x-chatmem-conversation-id');
  let text = '';
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.choices.length) {
      text += chunk.choices[0].delta.content ?? '';
      finish = chunk.choices[0].finish_reason ?? finish;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(finish, 'stop');
  assert.ok(usage && usage.completion_tokens > 0);
  assert.match(text, /hello from node/);
  const turns = await storedTurns(conversationId);
  assert.deepEqual(
    turns.map((t) => [t.role, t.status]),
    [
      ['user', 'completed'],
      ['assistant', 'completed'],
    ],
  );
  assert.equal(turns[1].content, text);
});

test('abort mid-reply: stored interrupted_by_user with the text received, next request accepted', async () => {
  const controller = new AbortController();
  const question = { role: 'user', content: '/long tell me a long story' };
  const { data: stream, response } = await client.chat.completions
    .create({ model: MODEL, messages: [question], stream: true }, { signal: controller.signal })
    .withResponse();
  const conversationId = response.headers.get('x-chatmem-conversation-id');
  let received = '';
  let finish = null;
  try {
    for await (const chunk of stream) {
      received += chunk.choices[0]?.delta.content ?? '';
      finish = chunk.choices[0]?.finish_reason ?? finish;
      if (received.split(' ').length >= 12) controller.abort();
    }
  } catch (error) {
    // Depending on where the abort lands, the SDK ends the iteration or raises its abort error.
    assert.ok(error instanceof OpenAI.APIUserAbortError || error.name === 'AbortError', String(error));
  }
  assert.ok(controller.signal.aborted);
  assert.equal(finish, null, 'the reply finished before the abort');
  const turns = await storedTurns(conversationId);
  const reply = turns.at(-1);
  assert.equal(reply.status, 'interrupted_by_user');
  assert.ok(reply.content.startsWith(received), `${reply.content} / ${received}`);
  assert.ok(reply.content.split(' ').length - received.split(' ').length <= 2);

  const next = await client.chat.completions
    .create({
      model: MODEL,
      messages: [question, { role: 'assistant', content: received }, { role: 'user', content: 'and then?' }],
    })
    .withResponse();
  assert.equal(next.response.headers.get('x-chatmem-conversation-id'), conversationId);
  assert.match(next.data.choices[0].message.content, /and then\?/);
});

test('bad input raises the SDK error classes', async () => {
  await assert.rejects(
    client.chat.completions.create({ model: 'gpt-4o', messages: [{ role: 'user', content: 'x' }] }),
    (error) => error instanceof OpenAI.NotFoundError && error.code === 'model_not_found',
  );
  await assert.rejects(
    client.chat.completions.create({ model: MODEL, messages: [] }),
    (error) => error instanceof OpenAI.BadRequestError && error.param === 'messages',
  );
});
