"""A body's long lists (a door's `messages`, AG-UI's `tools`, `context`, `resume`) validated in slices.

FastAPI validates a route's body model in one pydantic call, on the event loop; and one
pydantic call holds the GIL however long it takes, in a worker thread too. A history of
35,000 AG-UI messages or 20,000 AI SDK messages, within MAX_BODY_VALUES, held every other
stream of the process for 100-500 ms, though those doors read only the last messages.

The same holds for any list of a body: 49,000 AG-UI `context`, `tools` or `resume` entries
(245,000 values, under MAX_BODY_VALUES) held the event loop 84-111 ms per body, refused anyway
(the context longer than a message, more than 128 tools, unknown interrupts) once validated.

Such a field is declared `SkipValidation[list[Item]]` (or `SkipValidation[list[Item] | None]`;
FastAPI takes it as it is; its schema stays the item's), and the route's first step is
`body = await checked(body, "messages", …)`: each list validated by the field's own annotation,
SLICE items per pydantic call, in a worker thread for a long list. The GIL is given up between
two slices (one switch interval, 5 ms, after the loop asks for it), so other streams go on.
Refusals are the ones FastAPI gave, at the same `loc` (`body.messages.<index>…`), and every
slice's refusals are reported.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Annotated, Any, TypeVar

from annotated_types import BaseMetadata
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError

# Items per pydantic call: ~1-2 ms of the GIL for small messages.
SLICE = 1000

Model = TypeVar("Model", bound=BaseModel)


def is_long(items: Any) -> bool:
    """A list long enough to be read in a worker thread (more than one slice)."""
    return isinstance(items, list) and len(items) > SLICE


@functools.cache
def list_adapter(model: type[BaseModel], name: str) -> tuple[TypeAdapter[list[Any]], str]:
    """The field's annotation and constraints (`min_length`), without its SkipValidation; its JSON name."""
    field = model.model_fields[name]
    metadata = [m for m in field.metadata if isinstance(m, BaseMetadata)]  # not SkipValidation
    # Each slice is held to them: a minimum of one item at most, no maximum.
    assert all(getattr(m, "min_length", 0) <= 1 and not hasattr(m, "max_length") for m in metadata)
    annotation: Any = Annotated[(field.annotation, *metadata)] if metadata else field.annotation
    return TypeAdapter(annotation), field.alias or name


def in_slices(
    adapter: TypeAdapter[list[Any]], items: Any, *, from_attributes: bool = False
) -> tuple[list[Any], list[dict[str, Any]]]:
    """`items` validated by `adapter`, SLICE items per pydantic call: the validated items and
    every slice's refusals (pydantic's error dicts), their `loc` starting at the item's index
    in the whole list, as one call over the list would have given them. Not a list: validated
    whole (None where the field allows it, else the field's own refusal)."""
    if not isinstance(items, list):
        try:
            return adapter.validate_python(items, from_attributes=from_attributes), []
        except ValidationError as exc:
            return [], [dict(error) for error in exc.errors(include_url=False)]
    slices = [(start, items[start : start + SLICE]) for start in range(0, max(len(items), 1), SLICE)]
    validated: list[Any] = []
    errors: list[dict[str, Any]] = []
    for start, part in slices:
        try:
            validated += adapter.validate_python(part, from_attributes=from_attributes)
        except ValidationError as exc:
            for error in exc.errors(include_url=False):
                loc = error["loc"]
                if loc and isinstance(loc[0], int):
                    loc = (start + loc[0], *loc[1:])
                errors.append({**error, "loc": loc})
    return validated, errors


def _validated(adapter: TypeAdapter[list[Any]], items: Any, where: str) -> list[Any]:
    validated, errors = in_slices(adapter, items, from_attributes=True)  # as FastAPI validates
    if errors:
        raise RequestValidationError([{**error, "loc": ("body", where, *error["loc"])} for error in errors])
    return validated


async def checked(body: Model, *names: str) -> Model:
    """`body` with its fields `names` (each a `SkipValidation[list[…]]`) validated, in order;
    RequestValidationError (the door's 422) as FastAPI's would have been, for the first field
    refused. A long list is validated in a worker thread."""
    update: dict[str, Any] = {}
    for name in names:
        adapter, where = list_adapter(type(body), name)
        items = getattr(body, name)
        if is_long(items):
            update[name] = await asyncio.to_thread(_validated, adapter, items, where)
        else:
            update[name] = _validated(adapter, items, where)
    return body.model_copy(update=update)
