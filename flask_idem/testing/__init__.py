"""Test kit: prove with pytest that your own routes are safe to retry.

Enable it in your top-level ``conftest.py``::

    pytest_plugins = ["flask_idem.testing"]

The plugin brings the database fixtures (``idem_server_url``, ``idem_database_url``, ``idem_db``); the
checks are plain functions that take your application or its test client, send real requests, and raise
:class:`NotRetrySafe` with what went wrong in plain words. See "Testing your routes" in the documentation.
"""

from ._checks import check_in_flight as check_in_flight
from ._checks import check_mismatch as check_mismatch
from ._checks import check_replay as check_replay
from ._checks import check_scope as check_scope
from ._checks import hammer as hammer
from ._core import Effect as Effect
from ._core import NotRetrySafe as NotRetrySafe
from ._core import Rows as Rows
from ._core import WorkerKilled as WorkerKilled
from ._fixtures import DATABASE_ENV as DATABASE_ENV
from ._fixtures import embedded_server_url as embedded_server_url
from ._fixtures import idem_database_url as idem_database_url
from ._fixtures import idem_db as idem_db
from ._fixtures import idem_server_url as idem_server_url
from ._flows import crash_between_steps as crash_between_steps
from ._lint import unprotected_routes as unprotected_routes
from ._webhooks import check_webhook_redelivery as check_webhook_redelivery

__all__ = [
    "DATABASE_ENV",
    "Effect",
    "NotRetrySafe",
    "Rows",
    "WorkerKilled",
    "check_in_flight",
    "check_mismatch",
    "check_replay",
    "check_scope",
    "check_webhook_redelivery",
    "crash_between_steps",
    "embedded_server_url",
    "hammer",
    "idem_database_url",
    "idem_db",
    "idem_server_url",
    "unprotected_routes",
]
