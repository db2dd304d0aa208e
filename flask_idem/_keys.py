"""Parsing and validating the ``Idempotency-Key`` request header.

The IETF draft "The Idempotency-Key HTTP Header Field" defines the value as a structured-field string,
``Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"``. Most clients send the bare UUID instead, so both
forms are accepted. Anything else is refused before any database work: the header is the client's promise
that every attempt of one operation carries the same value, and a value we would have to guess about cannot
keep that promise.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence

from .errors import InvalidKey

__all__ = ["HEADER", "MAX_LENGTH", "parse_key"]

#: The request header that carries the key.
HEADER = "Idempotency-Key"

#: Longest raw header value that is looked at at all. A UUID in quotes is 38 characters; the margin only
#: exists so that "too long" is reported as such instead of as "not a UUID".
MAX_LENGTH = 64

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")
_MORE_THAN_ONE = (
    "The Idempotency-Key header must hold one key: the request carried more than one Idempotency-Key"
    " header, or a comma (a server joins repeated header lines with commas)."
)


def parse_key(values: Sequence[str]) -> uuid.UUID | None:
    """Return the idempotency key carried by the header values of one request.

    :param values: every value of the ``Idempotency-Key`` header.
    :return: the key, or ``None`` when the header is absent.
    :raises InvalidKey: when it is not exactly one UUID (the detail never echoes the value).
    """
    if not values:
        return None
    if len(values) == 1 and _UUID.fullmatch(values[0]) is not None:  # the usual case: one bare UUID
        return uuid.UUID(values[0])
    # Checked before the length: a WSGI server joins a header sent on two lines into one value with ", ",
    # and two UUIDs joined are longer than MAX_LENGTH, so "too long" would hide what the client did.
    if len(values) > 1 or "," in values[0]:
        raise InvalidKey(_MORE_THAN_ONE)
    value = values[0]
    if len(value) > MAX_LENGTH:
        raise InvalidKey(f"The Idempotency-Key header is too long (more than {MAX_LENGTH} characters).")
    if _PRINTABLE_ASCII.fullmatch(value) is None:
        raise InvalidKey("The Idempotency-Key header must contain printable ASCII characters only.")
    value = value.strip(" ")
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    if not value:
        raise InvalidKey("The Idempotency-Key header is empty.")
    if _UUID.fullmatch(value) is None:
        raise InvalidKey(
            'The Idempotency-Key header must be a UUID such as "8e03978e-40d5-43e8-bc93-6894a57f9324".'
        )
    return uuid.UUID(value)
