"""What counts as the same request on one route: :class:`Fingerprint`, the route's fingerprint policy.

The default policy is the whole request (:func:`._fingerprint.fingerprint`), hashed exactly as it always
was. A policy narrows or widens that: parts of a JSON (or form) body chosen by JSON Pointer (RFC 6901),
named headers, and the value of a function of the request. Its digest is a SHA-256 over the policy's own
identity and each of its parts, length-prefixed, so it can only equal a digest made under that same policy
(``previous=`` keeps older ones comparable); a short digest of each part, stored with the response, lets
the 422 name the part that changed. :meth:`Fingerprint.compute` takes plain values, not Flask's request.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._canonical import ABSENT, at, encode, form, jsonlike, without
from ._fingerprint import canonical_query, decode_json, fingerprint, is_json
from .errors import ConfigurationError

__all__ = ["Fingerprint", "Fingerprinted", "RequestParts", "describe_mismatch"]

_FORM = "application/x-www-form-urlencoded"
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_SALT = b"flask-idem/fingerprint-policy/v1"

#: Headers a policy may not name: the key itself, and credentials, which may change between two attempts
#: of one operation (a refreshed token) and already decide the key's organisation.
_REFUSED_HEADERS = frozenset({"idempotency-key", "authorization", "proxy-authorization", "cookie"})

#: Key of the stored response document that records the policy and its part digests.
STORED = "request"


@dataclass(frozen=True, slots=True)
class RequestParts:
    """The parts of a request a fingerprint is made of; plain values, read from the request once."""

    method: str
    path: str
    query: bytes
    mimetype: str
    body: bytes
    #: The values of each header the policy names, by its lower-case name.
    headers: Mapping[str, Sequence[str]]
    #: What the policy's function returned; ``None`` when it has none.
    custom: Any = None


@dataclass(frozen=True, slots=True)
class Fingerprinted:
    """A request's fingerprint under one policy, with a short digest of each part (none for the default)."""

    sha: bytes
    #: Part name (a header's by its lower-case name) -> hex digest, stored with the response to explain a
    #: later 422. ``None``: the default policy, which stores nothing more than the fingerprint.
    parts: dict[str, str] | None = None


def _pointer(text: Any, option: str) -> tuple[str, ...]:
    """The reference tokens of a JSON Pointer (RFC 6901), or :class:`ConfigurationError`."""
    if not isinstance(text, str) or not text.startswith("/"):
        raise ConfigurationError(
            f"Fingerprint({option}=...) takes JSON Pointers such as '/amount' or '/items/0/price', not"
            f" {text!r}: each starts with '/' ('' would be the whole body; leave {option} out instead)."
        )
    tokens = text[1:].split("/")
    for token in tokens:
        if re.search(r"~(?![01])", token):
            raise ConfigurationError(
                f"{text!r} is not a JSON Pointer: '~' must be written '~0', '/' as '~1'."
            )
    if "-" in tokens:
        raise ConfigurationError(
            f"{text!r} names '-', the element after the end of an array, which no body has; name an index."
        )
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in tokens)


def _inside(inner: tuple[str, ...], outer: tuple[str, ...]) -> bool:
    """Whether ``inner`` is ``outer`` or a part of it."""
    return inner[: len(outer)] == outer


def _show(tokens: tuple[str, ...]) -> str:
    return "/" + "/".join(t.replace("~", "~0").replace("/", "~1") for t in tokens)


def _no_overlap(pointers: Sequence[tuple[str, ...]], option: str) -> None:
    for i, one in enumerate(pointers):
        for other in pointers[i + 1 :]:
            if _inside(one, other) or _inside(other, one):
                raise ConfigurationError(
                    f"Fingerprint({option}=...) names {_show(one)!r} and {_show(other)!r}, one inside the"
                    " other; name each part once."
                )


def _header_name(name: Any) -> str:
    if not isinstance(name, str) or not _TOKEN.fullmatch(name):
        raise ConfigurationError(f"Fingerprint(headers=...) takes header names, not {name!r}.")
    if name.lower() in _REFUSED_HEADERS:
        raise ConfigurationError(
            f"Fingerprint(headers=...) cannot name {name}: the Idempotency-Key is the key itself, and"
            " credentials already decide whose key it is and may change between two attempts of one"
            " operation (a refreshed token), which would make every such retry a 422."
        )
    return name


def _pointers(
    include: Sequence[Any] | None, exclude: Sequence[Any]
) -> tuple[list[tuple[str, ...]] | None, list[tuple[str, ...]]]:
    """The reference tokens of the pointers ``include`` (``None``: the whole body) and ``exclude``, checked:
    no part named twice, or inside another of its list, and each part left out inside an included one."""
    included = None if include is None else [_pointer(p, "include") for p in include]
    excluded = [_pointer(p, "exclude") for p in exclude]
    _no_overlap(included or [], "include")
    _no_overlap(excluded, "exclude")
    for tokens in excluded:
        if included is not None and not any(_inside(tokens, outer) and tokens != outer for outer in included):
            raise ConfigurationError(
                f"Fingerprint(exclude=...) names {_show(tokens)!r}, which is not inside any included"
                " part: only the included parts count, so there is nothing to leave out."
            )
    return included, excluded


#: A part of the body that counts: its name, its pointer's tokens, and the tokens left out of it (below it).
_BodyPart = tuple[str, tuple[str, ...], list[tuple[str, ...]]]


def _body_parts(include: list[tuple[str, ...]] | None, exclude: list[tuple[str, ...]]) -> list[_BodyPart]:
    """Each part of the body that counts (the whole body when ``include`` is ``None``), in a stable order."""
    if include is None:
        return [(_named("body", exclude), (), exclude)]
    parts = []
    for tokens in sorted(include):
        inner = [t for t in exclude if _inside(t, tokens)]
        parts.append((_named(f"body {_show(tokens)}", inner), tokens, [t[len(tokens) :] for t in inner]))
    return parts


def _strings(value: Any, option: str) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigurationError(f"Fingerprint({option}=...) takes a list, not {value!r}.")
    return tuple(value)


class Fingerprint:
    """What counts as the same request on a route: pass one to ``@idem.idempotent(fingerprint=...)``
    (:doc:`/fingerprints` explains each part, with examples).

    The method, the path, the query and the body's media type always count. Parts of the body are JSON
    Pointers (RFC 6901) into a JSON body, or into a form body read as ``{"field": ["value", ...]}``; any
    other body counts whole. A part the request does not have counts as absent, which differs from every
    value (``null`` included). ``Fingerprint()`` with no argument is the default policy.

    :param include: only these parts of the body count (``[]``: none of it). Default: all of it.
    :param exclude: these parts of the body do not count. With ``include``, each must lie inside one of
        its parts.
    :param headers: request headers that count, by name in any letter case: their values, in order, or
        their absence. Not ``Authorization``, ``Cookie`` or ``Idempotency-Key``.
    :param custom: a function called during the request with no argument (read :data:`flask.request`)
        that returns a JSON-like value (``dict`` with ``str`` keys, ``list``, ``tuple``, ``str``, ``int``,
        finite ``float`` or ``Decimal``, ``bool``, ``None``) which counts too. It must not fail on a body
        it does not expect (that would be a 500): return ``None`` for what is missing.
    :param version: a name for the meaning of ``custom``, part of the policy's identity: change it when
        the function starts returning something else for the same request.
    :param previous: the policies the route had before, whose keys may still be stored (for the route's
        key retention after a change: ``IDEM_KEY_TTL`` or its ``ttl=``). A retry whose key was stored under
        one of them is compared under it, and a 422 names the parts that differ under it; without it, such
        a retry cannot be compared and gets a 422 that says the policy changed.
    :raises ConfigurationError: for a malformed pointer or header name, or parts named twice.
    """

    def __init__(
        self,
        *,
        include: Iterable[str] | None = None,
        exclude: Iterable[str] = (),
        headers: Iterable[str] = (),
        custom: Callable[[], Any] | None = None,
        version: str | int | None = None,
        previous: Iterable[Fingerprint] = (),
    ) -> None:
        self.include = None if include is None else tuple(_strings(include, "include"))
        self.exclude = _strings(exclude, "exclude")
        self.headers = tuple(_header_name(h) for h in _strings(headers, "headers"))
        self.custom = custom
        self.version = version
        self.previous = _strings(previous, "previous")
        if custom is not None and not callable(custom):
            raise ConfigurationError(f"Fingerprint(custom=...) takes a function, not {custom!r}.")
        if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
            raise ConfigurationError(f"Fingerprint(version=...) takes a str or an int, not {version!r}.")
        if any(not isinstance(p, Fingerprint) for p in self.previous):
            raise ConfigurationError("Fingerprint(previous=...) takes a list of Fingerprint objects.")
        self._include, self._exclude = _pointers(self.include, self.exclude)
        if len({h.lower() for h in self.headers}) != len(self.headers):
            raise ConfigurationError("Fingerprint(headers=...) names a header twice.")
        # Precomputed, not per request: each part of the body that counts, its name and what is left out.
        self._body = _body_parts(self._include, self._exclude)
        #: Whether this is the default policy: the whole request, hashed as without a policy.
        self.default = self.include is None and not self._exclude and not self.headers and custom is None
        self._header_keys = tuple(sorted((h.lower(), h) for h in self.headers))
        # A header's part is named and hashed by its lower-case name, so that a deploy that only changes
        # the letter case of a name keeps the digests; messages spell it as the route does.
        self._spelled = {f"header {lower}": f"header {name}" for lower, name in self._header_keys}
        description = {
            "include": None if self._include is None else sorted(_show(t) for t in self._include),
            "exclude": sorted(_show(t) for t in self._exclude),
            "headers": [lower for lower, _ in self._header_keys],
            "custom": None if custom is None else _function_name(custom),
            "version": version,
        }
        #: What the policy counts, as published (:mod:`flask_idem.openapi`) and hashed into its identity.
        self.description: dict[str, Any] = description
        self._identity = hashlib.sha256(
            _SALT + json.dumps(description, sort_keys=True).encode("utf-8")
        ).digest()
        #: A short, stable name of the policy, stored with each response of its route.
        self.id = self._identity[:8].hex()

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.description.items() if v not in (None, [])}
        return f"Fingerprint({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def counted(self) -> list[str]:
        """What counts, in words: ``["method", "path", "query", "media type", "body except /ts", ...]``."""
        parts = ["method", "path", "query", "media type", *(name for name, _, _ in self._body)]
        parts.extend(f"header {name}" for _, name in self._header_keys)
        if self.custom is not None:
            parts.append("custom")
        return parts

    def mismatch_detail(self) -> str:
        """The 422's detail when the parts that differ cannot be named (:func:`describe_mismatch`)."""
        return (
            "This Idempotency-Key was already used for a different request. This route compares: "
            + "; ".join(self.counted())
            + ". (If the route counted other parts when the key was first used, the request cannot be"
            " compared and is refused.) A retry must repeat the original request; a new operation needs"
            " a new key."
        )

    def spelled(self, part: str) -> str:
        """A part's name as the route spells it: ``"header x-currency"`` -> ``"header X-Currency"``."""
        return self._spelled.get(part, part)

    @property
    def header_names(self) -> tuple[str, ...]:
        """The lower-case names of the headers that count."""
        return tuple(lower for lower, _ in self._header_keys)

    def compute(self, request: RequestParts) -> Fingerprinted:
        """The fingerprint of ``request`` under this policy.

        :raises InvalidBody: when a JSON body is malformed.
        :raises ConfigurationError: when ``custom`` returned something that is not JSON-like.
        """
        if self.default:
            return Fingerprinted(
                fingerprint(
                    method=request.method,
                    path=request.path,
                    query=request.query,
                    mimetype=request.mimetype,
                    body=request.body,
                )
            )
        mimetype = request.mimetype.strip().lower()
        parts: list[tuple[str, bytes]] = [
            ("method", request.method.upper().encode("ascii")),
            ("path", request.path.encode("utf-8", "surrogateescape")),
            ("query", canonical_query(request.query)),
            ("media type", mimetype.encode("latin-1", "replace")),
        ]
        parts.extend(self._body_parts(mimetype, request.body))
        for lower, _ in self._header_keys:
            values = request.headers.get(lower)
            parts.append((f"header {lower}", encode(list(values) if values else ABSENT)))
        if self.custom is not None:
            parts.append(("custom", encode(jsonlike(request.custom))))
        digest = hashlib.sha256(_SALT)
        digest.update(self._identity)
        shown: dict[str, str] = {}
        for name, data in parts:
            label = name.encode("utf-8", "surrogateescape")
            digest.update(b"%d:%s%d:" % (len(label), label, len(data)))
            digest.update(data)
            shown[name] = hashlib.sha256(data).digest()[:8].hex()
        return Fingerprinted(digest.digest(), shown)

    def _body_parts(self, mimetype: str, body: bytes) -> list[tuple[str, bytes]]:
        if body and is_json(mimetype):
            document: Any = decode_json(body)
        elif body and mimetype == _FORM:
            document = form(body)
        elif body:  # neither JSON nor a form: no parts to point at, the whole body counts
            return [(self._body[0][0] if self._include is None else "body", body)]
        else:
            document = ABSENT
        return [(name, encode(without(at(document, where), out))) for name, where, out in self._body]


def _function_name(function: Callable[..., Any]) -> str:
    """``module.qualname`` of a function (of its class for another callable, such as a partial)."""
    named = function if hasattr(function, "__qualname__") else type(function)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


def _named(name: str, left_out: Sequence[tuple[str, ...]]) -> str:
    """``"body except /a, /b"``: a part's name, with what is left out of it."""
    if not left_out:
        return name
    return f"{name} except {', '.join(sorted(_show(t) for t in left_out))}"


def describe_mismatch(
    policy: Fingerprint,
    stored: Mapping[str, Any] | None,
    now: Fingerprinted,
    under: Callable[[Fingerprint], Fingerprinted] | None = None,
) -> tuple[str, list[str]] | None:
    """Which parts of a reused key's request differ from the first, as a 422's detail and its names.

    Only the names of the parts are given, never their values. The parts are compared under the policy
    the first request was stored with: the route's, or one of its ``previous`` policies (the request is
    then fingerprinted under that one with ``under``). ``None`` when nothing more precise than
    :meth:`Fingerprint.mismatch_detail` can be said: the first request's stored response keeps no part
    digests (it was stored under the default policy, by the recovery job, or is a tombstone), or there is
    no stored response yet (a multi-step request in progress).

    :param stored: the stored response document of the first request.
    :param now: this request's fingerprint under ``policy``.
    :param under: this request's fingerprint under another policy (one of ``policy.previous``).
    """
    first = None if stored is None else stored.get(STORED)
    if not isinstance(first, dict):
        return None
    compared, parts = policy, now.parts
    if first.get("policy") != policy.id:
        earlier = next((p for p in policy.previous if p.id == first.get("policy")), None)
        if earlier is None or under is None:
            return _changed_policy()
        compared, parts = earlier, under(earlier).parts
    if parts is None:
        return None
    before = first.get("parts", {})
    differs = [compared.spelled(name) for name, digest in parts.items() if before.get(name) != digest]
    if not differs:
        return None
    detail = (
        "This Idempotency-Key was already used for a request that differs in: " + ", ".join(differs) + "."
    )
    if compared is not policy:
        detail += (
            " (Compared under the route's earlier fingerprint policy, under which the key was first used.)"
        )
    return detail + " A retry must repeat the original request; a new operation needs a new key.", differs


def _changed_policy() -> tuple[str, list[str]]:
    return (
        "This Idempotency-Key was first used while the route counted other parts of the request (its"
        " fingerprint policy has changed since, and the earlier one is not in Fingerprint(previous=[...])),"
        " so this request cannot be compared with the first one and is refused. The route can keep its old"
        " policy in previous= for as long as keys are kept; a new operation needs a new key.",
        ["fingerprint policy"],
    )
