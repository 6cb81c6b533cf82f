// The AI SDK's and AG-UI's own clients, each streaming a long reply from a chatmem that the
// pytest side is about to shut down (tests/test_shutdown.py), and a second client of each
// following the same reply (useChat's resume, AG-UI's connect). Not a test suite: it prints
// "started" once all four clients have received text (the signal may be sent then), and, when
// all streams have ended, one JSON line with what each client made of its stream.
// CHATMEM_URL and CHATMEM_TOKEN come from the environment.
import { randomUUID } from 'node:crypto';
import { DefaultChatTransport, readUIMessageStream } from 'ai';
import { HttpAgent, runHttpRequest, transformHttpEventStream } from '@ag-ui/client';
import { BASE, until } from './chatmem.mjs';

const TOKEN = process.env.CHATMEM_TOKEN;
const headers = { Authorization: `Bearer ${TOKEN}` };

// useChat's transport and its stream reader: the chunks as the SDK parsed them, and the message.
async function aiSdk() {
  const chatId = randomUUID();
  const transport = new DefaultChatTransport({ api: `${BASE}/v1/ai-sdk/chat`, headers });
  const stream = await transport.sendMessages({
    chatId,
    messages: [{ id: randomUUID(), role: 'user', parts: [{ type: 'text', text: '/long' }] }],
    trigger: 'submit-message',
    messageId: undefined,
    abortSignal: undefined,
  });
  const seen = { chatId, chunks: [], text: '' };
  const [forChunks, forMessage] = stream.tee();
  const chunks = (async () => {
    const reader = forChunks.getReader();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      seen.chunks.push(value.type);
      if (value.type === 'text-delta') seen.text += value.delta;
    }
  })();
  const message = (async () => {
    // onError: what useChat sets as the chat's error.
    const onError = (error) => void (seen.error = String(error?.message ?? error));
    for await (const snapshot of readUIMessageStream({ stream: forMessage, onError })) {
      seen.messageText = snapshot.parts.filter((p) => p.type === 'text').map((p) => p.text).join('');
    }
  })();
  return { seen, done: Promise.all([chunks, message]) };
}

// CopilotKit's and assistant-ui's agent: the events its subscriber is told of.
function agUi() {
  const agent = new HttpAgent({ url: `${BASE}/v1/ag-ui`, headers, threadId: randomUUID() });
  agent.addMessage({ id: randomUUID(), role: 'user', content: '/long' });
  const seen = { threadId: agent.threadId, events: [], text: '', rejected: false };
  const done = agent
    .runAgent({}, {
      onEvent: ({ event }) => void seen.events.push(event.type),
      onTextMessageContentEvent: ({ event }) => void (seen.text += event.delta),
    })
    .catch(() => void (seen.rejected = true));
  return { seen, done };
}

// A second tab on the same chat: the transport's resume (GET …/{chatId}/stream), from the start.
async function aiSdkFollower(chatId) {
  const transport = new DefaultChatTransport({ api: `${BASE}/v1/ai-sdk/chat`, headers });
  const reader = (await transport.reconnectToStream({ chatId })).getReader();
  const seen = { chunks: [], text: '' };
  const done = (async () => {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      seen.chunks.push(value.type);
      if (value.type === 'text-delta') seen.text += value.delta;
    }
  })();
  return { seen, done };
}

// A second page on the same thread: HttpAgent joining the run through chatmem's connect route.
class JoiningAgent extends HttpAgent {
  connect(input) {
    const url = `${this.url}/${encodeURIComponent(this.threadId)}/connect`;
    return transformHttpEventStream(runHttpRequest(() => this.fetch(url, this.requestInit(input))));
  }
}

function agUiFollower(threadId) {
  const agent = new JoiningAgent({ url: `${BASE}/v1/ag-ui`, headers, threadId });
  const seen = { events: [], text: '', rejected: false };
  const done = agent
    .connectAgent({}, {
      onEvent: ({ event }) => void seen.events.push(event.type),
      onTextMessageContentEvent: ({ event }) => void (seen.text += event.delta),
    })
    .catch(() => void (seen.rejected = true));
  return { seen, done };
}

const ai = await aiSdk();
const ag = agUi();
await until(() => ai.seen.text.length > 0 && ag.seen.text.length > 0, 'text on both streams', 30_000);
const aiFollower = await aiSdkFollower(ai.seen.chatId);
const agFollower = agUiFollower(ag.seen.threadId);
await until(() => aiFollower.seen.text.length > 0 && agFollower.seen.text.length > 0, 'text on the followers', 30_000);
console.log('started');
await Promise.all([ai.done, ag.done, aiFollower.done, agFollower.done]);
const followers = { aiSdkFollower: aiFollower.seen, agUiFollower: agFollower.seen };
console.log(JSON.stringify({ aiSdk: ai.seen, agUi: ag.seen, ...followers }));
