"""Stored responses: what is kept of a view's answer (the route's ``store_response``: ``"full"``,
``"location"`` or ``"encrypted"``, :doc:`/responses`), and how a retry gets it back; shared by every door
that answers HTTP, the multi-step engine and recovery.

A body larger than ``IDEM_MAX_RESPONSE_BYTES`` is never stored cut short, nor left unstored while the
request's writes commit: the request is refused with :class:`.ResponseNotStored` (500) and rolled back.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Collection, Mapping
from typing import Any, Literal, TypeAlias

from flask import Response

from ._cipher import ResponseCipher
from ._settings import parse_choice
from .errors import OperationFailed, ResponseNotStored, StoredResponseUnreadable

__all__ = [
    "failure_document",
    "NEVER_REPLAYED",
    "REPLAYED_HEADER",
    "STORE_CHOICES",
    "StoreResponse",
    "parse_store_response",
    "record_response",
    "replay_response",
]

logger = logging.getLogger("flask_idem")

#: Response header that marks a replayed response.
REPLAYED_HEADER = "Idempotent-Replayed"

#: What a route keeps of its responses for retries (``store_response``).
StoreResponse: TypeAlias = Literal["full", "location", "encrypted"]

STORE_CHOICES: tuple[StoreResponse, ...] = ("full", "location", "encrypted")

#: Headers never stored, whatever ``IDEM_REPLAY_HEADERS`` says: a replay must not hand one client's
#: session or credentials to whoever retries.
NEVER_REPLAYED = frozenset({"set-cookie", "authorization", "proxy-authorization"})


def parse_store_response(name: str, value: Any) -> StoreResponse:
    """``value`` as a :data:`StoreResponse` choice; ``name`` is the option it came from."""
    return parse_choice(name, value, STORE_CHOICES)


def record_response(
    response: Response,
    replay_headers: Collection[str],
    *,
    max_bytes: int | None = None,
    store: StoreResponse = "full",
    codec: ResponseCipher | None = None,
    request: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document stored for a response: status, the headers worth replaying, and the body.

    ``replay_headers`` are the lower-case names of the headers to keep (never :data:`NEVER_REPLAYED`).
    The body is kept as text when it is UTF-8 without NUL characters (which ``jsonb`` cannot hold), as
    base64 otherwise, so a replay is byte for byte the original.

    :param codec: encrypts the body when ``store`` is ``"encrypted"``.
    :param request: what the route's fingerprint policy keeps of the request (:mod:`._policy`).
    :raises ResponseNotStored: the body is over ``max_bytes``, or a 2xx under ``"location"`` has no
        ``Location``: the caller's transaction must roll back.
    """
    status = response.status_code
    headers = [
        [name, value]
        for name, value in response.headers.items()
        if (lowered := name.lower()) in replay_headers and lowered not in NEVER_REPLAYED
    ]
    record: dict[str, Any] = {"status": status}
    if request is not None:
        record["request"] = request
    if store == "location" and 200 <= status < 300:
        location = response.headers.get("Location")
        if not location:
            logger.error(
                "The %d answer of a route with store_response='location' has no Location header; it"
                " cannot be stored, and the request was rolled back.",
                status,
            )
            raise ResponseNotStored(
                "This route keeps only where its result is (the Location header) for a retry, and its"
                " answer gave none. Nothing was done."
            )
        record["headers"] = [["Location", location]]
        record["see_other"] = True
        return record
    record["headers"] = headers
    data = _read_body(response, max_bytes)
    if store == "encrypted":
        if codec is None:
            raise ResponseNotStored("This route keeps its answers encrypted, and no key is configured.")
        record["body_enc"] = codec.encrypt(data)
        return record
    try:
        text: str | None = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        record["body_b64"] = base64.b64encode(data).decode("ascii")
    else:
        record["body"] = text
    return record


def _read_body(response: Response, max_bytes: int | None) -> bytes:
    """The whole body, or :class:`ResponseNotStored` once it is known to be over ``max_bytes``.

    A file response (``send_file``) is read from its file, a streamed one from its generator, chunk by
    chunk, and no further than one byte past the limit; the response then sends what was read.
    """
    if response.is_sequence:  # the usual case: the body is in memory already
        data = response.get_data()
        if max_bytes is not None and len(data) > max_bytes:
            raise _too_large(f"{len(data)} bytes", max_bytes)
        return data
    announced = response.content_length
    if max_bytes is not None and announced is not None and announced > max_bytes:
        response.close()  # a file stays open otherwise
        raise _too_large(f"{announced} bytes", max_bytes)
    source = response.response
    close = getattr(source, "close", None)
    response.direct_passthrough = False  # a file response (send_file) is read into memory to be kept
    chunks: list[bytes] = []
    size = 0
    try:
        for chunk in response.iter_encoded():
            chunks.append(chunk)
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise _too_large(f"more than {max_bytes} bytes (streamed)", max_bytes)
    finally:
        if close is not None:
            close()
    data = b"".join(chunks)
    response.set_data(data)
    return data


def _too_large(size: str, max_bytes: int) -> ResponseNotStored:
    logger.error(
        "A response of %s is over IDEM_MAX_RESPONSE_BYTES (%d) and cannot be stored for retries; the"
        " request was rolled back.",
        size,
        max_bytes,
    )
    return ResponseNotStored(
        "The answer to this request is larger than the server keeps for retries, so the request was not"
        " carried out (nothing was changed). This is a server-side limit: retrying will not help."
    )


def replay_response(record: Mapping[str, Any], codec: ResponseCipher | None = None) -> Response:
    """Rebuild a stored response, marked with ``Idempotent-Replayed: true``.

    A stored 201 is replayed as 200: the resource was created by the first request, not by this one. A
    response stored as its ``Location`` only is replayed as ``303 See Other`` there.

    :raises StoredResponseUnreadable: an encrypted body whose key is no longer configured.
    """
    if record.get("see_other"):
        response = Response(status=303, headers=[tuple(h) for h in record["headers"]])
        response.headers[REPLAYED_HEADER] = "true"
        return response
    if "body_enc" in record:
        body = _decrypt(record["body_enc"], codec)
    elif "body" in record:
        body = record["body"].encode("utf-8")
    else:
        body = base64.b64decode(record["body_b64"])
    status = 200 if record["status"] == 201 else record["status"]
    response = Response(body, status=status, headers=[tuple(h) for h in record["headers"]])
    response.headers[REPLAYED_HEADER] = "true"
    return response


def _decrypt(token: str, cipher: ResponseCipher | None) -> bytes:
    body = None if cipher is None else cipher.decrypt(token)
    if body is None:
        logger.error(
            "A stored response is encrypted with a key that is not in IDEM_RESPONSE_KEYS (any more);"
            " it cannot be replayed. Keep a retired key while its routes keep keys (IDEM_KEY_TTL or ttl=)."
        )
        raise StoredResponseUnreadable()
    return body


def failure_document() -> dict[str, Any]:
    """What is stored for a run given up (flagged for a person): the 500 a later retry is answered."""
    error = OperationFailed()
    return {
        "status": error.code,
        "headers": [["Content-Type", "application/problem+json"]],
        "body": error.get_body(),
    }
