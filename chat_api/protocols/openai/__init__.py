"""OpenAI chat completions (Open WebUI, LibreChat, the openai SDKs) at /openai/v1.

- routes.py         the routes, answering in OpenAI's error shape
- chat.py           requests in, chunks and completions out: a reply's events translated
- conversations.py  which chatmem conversation a request continues, and starting its reply there
"""
