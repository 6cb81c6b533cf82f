// An assistant-ui frontend on chatmem over AG-UI: assistant-ui's AG-UI runtime
// (@assistant-ui/react-ag-ui) drives an @ag-ui/client HttpAgent pointed at chatmem's
// POST /v1/ag-ui. Stop (a real stop), Approve/Deny for tools that wait for a person (AG-UI
// interrupts), the memories recalled for each reply (chatmem's CUSTOM event).
//
// Configuration is in the page's query string: ?api=<chatmem URL>&token=<JWT>. The thread id
// lives in the hash (#thread=<id>), so a reload finds the same thread.
import { useMemo, useState } from 'react';
import { createRoot } from 'react-dom/client';
import { HttpAgent } from '@ag-ui/client';
import {
  AssistantRuntimeProvider,
  ComposerPrimitive,
  MessagePrimitive,
  ThreadPrimitive,
  useAuiState,
} from '@assistant-ui/react';
import {
  useAgUiInterrupts,
  useAgUiRuntime,
  useAgUiSubmitInterruptResponses,
} from '@assistant-ui/react-ag-ui';

const params = new URLSearchParams(location.search);
const API = (params.get('api') || location.origin).replace(/\/$/, '');
const TOKEN = params.get('token') || '';
const headers = { Authorization: `Bearer ${TOKEN}` };

function threadIdFromHash() {
  const found = /thread=([A-Za-z0-9_-]{1,128})/.exec(location.hash);
  if (found) return found[1];
  const id = crypto.randomUUID();
  history.replaceState(null, '', `#thread=${id}`);
  return id;
}

// The memories chatmem recalled for the latest run (its `chatmem.memory` CUSTOM event).
const memories = { latest: null, listeners: new Set() };
function onMemory(value) {
  memories.latest = value;
  for (const listener of memories.listeners) listener(value);
}

function App() {
  const [threadId] = useState(threadIdFromHash);
  const agent = useMemo(() => {
    const agent = new HttpAgent({ url: `${API}/v1/ag-ui`, headers, threadId });
    agent.subscribe({
      onCustomEvent: ({ event }) => {
        if (event.name === 'chatmem.memory') onMemory(event.value);
      },
    });
    return agent;
  }, [threadId]);
  const runtime = useAgUiRuntime({ agent });
  return (
    <AssistantRuntimeProvider runtime={runtime}>
      <Thread threadId={threadId} />
    </AssistantRuntimeProvider>
  );
}

function Thread({ threadId }) {
  const running = useAuiState(({ thread }) => thread.isRunning);
  const interrupts = useAgUiInterrupts();
  // The runtime's own cancel only drops the connection (chatmem would go on); this ends the
  // run on the server, and its stream ends with RUN_FINISHED holding exactly what was sent.
  const stop = () =>
    fetch(`${API}/v1/ag-ui/${threadId}/stop`, {
      method: 'POST',
      headers: { ...headers, 'content-type': 'application/json' },
      body: '{}',
    });
  const status = interrupts.length ? 'waiting' : running ? 'streaming' : 'ready';
  return (
    <main data-status={status}>
      <h1>chatmem × assistant-ui (AG-UI)</h1>
      <ThreadPrimitive.Root>
        <ol id="messages">
          <ThreadPrimitive.Messages components={{ UserMessage, AssistantMessage }} />
        </ol>
        <Interrupts interrupts={interrupts} />
        <Memories />
        <ComposerPrimitive.Root>
          <ComposerPrimitive.Input id="composer" placeholder="Say something" aria-label="Message" />
          <ComposerPrimitive.Send id="send">Send</ComposerPrimitive.Send>
          <button type="button" id="stop" onClick={stop} disabled={!running}>
            Stop
          </button>
        </ComposerPrimitive.Root>
      </ThreadPrimitive.Root>
    </main>
  );
}

function UserMessage() {
  return (
    <MessagePrimitive.Root className="message user">
      <MessagePrimitive.Parts />
    </MessagePrimitive.Root>
  );
}

function AssistantMessage() {
  return (
    <MessagePrimitive.Root className="message assistant">
      <MessagePrimitive.Parts components={{ Text, tools: { Fallback: ToolCall } }} />
    </MessagePrimitive.Root>
  );
}

function Text({ text }) {
  return <p className="text">{text}</p>;
}

function ToolCall({ toolName, toolCallId, argsText, result }) {
  const state = result === undefined ? 'called' : 'answered';
  return (
    <div className="tool" data-state={state} data-call={toolCallId}>
      <code>{toolName}</code>
      <pre className="args">{argsText}</pre>
      {result !== undefined && <pre className="output">{typeof result === 'string' ? result : JSON.stringify(result)}</pre>}
    </div>
  );
}

// One Approve/Deny per waiting call: the answer is the next run's `resume` entry.
function Interrupts({ interrupts }) {
  const submit = useAgUiSubmitInterruptResponses();
  if (!interrupts.length) return null;
  const answer = (approved) =>
    submit(interrupts.map((i) => ({ interruptId: i.id, status: 'resolved', payload: { approved } })));
  return (
    <div className="interrupts" role="group" aria-label="Waiting for your approval">
      {interrupts.map((interrupt) => (
        <p key={interrupt.id} className="interrupt" data-call={interrupt.toolCallId}>
          {interrupt.message}
        </p>
      ))}
      <button className="approve" onClick={() => answer(true)}>Approve</button>{' '}
      <button className="deny" onClick={() => answer(false)}>Deny</button>
    </div>
  );
}

function Memories() {
  const [value, setValue] = useState(memories.latest);
  useMemo(() => {
    memories.listeners.add(setValue);
  }, []);
  if (!value) return null;
  const items = value.items || [];
  return (
    <details className="memories">
      <summary>
        {items.length} memor{items.length === 1 ? 'y' : 'ies'} for “{value.rewritten_query}”
      </summary>
      <ul>
        {items.map((item, i) => (
          <li key={i}>{item.text}</li>
        ))}
      </ul>
    </details>
  );
}

createRoot(document.getElementById('root')).render(<App />);
