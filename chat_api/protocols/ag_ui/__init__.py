"""AG-UI, the Agent-User Interaction protocol (CopilotKit, assistant-ui's AG-UI runtime, `@ag-ui/client`).

- run.py     a reply's events → one AG-UI run's events; stored turns → AG-UI messages
- input.py   what a `RunAgentInput` asks (new message, client tool results, interrupt answers)
- routes.py  `POST /v1/ag-ui`, `…/{threadId}/stop`, `…/{threadId}/connect`
"""
