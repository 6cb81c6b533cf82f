"""AG-UI, the Agent-User Interaction protocol (CopilotKit, assistant-ui's AG-UI runtime, `@ag-ui/client`).

- run.py         a reply's events → one AG-UI run's events (and the messages they build)
- thread.py      stored turns → the same AG-UI messages (MESSAGES_SNAPSHOT), a parked turn's interrupts
- input.py       what a `RunAgentInput` asks (new message, client tool results, interrupt answers)
- streams.py     start a reply and stream its run; join a running one (connect)
- interrupts.py  waiting tool calls: asked (again), answered by `resume`, cancelled
- routes.py      `POST /v1/ag-ui`, `…/{threadId}/stop`, `…/{threadId}/connect`
"""
