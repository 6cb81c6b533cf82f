// A useChat frontend on chatmem: messages with tool parts, Stop (a real stop), resume after a
// reload, Approve/Deny for tools that wait for a person, the memories of each reply, and a
// long chat's earlier messages a page at a time.
//
// Configuration is in the page's query string: ?api=<chatmem URL>&token=<JWT>. The chat id
// lives in the hash (#chat=<id>), so a reload finds the same chat and resumes its stream.
import { useEffect, useState } from 'react';
import { createRoot } from 'react-dom/client';
import { useChat } from '@ai-sdk/react';
import {
  DefaultChatTransport,
  generateId,
  lastAssistantMessageIsCompleteWithApprovalResponses,
} from 'ai';

const params = new URLSearchParams(location.search);
const API = (params.get('api') || location.origin).replace(/\/$/, '');
const TOKEN = params.get('token') || '';
const headers = { Authorization: `Bearer ${TOKEN}` };

function chatIdFromHash() {
  const found = /chat=([A-Za-z0-9_-]{1,128})/.exec(location.hash);
  if (found) return found[1];
  const id = generateId();
  history.replaceState(null, '', `#chat=${id}`);
  return id;
}

const transport = new DefaultChatTransport({
  api: `${API}/v1/ai-sdk/chat`,
  headers,
  // chatmem keeps the history: the last message is all it reads.
  prepareSendMessagesRequest: ({ id, messages, trigger, messageId, body }) => ({
    body: { ...body, id, trigger, messageId, messages: messages.slice(-1) },
  }),
});

// A page of the stored messages (a UIMessage[]): the newest ones, or those before `cursor`;
// `older` is the cursor of the messages before these (null: these start the chat).
async function loadMessages(chatId, cursor = null) {
  const query = cursor ? `?cursor=${encodeURIComponent(cursor)}` : '';
  const response = await fetch(`${API}/v1/ai-sdk/chat/${chatId}/messages${query}`, { headers });
  if (!response.ok) throw new Error(`messages: HTTP ${response.status}`);
  return { messages: await response.json(), older: response.headers.get('X-Chatmem-Next-Cursor') };
}

function App() {
  const [chatId] = useState(chatIdFromHash);
  const [initial, setInitial] = useState(null);
  const [loadError, setLoadError] = useState(null);
  useEffect(() => {
    loadMessages(chatId).then(setInitial, setLoadError);
  }, [chatId]);
  if (loadError) return <p role="alert">{String(loadError.message)}</p>;
  if (initial === null) return <p>Loading…</p>;
  return <Chat chatId={chatId} initial={initial.messages} initialOlder={initial.older} />;
}

function Chat({ chatId, initial, initialOlder }) {
  const { messages, setMessages, sendMessage, status, error, addToolApprovalResponse } = useChat({
    id: chatId,
    messages: initial,
    transport,
    resume: true,
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses,
  });
  const [input, setInput] = useState('');
  const [older, setOlder] = useState(initialOlder);
  const busy = status === 'submitted' || status === 'streaming';

  // A long chat loads its newest messages; the earlier ones come a page at a time.
  const loadEarlier = async () => {
    const page = await loadMessages(chatId, older);
    setMessages((current) => [...page.messages, ...current]);
    setOlder(page.older);
  };

  // useChat's own stop() only drops the connection (chatmem would go on and could be
  // resumed); this ends the reply, and its stream ends with `abort`.
  const stop = () =>
    fetch(`${API}/v1/ai-sdk/chat/${chatId}/stop`, {
      method: 'POST',
      headers: { ...headers, 'content-type': 'application/json' },
      body: '{}',
    });

  const submit = (event) => {
    event.preventDefault();
    if (!input.trim() || busy) return;
    sendMessage({ text: input });
    setInput('');
  };

  return (
    <main data-status={status}>
      <h1>chatmem × AI SDK</h1>
      {older && (
        <button type="button" id="earlier" onClick={loadEarlier}>
          Load earlier messages
        </button>
      )}
      <ol id="messages">
        {messages.map((message) => (
          <li key={message.id} className={`message ${message.role}`} data-id={message.id}>
            {message.parts.map((part, index) => (
              <Part key={index} part={part} onDecide={addToolApprovalResponse} />
            ))}
          </li>
        ))}
      </ol>
      {error && <p role="alert" className="error">{error.message}</p>}
      <form onSubmit={submit}>
        <input
          id="composer"
          value={input}
          onChange={(e) => setInput(e.target.value)}
          placeholder="Say something (try: what time is it?)"
          aria-label="Message"
        />
        <button type="submit" disabled={busy}>Send</button>
        <button type="button" id="stop" onClick={stop} disabled={!busy}>Stop</button>
      </form>
    </main>
  );
}

function Part({ part, onDecide }) {
  if (part.type === 'text') return <p className="text">{part.text}</p>;
  if (part.type === 'data-memory') return <Memories data={part.data} />;
  if (part.type.startsWith('tool-')) return <ToolCall part={part} onDecide={onDecide} />;
  return null;
}

function Memories({ data }) {
  const items = data.items || [];
  return (
    <details className="memories">
      <summary>
        {items.length} memor{items.length === 1 ? 'y' : 'ies'} for “{data.rewritten_query}”
      </summary>
      <ul>
        {items.map((item, i) => (
          <li key={i}>{item.text}</li>
        ))}
      </ul>
    </details>
  );
}

function ToolCall({ part, onDecide }) {
  const name = part.type.slice('tool-'.length);
  return (
    <div className="tool" data-state={part.state} data-call={part.toolCallId}>
      <code>{name}</code> <span className="state">{part.state}</span>
      <pre>{part.input !== undefined && part.input !== null ? JSON.stringify(part.input) : part.rawInput}</pre>
      {part.state === 'approval-requested' && (
        <span>
          <button className="approve" onClick={() => onDecide({ id: part.approval.id, approved: true })}>
            Approve
          </button>{' '}
          <button
            className="deny"
            onClick={() => onDecide({ id: part.approval.id, approved: false, reason: 'denied in the example' })}
          >
            Deny
          </button>
        </span>
      )}
      {part.state === 'output-available' && <pre className="output">{JSON.stringify(part.output)}</pre>}
      {part.state === 'output-error' && <p className="error">{part.errorText}</p>}
      {part.state === 'output-denied' && <p className="denied">denied</p>}
    </div>
  );
}

createRoot(document.getElementById('root')).render(<App />);
