"""flask-idem: idempotency keys for Flask, backed by PostgreSQL."""

from .errors import IdempotencyError as IdempotencyError
from .extension import Idempotency as Idempotency
from .keys import HEADER as HEADER

__all__ = ["HEADER", "Idempotency", "IdempotencyError"]
