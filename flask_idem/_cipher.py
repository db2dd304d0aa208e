"""Stored response bodies encrypted at rest, for routes with ``store_response="encrypted"``.

The keys come from ``IDEM_RESPONSE_KEYS``: Fernet keys, the first one encrypting, every one tried in turn
to decrypt (rotation: ``docs/responses.rst``). ``cryptography`` is optional: ``flask-idem[encryption]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import ConfigurationError

__all__ = ["ResponseCipher", "new_key", "parse_response_keys"]


def parse_response_keys(value: Any) -> tuple[str, ...]:
    """``IDEM_RESPONSE_KEYS`` as a tuple of key strings: a list of keys, or one string of keys separated
    by commas or whitespace (for an environment variable). The keys themselves are checked by
    :class:`ResponseCipher`."""
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(value.replace(",", " ").split())
    if isinstance(value, (list, tuple)) and all(isinstance(k, str) for k in value):
        return tuple(value)
    raise ConfigurationError("IDEM_RESPONSE_KEYS must be a list of keys (or one string of them).")


def new_key() -> str:
    """A new random key for ``IDEM_RESPONSE_KEYS`` (``flask idem new-response-key`` prints one)."""
    key: bytes = _fernet().generate_key()
    return key.decode("ascii")


def _fernet() -> Any:
    try:
        from cryptography import fernet
    except ImportError:
        raise ConfigurationError(
            "IDEM_RESPONSE_KEYS needs the 'cryptography' package: install flask-idem[encryption]."
        ) from None
    return fernet.Fernet


class ResponseCipher:
    """Encrypts stored bodies with the first of ``keys`` and decrypts with any of them.

    :raises ConfigurationError: when a key is not a Fernet key, or ``cryptography`` is missing. The
        message never repeats a key.
    """

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ConfigurationError("IDEM_RESPONSE_KEYS is empty.")
        fernet = _fernet()
        from cryptography.fernet import MultiFernet

        parsed = []
        for number, key in enumerate(keys, start=1):
            try:
                parsed.append(fernet(key))
            except (ValueError, TypeError):  # binascii.Error is a ValueError
                raise ConfigurationError(
                    f"Key {number} of IDEM_RESPONSE_KEYS is not a Fernet key (32 bytes, URL-safe base64);"
                    " make one with 'flask idem new-response-key'."
                ) from None
        self._keys = MultiFernet(parsed)

    def __repr__(self) -> str:
        return "ResponseCipher(<keys hidden>)"

    def encrypt(self, data: bytes) -> str:
        """``data`` encrypted with the first key, as text."""
        token: bytes = self._keys.encrypt(data)
        return token.decode("ascii")

    def decrypt(self, token: str) -> bytes | None:
        """The body ``token`` holds, or ``None`` when no configured key opens it."""
        from cryptography.fernet import InvalidToken

        try:
            data: bytes = self._keys.decrypt(token.encode("ascii"))
        except InvalidToken:
            return None
        return data
