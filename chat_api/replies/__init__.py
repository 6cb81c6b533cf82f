"""A reply's life, one module per part; protocol adapters use only the names below.

- start.py      accept_message / regenerate_reply / edit_message → Accepted; start_reply with
                your own BeginReply, built from store_message / answer_again / answer_tool_results;
                hand_over gives the started reply the client's tools, options and instructions
- follow.py     follow_reply (batches of events from any id, live or stored), sse_stream
- hang_up.py    hung_up: what a client leaving a reply's stream early does to it (ReplyKind,
                on_disconnect), decided once for every door
- stop.py       stop_reply, wait_reply_done, reply_streaming; stop_conversation (→ Stopped) for a
                stop that names a conversation or a run's key, not a reply
- approve.py    decide (approve or reject a waiting tool call; the last decision resumes)
- run.py        ReplyRunner: model → tools → model, and the one ending call
- prompt.py     Prompter: the prompt window, read once per reply; recall.py: recall's glue into it
- queue.py, idempotency.py: on_busy=enqueue, and a retried request's Idempotency-Key
- checkpoint.py, signals.py, reaper.py, registry.py, reply.py: the machinery underneath

Every ending is `memory.record.reply_endings.end_reply`. The events a reply is made of, and
their names, are `memory.events`: adapters import them from there.
"""

from chat_api.replies.approve import Decided, decide
from chat_api.replies.follow import follow_reply, sse_frame, sse_stream
from chat_api.replies.hang_up import OnDisconnect, ReplyKind, hung_up
from chat_api.replies.reply import Reply, ReplyRequest
from chat_api.replies.start import (
    Accepted,
    BeginReply,
    Started,
    accept_message,
    answer_again,
    answer_tool_results,
    edit_message,
    hand_over,
    regenerate_reply,
    start_reply,
    store_message,
)
from chat_api.replies.stop import (
    NamedRun,
    RunNamed,
    Stopped,
    reply_streaming,
    stop_conversation,
    stop_reply,
    wait_reply_done,
)

__all__ = [
    "Accepted",
    "BeginReply",
    "Decided",
    "NamedRun",
    "OnDisconnect",
    "Reply",
    "ReplyKind",
    "ReplyRequest",
    "RunNamed",
    "Started",
    "Stopped",
    "accept_message",
    "answer_again",
    "answer_tool_results",
    "decide",
    "edit_message",
    "follow_reply",
    "hand_over",
    "hung_up",
    "regenerate_reply",
    "reply_streaming",
    "sse_frame",
    "sse_stream",
    "start_reply",
    "stop_conversation",
    "stop_reply",
    "store_message",
    "wait_reply_done",
]
