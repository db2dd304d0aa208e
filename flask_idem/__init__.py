"""flask-idem: idempotency keys for Flask, backed by PostgreSQL."""

from .errors import IdempotencyError as IdempotencyError
from .extension import Idempotency as Idempotency
from .flow import Flow as Flow
from .flow import OutcomeUnknown as OutcomeUnknown
from .flow import Run as Run
from .keys import HEADER as HEADER

__all__ = ["HEADER", "Flow", "Idempotency", "IdempotencyError", "OutcomeUnknown", "Run"]
