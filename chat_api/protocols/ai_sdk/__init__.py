"""The Vercel AI SDK's UI message stream (useChat, assistant-ui).

- routes.py  what `DefaultChatTransport` and `useChat` call
- stream.py  a reply's events translated into UI message stream parts, and stored turns into UI messages
"""
