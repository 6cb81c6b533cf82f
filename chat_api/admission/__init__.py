"""Admission: the one path every door that costs work goes through, whatever protocol it speaks.

- door.py     who is asking, before the body is read: failed-auth throttle, session token or
              API key, request rate; `DoorRoute`/`door_router` for routes, `pass_door` for /mcp
- inputs.py   input bounds: the strict JSON decoder (MAX_BODY_VALUES counted before it parses),
              storable strings, times UTC can hold
- lists.py    a body's long list (a history's messages) validated slice by slice, off the loop
- limits.py   `Admission`: this process's rates, caps and quotas, and the admit_* calls
- running.py  replies running at once (`AdmittedReply`)
- streams.py  streams held open (`StreamSlot`)
- imports.py  history stored in bulk, against the hourly quota (`AdmittedImport`)
- bucket.py   the one token bucket all rates and quotas are made of
- body.py     the body limit (ASGI middleware; the import route alone takes more)
- prompt_room.py  a client's system text that leaves the reply no room in the prompt

How a protocol adapter plugs in (the OpenAI chat, AI SDK and MCP adapters do exactly this):

1. Make its router with `door_router(prefix=…, route_class=…)`: every route is then
   authenticated, rate-limited and input-bounded before FastAPI reads its body. To answer
   in the protocol's own error shape, subclass `DoorRoute` and translate `AuthError`,
   `RateLimited`, `Forbidden`, `RequestValidationError` and `DomainError` in
   `get_route_handler` (see `chat_api.protocols.openai.routes.OpenAIRoute`). Read the caller
   with `OwnerDep`, the limits with `AdmissionDep`, a JSON body with `await request.json()`.
2. To start (or resume) a reply, before anything is stored:

       with admission.admit_reply(owner, stream=wants_stream) as admitted:  # 429 past a cap
           accepted = await start_reply(services, owner, cid, begin, admitted=admitted, …)
       return MyStreamingResponse(admitted.stream(my_frames(accepted.reply_id)))

   `start_reply`/`accept_message`/`decide` take the admission, so a reply cannot start
   without one. A stream that only follows a reply takes `admission.admit_stream(owner)`
   and returns `slot.hold(frames)`.
3. To store history in bulk (turns the client has and chatmem has not):

       with await admission.admit_import(owner, raw_turns) as admitted:  # 422, or 429 past the quota
           result = await import_turns(session, owner, cid, admitted.turns)
           admitted.settle(result.created)

Nothing else is needed, and nothing here may be re-implemented by an adapter.
"""

from typing import Annotated

from fastapi import Depends, Request

from chat_api.admission.body import BodyLimit, LargeBody
from chat_api.admission.door import (
    Credential,
    DoorRoute,
    OwnerDep,
    SessionOwnerDep,
    StopOwnerDep,
    door_router,
    pass_door,
    unguarded_routes,
)
from chat_api.admission.imports import AdmittedImport
from chat_api.admission.inputs import check_time, check_tools, parse_json
from chat_api.admission.limits import Admission
from chat_api.admission.lists import checked
from chat_api.admission.prompt_room import check_prompt_room, check_prompt_room_off_loop
from chat_api.admission.running import AdmittedReply
from chat_api.admission.streams import StreamSlot
from memory.json_bounds import check_text


async def get_admission(request: Request) -> Admission:
    """The admission of the app serving this request (async: no thread-pool hop per request)."""
    admission: Admission = request.app.state.services.admission
    return admission


AdmissionDep = Annotated[Admission, Depends(get_admission)]

__all__ = [
    "Admission",
    "AdmissionDep",
    "AdmittedImport",
    "AdmittedReply",
    "BodyLimit",
    "Credential",
    "DoorRoute",
    "LargeBody",
    "OwnerDep",
    "SessionOwnerDep",
    "StopOwnerDep",
    "StreamSlot",
    "check_prompt_room",
    "check_prompt_room_off_loop",
    "check_text",
    "check_time",
    "check_tools",
    "checked",
    "door_router",
    "get_admission",
    "parse_json",
    "pass_door",
    "unguarded_routes",
]
