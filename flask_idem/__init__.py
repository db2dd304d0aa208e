"""flask-idem: idempotency keys for Flask, backed by PostgreSQL."""

import importlib.metadata
import typing as t

from ._deadline import DeadlineExceeded as DeadlineExceeded
from ._extension import Idempotency as Idempotency
from ._keys import HEADER as HEADER
from ._policy import Fingerprint as Fingerprint
from ._pool import ForkSafeConnectionPool as ForkSafeConnectionPool
from ._replay import REPLAYED_HEADER as REPLAYED_HEADER
from ._replay import StoreResponse as StoreResponse
from ._scopes import scope_id as scope_id
from ._settings import DEFAULT_REPLAY_HEADERS as DEFAULT_REPLAY_HEADERS
from ._settings import OnMismatch as OnMismatch
from ._settings import ScopeFunc as ScopeFunc
from ._settings import Settings as Settings
from ._timeouts import DEFAULT_CONNECT_OPTIONS as DEFAULT_CONNECT_OPTIONS
from .errors import ConfigurationError as ConfigurationError
from .errors import DatabaseFailed as DatabaseFailed
from .errors import DatabaseUnavailable as DatabaseUnavailable
from .errors import IdempotencyError as IdempotencyError
from .errors import InvalidBody as InvalidBody
from .errors import InvalidKey as InvalidKey
from .errors import KeyExpired as KeyExpired
from .errors import KeyInUse as KeyInUse
from .errors import KeyMismatch as KeyMismatch
from .errors import MissingKey as MissingKey
from .errors import NoScope as NoScope
from .errors import OperationFailed as OperationFailed
from .errors import OutcomePending as OutcomePending
from .errors import ResponseNotStored as ResponseNotStored
from .errors import StoredResponseUnreadable as StoredResponseUnreadable
from .errors import WebhookRejected as WebhookRejected
from .flow import Flow as Flow
from .flow import OutcomeUnknown as OutcomeUnknown
from .flow import Run as Run

__all__ = [
    "DEFAULT_CONNECT_OPTIONS",
    "DEFAULT_REPLAY_HEADERS",
    "HEADER",
    "REPLAYED_HEADER",
    "ConfigurationError",
    "DatabaseFailed",
    "DatabaseUnavailable",
    "DeadlineExceeded",
    "Fingerprint",
    "Flow",
    "ForkSafeConnectionPool",
    "Idempotency",
    "IdempotencyError",
    "InvalidBody",
    "InvalidKey",
    "KeyExpired",
    "KeyInUse",
    "KeyMismatch",
    "MissingKey",
    "NoScope",
    "OnMismatch",
    "OperationFailed",
    "OutcomePending",
    "OutcomeUnknown",
    "ResponseNotStored",
    "Run",
    "ScopeFunc",
    "Settings",
    "StoreResponse",
    "StoredResponseUnreadable",
    "WebhookRejected",
    "scope_id",
]

if t.TYPE_CHECKING:
    __version__: str  # see __getattr__


def __getattr__(name: str) -> t.Any:
    """``__version__``, the installed distribution's version (from git when it was built, as in
    ``0.1.0.dev420+g1a2b3c4``), read when asked for."""
    if name == "__version__":
        return importlib.metadata.version("flask-idem")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
