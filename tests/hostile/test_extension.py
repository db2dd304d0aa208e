"""Hostile input to the extension alone: the notes app, without the shop's handlers."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from flask import Flask
from hypothesis import given
from hypothesis import strategies as st

from ..support.helpers import count
from ..support.notes_app import ORG
from .checks import (
    assert_not_echoed,
    assert_sound,
    clean,
)
from .strategies import (
    BODIES,
    CONTENT_TYPES,
    KEY_VALUES,
    SETTINGS,
)


@SETTINGS
@given(values=st.lists(KEY_VALUES, max_size=2), body=BODIES, content_type=CONTENT_TYPES)
def test_extension_alone(
    notes: Flask,
    db: psycopg.Connection[Any],
    logs: pytest.LogCaptureFixture,
    values: list[str],
    body: bytes,
    content_type: str,
) -> None:
    """Without the shop's handlers, the extension's own errors are problems, and its rows never partial."""
    clean(db)
    logs.clear()
    sent = [*ORG.items(), *(("Idempotency-Key", v) for v in values)]
    response = notes.test_client().post("/notes/optional", data=body, content_type=content_type, headers=sent)
    assert response.status_code < 500
    if response.status_code == 413:  # Flask's own answer, before the extension: this app has no handler
        assert len(body) > 1024
        assert count(db, "idempotency_keys") == count(db, "notes") == 0
    elif not values:  # no key: the route runs once, without a key row
        assert response.status_code == 201
        assert (count(db, "idempotency_keys"), count(db, "notes")) == (0, 1)
    else:
        assert_sound(db, response.status_code, response.content_type, response.get_data(), table="notes")
    assert_not_echoed(logs, *values, body, content_type)


def test_notes_oversized_body_is_413_before_any_key_row(notes: Flask, db: psycopg.Connection[Any]) -> None:
    """The extension reads the body only under the application's limit: 413, and no key row."""
    response = notes.test_client().post(
        "/notes/optional",
        data=b"[" + b"1," * 1000 + b"1]",
        content_type="application/json",
        headers={**ORG, "Idempotency-Key": str(uuid.uuid4())},
    )
    assert response.status_code == 413
    assert count(db, "idempotency_keys") == count(db, "notes") == 0
