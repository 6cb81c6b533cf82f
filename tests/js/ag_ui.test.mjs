// AG-UI's own client (`@ag-ui/client`, pinned) against a live chatmem: run by tests/test_ag_ui_client.py.
//
// Every run goes through HttpAgent's pipeline, whose strict verifier rejects any event out
// of order (a content without its start, anything after RUN_FINISHED, …) and whose reducer
// builds `agent.messages`. Every response body is also saved to CHATMEM_CAPTURES, and the
// pytest side runs the ag-ui-validate conformance checker on each file. CHATMEM_URL and the
// tokens come from the environment.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { randomUUID } from 'node:crypto';
import { HttpAgent, runHttpRequest, transformHttpEventStream } from '@ag-ui/client';
import { BASE, call as callAs, until } from './chatmem.mjs';

// A second `chatmem serve` on the same database: stop and connect work from any replica.
const REPLICA = process.env.CHATMEM_REPLICA_URL;
const TOKEN = process.env.CHATMEM_TOKEN;
const OTHER_USER = process.env.CHATMEM_OTHER_USER_TOKEN;
const CAPTURES = process.env.CHATMEM_CAPTURES;
const BOUND = { timeout: 30_000 };
const LONG_ARGUMENTS = JSON.stringify({ amount: 3, to: 'carol '.repeat(80).trim() });

mkdirSync(CAPTURES, { recursive: true });
let captured = 0;

// fetch that hands the client the response and keeps a copy of its body for the validator.
function capturingFetch(name) {
  return async (url, init) => {
    const response = await fetch(url, init);
    if (!response.ok || !response.body) return response;
    const [forClient, forFile] = response.body.tee();
    const file = join(CAPTURES, `${String(++captured).padStart(3, '0')}-${name}.sse`);
    (async () => {
      const chunks = [];
      const reader = forFile.getReader();
      try {
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          chunks.push(Buffer.from(value));
        }
      } catch {
        // The client aborted: the capture holds what arrived.
      }
      writeFileSync(file, Buffer.concat(chunks));
    })();
    return new Response(forClient, { status: response.status, headers: response.headers });
  };
}

// HttpAgent, plus connect: chatmem's POST /v1/ag-ui/{threadId}/connect (CopilotKit's runtime
// has the same route) read through the client's own HTTP and SSE transforms.
class ChatmemAgent extends HttpAgent {
  constructor({ name, token = TOKEN, base = BASE, ...config } = {}) {
    const url = `${base}/v1/ag-ui`;
    super({ url, headers: { Authorization: `Bearer ${token}` }, fetch: capturingFetch(name), ...config });
    this.name = name;
  }
  // A connect after abortRun() needs a live signal of its own (runAgent makes one per run too).
  connectAgent(parameters, subscriber) {
    this.abortController = new AbortController();
    return super.connectAgent(parameters, subscriber);
  }
  connect(input) {
    const url = `${this.url}/${encodeURIComponent(this.threadId)}/connect`;
    return transformHttpEventStream(runHttpRequest(() => this.fetch(url, this.requestInit(input))));
  }
}

function newAgent(name, config = {}) {
  return new ChatmemAgent({ name, threadId: randomUUID(), ...config });
}

const user = (content) => ({ id: randomUUID(), role: 'user', content });

// What happened in one run, from the subscriber callbacks the client calls.
function recorder() {
  const seen = { events: [], outcome: undefined, interrupts: [], pending: [], memory: undefined, text: '' };
  return {
    seen,
    subscriber: {
      onEvent: ({ event }) => void seen.events.push(event.type),
      onCustomEvent: ({ event }) => {
        if (event.name === 'chatmem.memory') seen.memory = event.value;
      },
      onTextMessageContentEvent: ({ event }) => void (seen.text += event.delta),
      onRunFinishedEvent: (params) => {
        seen.outcome = params.outcome;
        if (params.outcome === 'interrupt') seen.interrupts = params.interrupts;
        if (params.outcome === 'success') seen.pending = params.pendingToolCallIds;
      },
      onRunErrorEvent: ({ event }) => void (seen.error = event),
    },
  };
}

async function run(agent, parameters = {}) {
  const { seen, subscriber } = recorder();
  const result = await agent.runAgent(parameters, subscriber);
  return { ...seen, result };
}

const call = (method, path, { token = TOKEN, ...rest } = {}) => callAs(method, path, { token, ...rest });

// The stored thread: chatmem's own record of it (the AI SDK view of the same conversation
// carries each reply's stored status).
async function stored(threadId, token = TOKEN) {
  const { status, body } = await call('GET', `/v1/ai-sdk/chat/${threadId}/messages`, { token });
  assert.equal(status, 200);
  return body;
}
const storedText = (message) => message.parts.filter((p) => p.type === 'text').map((p) => p.text).join('');

// The thread as connect's MESSAGES_SNAPSHOT gives it (a fresh agent: what a reloaded page gets).
async function snapshotOf(threadId, token = TOKEN) {
  const agent = new ChatmemAgent({ name: 'snapshot', threadId, token });
  await agent.connectAgent();
  return agent.messages;
}

// Messages as plain JSON (no undefined keys), for comparing what the client built with a snapshot.
const plain = (messages) => JSON.parse(JSON.stringify(messages));


const assistantText = (messages) =>
  messages.filter((m) => m.role === 'assistant').map((m) => m.content ?? '').join('');

// Each test has threads of its own, so they run at once: most of a test is waiting for the
// demo model's paced tokens, and the suite takes as long as its longest test, not their sum.
describe('chatmem over AG-UI', { concurrency: true }, () => {
  test('a plain run streams the answer and its memories, and the stored thread is what the client built', BOUND, async () => {
    const agent = newAgent('plain');
    agent.addMessage(user('hello from AG-UI'));
    const seen = await run(agent);
    assert.equal(seen.outcome, 'success');
    assert.deepEqual(seen.pending, []);
    assert.equal(seen.events[0], 'RUN_STARTED');
    assert.equal(seen.events.at(-1), 'RUN_FINISHED');
    assert.equal(seen.memory.query, 'hello from AG-UI');
    assert.ok(Array.isArray(seen.memory.items) && 'rewritten_query' in seen.memory);
    const [, assistant] = agent.messages;
    assert.equal(assistant.role, 'assistant');
    assert.match(assistant.content, /hello from AG-UI/);
    assert.deepEqual(plain(await snapshotOf(agent.threadId)), plain(agent.messages));
    const [, reply] = await stored(agent.threadId);
    assert.equal(reply.metadata.status, 'completed');
    assert.equal(storedText(reply), assistant.content);
  });

  test('a server tool call streams its call, its result and the answer after it', BOUND, async () => {
    const agent = newAgent('server-tool');
    agent.addMessage(user('what time is it?'));
    const seen = await run(agent);
    assert.equal(seen.outcome, 'success');
    assert.deepEqual(seen.pending, []);
    const [, step, result, answer] = agent.messages;
    assert.equal(step.toolCalls[0].function.name, 'current_time');
    assert.equal(result.role, 'tool');
    assert.equal(result.toolCallId, step.toolCalls[0].id);
    assert.ok(JSON.parse(result.content));
    assert.match(answer.content, /The tool answered/);
    assert.deepEqual(plain(await snapshotOf(agent.threadId)), plain(agent.messages));
  });

  test('the next run continues the same conversation, and the client keeps its message ids', BOUND, async () => {
    const agent = newAgent('history');
    const first = user('my name is Ada');
    agent.addMessage(first);
    await run(agent);
    const second = user('and what is my name?');
    agent.addMessage(second);
    const seen = await run(agent);
    assert.equal(seen.outcome, 'success');
    const thread = await stored(agent.threadId);
    assert.equal(thread.length, 4);
    assert.equal(thread[2].role, 'user');
    const snapshot = await snapshotOf(agent.threadId);
    assert.deepEqual(
      snapshot.filter((m) => m.role === 'user').map((m) => m.id),
      [first.id, second.id],
    );
    assert.deepEqual(plain(snapshot), plain(agent.messages));
  });

  test('stop mid-text, sent to another replica, ends the run cancelled with what was sent stored; the next run is answered', BOUND, async () => {
    const agent = newAgent('stop-text');
    agent.addMessage(user('/long tell me a long story'));
    const { seen, subscriber } = recorder();
    const running = agent.runAgent({}, subscriber);
    await until(() => seen.text.length > 60, 'some text');
    // Sent to the other replica: the stop reaches the process that runs the reply.
    const stop = await call('POST', `/v1/ag-ui/${agent.threadId}/stop`, { body: {}, base: REPLICA });
    assert.equal(stop.status, 200);
    assert.deepEqual(stop.body, { success: true });
    await running;
    assert.equal(seen.outcome, 'cancelled');
    assert.equal(seen.events.at(-1), 'RUN_FINISHED');
    const [, reply] = await stored(agent.threadId);
    assert.equal(reply.metadata.status, 'interrupted_by_user');
    assert.equal(storedText(reply), agent.messages[1].content);
    assert.equal(agent.messages[1].content, seen.text);
    assert.deepEqual(plain(await snapshotOf(agent.threadId)), plain(agent.messages));
    // A stop again is idempotent.
    assert.deepEqual((await call('POST', `/v1/ag-ui/${agent.threadId}/stop`)).body, { success: true });

    agent.addMessage(user('go on, briefly'));
    const next = await run(agent);
    assert.equal(next.outcome, 'success');
    assert.equal((await stored(agent.threadId))[3].metadata.status, 'completed');
  });

  test("a new thread's first run, stopped on another replica before its input was served, streamed to its end", BOUND, async () => {
    // The client picks the threadId and runId: the stop can come first. It was a 404; it is
    // kept for the thread's first run (202, not confirmed), and that run starts stopped.
    const agent = newAgent('stop-new-thread');
    const runId = randomUUID();
    const stop = await call('POST', `/v1/ag-ui/${agent.threadId}/stop`, { body: { runId }, base: REPLICA });
    assert.deepEqual([stop.status, stop.body], [202, { success: false }]);
    agent.addMessage(user('/long tell me a long story'));
    const first = await run(agent, { runId });
    assert.equal(first.outcome, 'cancelled');
    assert.equal(first.text, '');
    const [, reply] = await stored(agent.threadId);
    assert.equal(reply.metadata.status, 'interrupted_by_user');
    agent.addMessage(user('go on, briefly'));
    assert.equal((await run(agent)).outcome, 'success');
    assert.equal((await stored(agent.threadId)).at(-1).metadata.status, 'completed');
  });

  test('stop mid-arguments closes the call, answers it, and the next run is answered', BOUND, async () => {
    const agent = newAgent('stop-cut-arguments');
    agent.addMessage(user(`/tool transfer_funds ${LONG_ARGUMENTS}`));
    let argumentsSeen = '';
    const { seen, subscriber } = recorder();
    subscriber.onToolCallArgsEvent = ({ event }) => void (argumentsSeen += event.delta);
    const running = agent.runAgent({}, subscriber);
    await until(() => argumentsSeen.length > 40, 'some arguments');
    assert.equal((await call('POST', `/v1/ag-ui/${agent.threadId}/stop`)).status, 200);
    await running;
    assert.equal(seen.outcome, 'cancelled');
    const [, step, result] = agent.messages;
    const [cut] = step.toolCalls;
    assert.ok(cut.function.arguments.length < LONG_ARGUMENTS.length, 'the arguments were cut off');
    assert.ok(LONG_ARGUMENTS.startsWith(cut.function.arguments));
    assert.equal(result.role, 'tool', 'no call is left without a result');
    assert.equal(result.toolCallId, cut.id);
    assert.match(JSON.parse(result.content).error, /stopped/);
    assert.deepEqual(plain(await snapshotOf(agent.threadId)), plain(agent.messages));
    const [, reply] = await stored(agent.threadId);
    assert.equal(reply.metadata.status, 'interrupted_by_user');
    const part = reply.parts.find((p) => p.type === 'tool-transfer_funds');
    assert.equal(part.rawInput, cut.function.arguments, 'stored byte for byte as sent');

    agent.addMessage(user('never mind, say hello'));
    const next = await run(agent);
    assert.equal(next.outcome, 'success');
    assert.match(agent.messages.at(-1).content, /say hello/);
  });

  test('abortRun is a disconnect: the reply goes on, and connect joins it without showing anything twice', BOUND, async () => {
    const agent = newAgent('abort');
    agent.addMessage(user('/long a story to reconnect to'));
    const { seen, subscriber } = recorder();
    const running = agent.runAgent({}, subscriber);
    await until(() => seen.text.length > 40, 'some text');
    agent.abortRun();
    await running.catch(() => undefined);
    const partial = agent.messages[1].content;
    assert.ok(partial.length > 0);

    // The same page (it kept the partial message): connect continues it under its id.
    const joined = recorder();
    await agent.connectAgent({}, joined.subscriber);
    assert.equal(joined.seen.events[0], 'RUN_STARTED');
    assert.equal(joined.seen.events[1], 'MESSAGES_SNAPSHOT');
    assert.equal(joined.seen.outcome, 'success');
    assert.equal(agent.messages.length, 2);
    const [, reply] = await stored(agent.threadId);
    assert.equal(reply.metadata.status, 'completed');
    assert.equal(agent.messages[1].content, storedText(reply));
    assert.ok(agent.messages[1].content.startsWith(partial));

    // Nothing runs now: connect finishes at once with the thread.
    const later = recorder();
    const fresh = new ChatmemAgent({ name: 'connect-idle', threadId: agent.threadId });
    await fresh.connectAgent({}, later.subscriber);
    assert.deepEqual(later.seen.events, ['RUN_STARTED', 'MESSAGES_SNAPSHOT', 'RUN_FINISHED']);
    assert.deepEqual(plain(fresh.messages), plain(agent.messages));
  });

  test('a reloaded page connects to a run midway, on another replica, and ends with the whole reply', BOUND, async () => {
    const agent = newAgent('reload');
    agent.addMessage(user('/long a story for a page that reloads'));
    const { seen, subscriber } = recorder();
    const running = agent.runAgent({}, subscriber);
    await until(() => seen.text.length > 40, 'some text');
    // The reloaded page lands on the other replica: connect replays the stored log there.
    const reloaded = new ChatmemAgent({ name: 'reload-connect', threadId: agent.threadId, base: REPLICA });
    const joined = recorder();
    await reloaded.connectAgent({}, joined.subscriber);
    await running;
    assert.equal(joined.seen.outcome, 'success');
    assert.deepEqual(plain(reloaded.messages), plain(agent.messages));
  });

  test('a tool that needs approval ends the run with an interrupt; approved, it runs and the reply goes on', BOUND, async () => {
    const agent = newAgent('approve');
    agent.addMessage(user('/tool transfer_funds {"amount": 3, "to": "carol"}'));
    const asked = await run(agent);
    assert.equal(asked.outcome, 'interrupt');
    const [interrupt] = asked.interrupts;
    const call = agent.messages[1].toolCalls[0];
    assert.equal(interrupt.reason, 'tool_call');
    assert.equal(interrupt.toolCallId, call.id);
    assert.deepEqual(interrupt.responseSchema.required, ['approved']);
    assert.deepEqual(agent.pendingInterrupts.map((i) => i.id), [interrupt.id]);

    // A page that lost the interrupt sends a new message: it is asked again, nothing stored.
    const reloaded = new ChatmemAgent({ name: 'approve-asked-again', threadId: agent.threadId });
    reloaded.addMessage(user('hello?'));
    const again = await run(reloaded);
    assert.equal(again.outcome, 'interrupt');
    assert.deepEqual(again.interrupts.map((i) => i.id), [interrupt.id]);
    assert.equal((await stored(agent.threadId)).length, 2);

    const resumed = await run(agent, {
      resume: [{ interruptId: interrupt.id, status: 'resolved', payload: { approved: true } }],
    });
    assert.equal(resumed.outcome, 'success');
    assert.deepEqual(agent.pendingInterrupts, []);
    const result = agent.messages.find((m) => m.role === 'tool');
    assert.equal(result.toolCallId, call.id);
    assert.deepEqual(JSON.parse(result.content), { transferred: 3, to: 'carol' });
    assert.match(agent.messages.at(-1).content, /The tool answered/);
    const [, reply] = await stored(agent.threadId);
    assert.equal(reply.metadata.status, 'completed');
    assert.deepEqual(plain(await snapshotOf(agent.threadId)), plain(agent.messages));
  });

  test('denied, the call is answered with the refusal and never runs', BOUND, async () => {
    const agent = newAgent('deny');
    agent.addMessage(user('/tool transfer_funds {"amount": 5, "to": "mallory"}'));
    const asked = await run(agent);
    const [interrupt] = asked.interrupts;
    const resumed = await run(agent, {
      resume: [{ interruptId: interrupt.id, status: 'resolved', payload: { approved: false, reason: 'no' } }],
    });
    assert.equal(resumed.outcome, 'success');
    const result = agent.messages.find((m) => m.role === 'tool');
    assert.equal(result.toolCallId, interrupt.toolCallId);
    assert.match(JSON.parse(result.content).error, /did not approve/);
    const [, reply] = await stored(agent.threadId);
    assert.equal(reply.parts.find((p) => p.type === 'tool-transfer_funds').state, 'output-denied');
    // The same interrupt cannot be answered twice.
    const twice = await call('POST', '/v1/ag-ui', {
      body: {
        threadId: agent.threadId,
        runId: randomUUID(),
        messages: [],
        resume: [{ interruptId: interrupt.id, status: 'resolved', payload: { approved: true } }],
      },
    });
    assert.equal(twice.status, 409);
    assert.equal(twice.body.error.code, 'tool_call_not_awaiting_approval');
  });

  test('cancelling every interrupt beside a new message answers the message; the tool never runs', BOUND, async () => {
    const agent = newAgent('steer-away');
    agent.addMessage(user('/tool transfer_funds {"amount": 7, "to": "eve"}'));
    const [interrupt] = (await run(agent)).interrupts;
    agent.addMessage(user('forget it, just say hi'));
    const cancelled = [{ interruptId: interrupt.id, status: 'cancelled' }];
    const steered = await run(agent, { resume: cancelled });
    assert.equal(steered.outcome, 'success');
    assert.match(agent.messages.at(-1).content, /just say hi/);
    const thread = await stored(agent.threadId);
    assert.equal(thread[1].metadata.status, 'interrupted_by_user');
    assert.equal(thread[1].parts.find((p) => p.type === 'tool-transfer_funds').state, 'output-error');
    assert.equal(thread[3].metadata.status, 'completed');
    assert.deepEqual(plain(await snapshotOf(agent.threadId)), plain(agent.messages));
    // The same cancellation again is safe: nothing to decide, the thread as it is.
    const replay = await call('POST', '/v1/ag-ui', {
      body: { threadId: agent.threadId, runId: randomUUID(), messages: [], resume: cancelled },
    });
    assert.equal(replay.status, 200);
    assert.equal((await stored(agent.threadId)).length, 4);
  });

  test('a client tool ends the run with the call pending; the next run carries its result', BOUND, async () => {
    const agent = newAgent('client-tool');
    const tools = [
      {
        name: 'get_weather',
        description: 'The weather in a city',
        parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
      },
    ];
    agent.addMessage(user('/tool get_weather {"city": "Paris"}'));
    const asked = await run(agent, { tools });
    assert.equal(asked.outcome, 'success');
    const call = agent.messages[1].toolCalls[0];
    assert.equal(call.function.name, 'get_weather');
    assert.deepEqual(asked.pending, [call.id]);
    agent.addMessage({ id: randomUUID(), role: 'tool', toolCallId: call.id, content: '{"sky": "clear"}' });
    const answered = await run(agent, { tools });
    assert.equal(answered.outcome, 'success');
    assert.match(agent.messages.at(-1).content, /clear/);
    assert.deepEqual(plain(await snapshotOf(agent.threadId)), plain(agent.messages));
  });

  test('the same last message again is answered again, and a cut history is an edit: both on new branches', { timeout: 60_000 }, async () => {
    const agent = newAgent('branches');
    const first = user('first question');
    agent.addMessage(first);
    await run(agent);
    const second = user('second question');
    agent.addMessage(second);
    await run(agent);
    const answered = agent.messages.at(-1).id;

    // Reload: the client drops the answer and sends the same message again.
    agent.setMessages(agent.messages.slice(0, -1));
    const again = await run(agent);
    assert.equal(again.outcome, 'success');
    assert.notEqual(agent.messages.at(-1).id, answered);
    assert.equal(agent.messages.length, 4);
    assert.deepEqual(plain(await snapshotOf(agent.threadId)), plain(agent.messages));

    // Edit: the client keeps the first exchange and sends a new second message.
    agent.setMessages([...agent.messages.slice(0, 2), user('second question, edited')]);
    const edited = await run(agent);
    assert.equal(edited.outcome, 'success');
    assert.match(agent.messages.at(-1).content, /edited/);
    const snapshot = await snapshotOf(agent.threadId);
    assert.deepEqual(plain(snapshot), plain(agent.messages));
    assert.equal(snapshot.length, 4, 'the old second exchange is on another branch');
    assert.equal((await stored(agent.threadId)).length, 4);
  });

  test('an approval with edited arguments runs the tool with them', BOUND, async () => {
    const agent = newAgent('approve-edited');
    agent.addMessage(user('/tool transfer_funds {"amount": 3, "to": "carol"}'));
    const [interrupt] = (await run(agent)).interrupts;
    await run(agent, {
      resume: [
        { interruptId: interrupt.id, status: 'resolved', payload: { approved: true, editedArgs: { amount: 1, to: 'dave' } } },
      ],
    });
    const result = agent.messages.find((m) => m.role === 'tool');
    assert.deepEqual(JSON.parse(result.content), { transferred: 1, to: 'dave' });
  });

  test('a model failure after some text closes what was open and ends the run with RUN_ERROR', BOUND, async () => {
    const agent = newAgent('failure');
    agent.addMessage(user('/fail-mid please'));
    const { seen, subscriber } = recorder();
    await agent.runAgent({}, subscriber).catch(() => undefined);
    assert.equal(seen.events.at(-1), 'RUN_ERROR');
    assert.ok(seen.events.includes('TEXT_MESSAGE_END'));
    assert.ok(seen.error.code);
    const [, reply] = await stored(agent.threadId);
    assert.equal(reply.metadata.status, 'interrupted_by_error');
    assert.equal(storedText(reply), seen.text);
  });

  test('bad input is refused before any stream, in chatmem\'s error body, and nothing is stored', BOUND, async () => {
    const threadId = randomUUID();
    const input = (extra) => ({ threadId, runId: randomUUID(), messages: [user('hi')], ...extra });
    const cases = [
      [{ threadId: undefined }, 422],
      [{ messages: undefined }, 422],
      [{ threadId: 'not a thread id' }, 422],
      [{ runId: '' }, 422],
      [{ messages: [] }, 422],
      [{ messages: [{ id: 'a1', role: 'assistant', content: 'hi' }] }, 422],
      [{ messages: [{ id: 'u1', role: 'user', content: [{ type: 'image', source: { type: 'url', value: 'http://x/y.png' } }] }] }, 422],
      [{ messages: [user('x'.repeat(40_000))] }, 422],
      [{ messages: [user('   ')] }, 422],
      [{ resume: [{ interruptId: 'nope', status: 'resolved', payload: { approved: true } }] }, 422],
      [{ resume: [{ interruptId: `approval:${randomUUID()}:call_x`, status: 'resolved', payload: { approved: true } }] }, 404],
      [{ forwardedProps: { on_disconnect: 'explode' } }, 422],
      [{ tools: [{ name: 'bad name!', description: '' }] }, 422],
    ];
    for (const [extra, status] of cases) {
      const body = input(extra);
      for (const key of Object.keys(extra)) if (extra[key] === undefined) delete body[key];
      const response = await call('POST', '/v1/ag-ui', { body });
      assert.equal(response.status, status, JSON.stringify(extra).slice(0, 200));
      assert.match(response.type, /application\/json/);
      assert.ok(response.body.error.code && response.body.error.message);
    }
    assert.equal((await call('POST', '/v1/ag-ui', { raw: '{"threadId": ' })).status, 422);
    assert.deepEqual(await stored(threadId), [], 'nothing was stored');

    // The client surfaces the refusal as an error with the status and chatmem's body.
    const agent = newAgent('refused');
    agent.addMessage({ id: randomUUID(), role: 'assistant', content: 'not a question' });
    await assert.rejects(agent.runAgent(), (error) => error.status === 422 && Boolean(error.payload.error.code));

    // A system message that, with chatmem's system prompt and the question, leaves the reply no
    // room in the prompt (CONTEXT_MAX_TOKENS less REPLY_RESERVE_TOKENS) is refused naming it.
    const crowded = newAgent('crowded');
    crowded.addMessage({ id: randomUUID(), role: 'system', content: 'Be precise and name your sources. '.repeat(700) });
    crowded.addMessage(user('hi'));
    await assert.rejects(crowded.runAgent(), (error) => error.status === 422 && error.payload.error.code === 'context_length_exceeded' && error.payload.error.details.field === 'messages[0].content');
    assert.deepEqual(await stored(crowded.threadId), [], 'nothing was stored');

    // A message that alone fills that room (27,000 characters, within MAX_MESSAGE_CHARS, ~6,750
    // tokens) was accepted and sent whole to the model: refused naming it, saying what fits.
    const long = newAgent('long');
    long.addMessage(user('The quick brown fox jumps over the lazy dog. '.repeat(600)));
    await assert.rejects(long.runAgent(), (error) => {
      const refusal = error.payload.error;
      assert.equal(error.status, 422);
      assert.equal(refusal.code, 'context_length_exceeded');
      assert.equal(refusal.details.field, 'messages[0].content');
      assert.ok(refusal.details.message_tokens > refusal.details.max_message_tokens, JSON.stringify(refusal));
      assert.match(refusal.message, /comes to ~\d+ tokens and at most \d+ fit/);
      return true;
    });
    assert.deepEqual(await stored(long.threadId), [], 'nothing was stored');
  });

  test("another user's thread is neither changed nor revealed", BOUND, async () => {
    const agent = newAgent('owner');
    agent.addMessage(user('a secret of the owner'));
    await run(agent);
    const before = await stored(agent.threadId);
    // The owner's thread id, from another user, names a thread of that user's own.
    const other = new ChatmemAgent({ name: 'other-user', threadId: agent.threadId, token: OTHER_USER });
    other.addMessage(user('let me in'));
    const seen = await run(other);
    assert.equal(seen.outcome, 'success');
    assert.equal(other.messages.length, 2);
    assert.ok(!JSON.stringify(other.messages).includes('secret'), 'nothing of the owner is shown');
    const connect = await call('POST', `/v1/ag-ui/${agent.threadId}/connect`, { token: OTHER_USER, body: {} });
    assert.equal(connect.status, 200);
    assert.ok(!JSON.stringify(connect.body).includes('secret'));
    const stop = await call('POST', `/v1/ag-ui/${agent.threadId}/stop`, { token: OTHER_USER });
    assert.deepEqual(stop.body, { success: true });
    assert.deepEqual(await stored(agent.threadId), before, "the owner's thread is unchanged");
  });
});
