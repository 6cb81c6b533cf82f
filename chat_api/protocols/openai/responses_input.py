"""The input items of a Responses API request: messages, function calls and their outputs, images, files.

Pure. `input_messages` reads the items into the chat-completions form the conversation
mapping takes (`ClientMessage`s), keeps the images and files of the last user message
as attachments, and collects system/developer texts. A compaction item made by
`/responses/compact` names the turn a chain continues after (`compaction_point`); it is
opaque to clients, and only its owner can continue from it (the turn is looked up as theirs).
"""

from __future__ import annotations

import base64
import binascii
import uuid
from dataclasses import replace
from typing import Any

from chat_api.protocols.openai.chat import ClientMessage, bad_request

MAX_ATTACHMENTS = 8
# Image and file parts whose bytes chatmem keeps must be data: URLs or http(s) URLs.
URL_SCHEMES = ("data:", "https://", "http://")


COMPACTION_PREFIX = "chatmem.compaction."


def compaction_token(turn_id: uuid.UUID) -> str:
    """The `encrypted_content` of a compaction item: it names the last turn of the compacted history.

    Opaque to clients; only its owner can continue from it (the turn is looked up as theirs).
    """
    return COMPACTION_PREFIX + base64.urlsafe_b64encode(turn_id.bytes).decode().rstrip("=")


def parse_compaction_token(value: str) -> uuid.UUID | None:
    """The turn a compaction item names, or None if it is not one of chatmem's."""
    if not value.startswith(COMPACTION_PREFIX):
        return None
    raw = value.removeprefix(COMPACTION_PREFIX)
    try:
        return uuid.UUID(bytes=base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (ValueError, TypeError):
        return None


def input_items(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if value is None:
        raise bad_request("input is required", "input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not value:
        raise bad_request("input must hold at least one item", "input")
    return value


def compaction_point(items: list[dict[str, Any]]) -> uuid.UUID | None:
    """The turn a leading compaction item (chatmem's own) names, or None; one anywhere else is a 400."""
    kinds = [item.get("type") if isinstance(item, dict) else None for item in items]
    if "compaction" not in kinds:
        return None
    if kinds.index("compaction") != 0 or kinds.count("compaction") > 1:
        raise bad_request("a compaction item must be the first input item, and the only one", "input")
    content = items[0].get("encrypted_content")
    turn = parse_compaction_token(content) if isinstance(content, str) else None
    if turn is None:
        raise bad_request(
            "input[0] is not a compaction item made by this server", "input[0].encrypted_content"
        )
    return turn


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """The item as `/input_items` lists it: typed, with an id."""
    kind = item.get("type") or "message"
    out = {"id": item.get("id") or f"{'msg' if kind == 'message' else 'item'}_{uuid.uuid4().hex}", **item}
    out["type"] = kind
    if kind == "message":
        content = item.get("content")
        if isinstance(content, str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": content}]
        out.setdefault("status", "completed")
    return out


def input_messages(
    items: list[dict[str, Any]], start: int = 0
) -> tuple[list[ClientMessage], list[tuple[str, str]], tuple[dict[str, Any], ...]]:
    """The chat's messages in order, the system/developer texts (with their fields), and the last
    user message's attachments.

    `start` is the index of the first item in the request's `input` (after a compaction item)."""
    messages: list[ClientMessage] = []
    system: list[tuple[str, str]] = []  # (the item's field, its text)
    attachments: tuple[dict[str, Any], ...] = ()
    for index, item in enumerate(items, start):
        if not isinstance(item, dict):
            raise bad_request(f"input[{index}] must be an object", f"input[{index}]")
        kind = item.get("type") or "message"
        if kind == "message":
            role = item.get("role")
            text, parts = _content(item.get("content"), index)
            if role in ("system", "developer"):
                system.append((f"input[{index}].content", text))
            elif role == "user":
                messages.append(ClientMessage("user", text, index=index))
                attachments = parts
            elif role == "assistant":
                messages.append(ClientMessage("assistant", text, index=index))
            else:
                raise bad_request(
                    f"input[{index}].role must be user, assistant, system or developer",
                    f"input[{index}].role",
                )
        elif kind == "function_call":
            call = _function_call(item, index)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # the calls of the message before
                messages[-1] = replace(last, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(ClientMessage("assistant", "", tool_calls=(call,), index=index))
        elif kind == "function_call_output":
            messages.append(_function_output(item, index))
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(
                f"input[{index}]: items of type {kind!r} are not supported", f"input[{index}].type"
            )
    return messages, system, attachments


def _content(content: object, index: int) -> tuple[str, tuple[dict[str, Any], ...]]:
    """(text, attachments) of a message's content: a string, or parts."""
    if isinstance(content, str):
        return content, ()
    if not isinstance(content, list):
        raise bad_request(
            f"input[{index}].content must be a string or a list of parts", f"input[{index}].content"
        )
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for position, part in enumerate(content):
        where = f"input[{index}].content[{position}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            value = part.get("text") if kind != "refusal" else part.get("refusal")
            if not isinstance(value, str):
                raise bad_request(f"{where}.text must be a string", f"{where}.text")
            texts.append(value)
        elif kind == "input_image":
            parts.append(_image(part, where))
        elif kind == "input_file":
            parts.append(_file(part, where))
        else:
            raise bad_request(f"{where}: content parts of type {kind!r} are not supported", f"{where}.type")
    if len(parts) > MAX_ATTACHMENTS:
        raise bad_request(
            f"input[{index}]: at most {MAX_ATTACHMENTS} images and files per message",
            f"input[{index}].content",
        )
    return "".join(texts), tuple(parts)


def _image(part: dict[str, Any], where: str) -> dict[str, Any]:
    url = part.get("image_url")
    if part.get("file_id") is not None and url is None:
        raise bad_request(
            f"{where}: file_id needs the Files API, which chatmem does not have; send image_url",
            f"{where}.file_id",
        )
    if not isinstance(url, str) or not url.startswith(URL_SCHEMES):
        raise bad_request(f"{where}.image_url must be a data: URL or an http(s) URL", f"{where}.image_url")
    if url.startswith("data:"):
        _check_data_url(url, f"{where}.image_url")
    detail = part.get("detail") or "auto"
    if detail not in ("low", "high", "auto"):
        raise bad_request(f"{where}.detail must be low, high or auto", f"{where}.detail")
    return {"type": "image", "url": url, "detail": detail}


def _file(part: dict[str, Any], where: str) -> dict[str, Any]:
    data, url, name = part.get("file_data"), part.get("file_url"), part.get("filename")
    if part.get("file_id") is not None and data is None and url is None:
        raise bad_request(
            f"{where}: file_id needs the Files API, which chatmem does not have; send file_data",
            f"{where}.file_id",
        )
    if name is not None and (not isinstance(name, str) or len(name) > 256):
        raise bad_request(f"{where}.filename must be a string of at most 256 characters", f"{where}.filename")
    if isinstance(data, str) and data:
        if not data.startswith("data:"):
            # The API also takes bare base64; keep one form.
            data = f"data:application/octet-stream;base64,{data}"
        _check_data_url(data, f"{where}.file_data")
        return {"type": "file", "filename": name or "file", "data": data}
    if isinstance(url, str) and url.startswith(URL_SCHEMES[1:]):
        return {"type": "file", "filename": name or url.rsplit("/", 1)[-1] or "file", "url": url}
    raise bad_request(f"{where} needs file_data (base64 or a data: URL) or an http(s) file_url", where)


def _check_data_url(url: str, param: str) -> None:
    """A data: URL must hold base64, as the API takes it: anything else was stored with the turn and
    reached the model only then, which refused it and failed the reply after its stream began."""
    head, comma, payload = url.partition(",")
    if not comma or not head.endswith(";base64") or not payload:
        raise bad_request(f"{param} must be a data: URL of base64 (data:<type>;base64,<data>)", param)
    try:
        binascii.a2b_base64(payload, strict_mode=True)
    except binascii.Error:
        raise bad_request(f"{param} is not valid base64", param) from None


def _function_call(item: dict[str, Any], index: int) -> dict[str, str]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
    if not isinstance(call_id, str) or not 1 <= len(call_id) <= 128:
        raise bad_request(
            f"input[{index}].call_id must be a string of 1-128 characters", f"input[{index}].call_id"
        )
    if not isinstance(name, str) or not name:
        raise bad_request(f"input[{index}].name is required", f"input[{index}].name")
    if not isinstance(arguments, str):
        raise bad_request(f"input[{index}].arguments must be a string", f"input[{index}].arguments")
    return {"id": call_id, "name": name, "arguments": arguments}


def _function_output(item: dict[str, Any], index: int) -> ClientMessage:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not 1 <= len(call_id) <= 128:
        raise bad_request(
            f"input[{index}].call_id must be a string of 1-128 characters", f"input[{index}].call_id"
        )
    if isinstance(output, list):
        output, _ = _content(output, index)
    if not isinstance(output, str):
        raise bad_request(
            f"input[{index}].output must be a string or content parts", f"input[{index}].output"
        )
    return ClientMessage("tool", output, tool_call_id=call_id, index=index)
