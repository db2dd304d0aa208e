"""The notes application as a newer release of flask-idem would run it: one that knows layout 2
(tests/support/second_layout/v2_labels.py). ``flask --app tests.support.newer_release:create_app idem
migrate`` is that release's migration, run while the code of layout 1 serves."""

from __future__ import annotations

import os

from flask import Flask

from .notes_app import build_app
from .second_layout import v2_labels

__all__ = ["LAYOUT", "create_app"]

#: The layout this release runs on.
LAYOUT = v2_labels.REVISION.layout


def create_app() -> Flask:
    """The notes application on ``FLASK_IDEM_DATABASE_URL`` (and the other ``FLASK_IDEM_*`` settings)."""
    return build_app(os.environ["FLASK_IDEM_DATABASE_URL"])[0]
