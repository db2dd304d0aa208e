"""Stored responses: what is kept of a view's answer, and how a retry gets it back.

Shared by the atomic path (:mod:`._view`), the multi-step engine (:mod:`._engine`) and the recovery job.
"""

from __future__ import annotations

import base64
from collections.abc import Collection, Mapping
from typing import Any

from flask import Response

__all__ = ["REPLAYED_HEADER", "record_response", "replay_response"]

#: Response header that marks a replayed response.
REPLAYED_HEADER = "Idempotent-Replayed"


def record_response(response: Response, replay_headers: Collection[str]) -> dict[str, Any]:
    """The JSON document stored for a response: status, the headers worth replaying, and the body.

    ``replay_headers`` are the lower-case names of the headers to keep (``IDEM_REPLAY_HEADERS``).

    The body is kept as text when it is UTF-8 without NUL characters (which ``jsonb`` cannot hold), and
    as base64 otherwise, so a replay is byte for byte the original. Streamed and file responses are
    read into memory first: an idempotent view's answer must fit in the key table.
    """
    response.direct_passthrough = False  # a file response (send_file) is read into memory to be kept
    data = response.get_data()
    record: dict[str, Any] = {
        "status": response.status_code,
        "headers": [
            [name, value] for name, value in response.headers.items() if name.lower() in replay_headers
        ],
    }
    try:
        text: str | None = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        record["body_b64"] = base64.b64encode(data).decode("ascii")
    else:
        record["body"] = text
    return record


def replay_response(record: Mapping[str, Any]) -> Response:
    """Rebuild a stored response, marked with ``Idempotent-Replayed: true``.

    A stored 201 is replayed as 200: the resource was created by the first request, not by this one.
    """
    body = record["body"].encode("utf-8") if "body" in record else base64.b64decode(record["body_b64"])
    status = 200 if record["status"] == 201 else record["status"]
    response = Response(body, status=status, headers=[tuple(h) for h in record["headers"]])
    response.headers[REPLAYED_HEADER] = "true"
    return response
