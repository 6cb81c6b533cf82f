"""The protocols clients speak besides chatmem's own API, one folder each.

- ai_sdk/   the Vercel AI SDK's UI message stream (useChat, assistant-ui)
- openai/   OpenAI chat completions (Open WebUI, LibreChat, the openai SDKs)
- mcp/      MCP: a person's memory as tools

Each adapter passes the one admission path (chat_api.admission), starts and stops replies
through chat_api.replies, and translates the reply's events (memory.events) into its own
frames; it never reaches into the runner. ARCHITECTURE.md says how a new one plugs in.
"""
