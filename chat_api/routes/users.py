"""The caller's account: `DELETE /v1/users/me` erases everything of theirs in the tenant."""

from __future__ import annotations

from fastapi import Response

from chat_api.admission import door_router
from chat_api.deps import ServicesDep, SessionOwnerDep
from chat_api.replies import stop_reply
from chat_api.schemas import ErrorOut
from memory.accounts.erasure import active_replies, delete_user, delete_user_dead_letters
from memory.events import StopReason
from memory.storage.tenancy import unscoped

router = door_router(prefix="/v1/users", tags=["users"])


@router.delete(
    "/me",
    status_code=204,
    responses={
        403: {"model": ErrorOut, "description": "Only a signed-in session token deletes the account."},
        409: {"model": ErrorOut, "description": "A reply started again while deleting; retry."},
    },
)
async def delete_me(owner: SessionOwnerDep, services: ServicesDep) -> Response:
    """Delete the caller's conversations, turns, events, tool calls, outbox rows and memory. Idempotent.

    Needs a signed-in session token: an API key answers 403 `session_token_required`.

    Replies still streaming are stopped first (on whichever process runs them), so none
    can write after the delete; the deletion itself is one transaction.
    """
    async with services.db.session() as session:
        running = await active_replies(session, owner)
    for reply_id in running:
        await stop_reply(services, reply_id, reason=StopReason.USER)
    async with services.db.transaction() as session:
        await delete_user(session, owner)
    with unscoped():
        async with services.db.transaction() as session:
            await delete_user_dead_letters(session, owner)
    return Response(status_code=204)
