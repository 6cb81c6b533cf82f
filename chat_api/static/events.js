// The reply's vocabulary for the page: event names, the events that end a stream, turn
// statuses, tool-call states and stop reasons. The page's copy of memory/events.py, which
// defines them for the server; tests/test_page_vocabulary.py holds the two together, and
// no other module of the page spells one of these names.

export const EVENT = Object.freeze({
  TURN_STARTED: "turn.started",
  MEMORY_RETRIEVED: "memory.retrieved",
  MESSAGE_DELTA: "message.delta",
  TOOL_CALL_DELTA: "tool_call.delta",
  STEP_STARTED: "step.started",
  TOOL_STARTED: "tool.started",
  TOOL_RESULT: "tool.result",
  TOOL_CALL_APPROVAL_REQUIRED: "tool_call.approval_required",
  TOOL_CALL_APPROVED: "tool_call.approved",
  TOOL_CALL_REJECTED: "tool_call.rejected",
  TURN_AWAITING_APPROVAL: "turn.awaiting_approval",
  TURN_COMPLETED: "turn.completed",
  TURN_INTERRUPTED: "turn.interrupted",
  TURN_FAILED: "turn.failed",
  ERROR: "error",
});

/** The events that end a reply (turn.awaiting_approval only parks it). */
export const ENDING_EVENTS = new Set([EVENT.TURN_COMPLETED, EVENT.TURN_INTERRUPTED, EVENT.TURN_FAILED]);

export const STATUS = Object.freeze({
  STREAMING: "streaming",
  COMPLETED: "completed",
  INTERRUPTED_BY_USER: "interrupted_by_user",
  INTERRUPTED_BY_ERROR: "interrupted_by_error",
  FAILED: "failed",
  AWAITING_APPROVAL: "awaiting_approval",
});

export const CALL_STATE = Object.freeze({
  STREAMING: "streaming",
  READY: "ready",
  RUNNING: "running",
  SUCCEEDED: "succeeded",
  FAILED: "failed",
  CANCELLED: "cancelled",
  AWAITING_APPROVAL: "awaiting_approval",
  REJECTED: "rejected",
});

export const STOP_REASON = Object.freeze({
  USER: "user",
  NEW_MESSAGE: "new_message",
  CLIENT_DISCONNECTED: "client_disconnected",
  SHUTDOWN: "shutdown",
  ENDED_ELSEWHERE: "ended_elsewhere",
});
