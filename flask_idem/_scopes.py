"""Organisation ids that are not integers: UUID and text tenant ids mapped to the key table's ``bigint``.

The mapping is a keyed BLAKE2b hash cut to 63 bits: deterministic across processes and releases (it must
never change: stored keys are found by it). What a collision would mean, and why the scope is a
namespace and never an authorisation check, is in :doc:`/http`.
"""

from __future__ import annotations

import hashlib
import uuid

__all__ = ["scope_id"]

_SALT = b"flask-idem/scope"


def scope_id(tenant: uuid.UUID | str | bytes | int) -> int:
    """A stable non-negative 63-bit organisation id for a UUID, text or bytes tenant id.

    An ``int`` that fits a ``bigint`` is returned as it is, so a scope can pass any id through.

    :raises TypeError: for other types, ``bool`` included.
    """
    if isinstance(tenant, bool):
        raise TypeError("A tenant id cannot be a bool.")
    if isinstance(tenant, int):
        if not -(2**63) <= tenant < 2**63:
            raise ValueError(f"Integer tenant ids must fit a bigint; use str({tenant}) to hash it.")
        return tenant
    if isinstance(tenant, uuid.UUID):
        data = b"u" + tenant.bytes
    elif isinstance(tenant, str):
        data = b"s" + tenant.encode("utf-8")
    elif isinstance(tenant, bytes):
        data = b"b" + tenant
    else:
        raise TypeError(f"A tenant id must be a UUID, str, bytes or int, not {type(tenant).__name__}.")
    digest = hashlib.blake2b(data, digest_size=8, key=_SALT).digest()
    return int.from_bytes(digest, "big") >> 1
