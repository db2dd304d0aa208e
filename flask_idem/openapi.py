"""The idempotency contract in an OpenAPI 3 document: an `apispec`_ plugin.

The IETF draft "The Idempotency-Key HTTP Header Field" asks a resource to publish its idempotency
behaviour. :class:`IdempotencyPlugin` does it from the routes themselves: every write operation of a
decorated view gets the ``Idempotency-Key`` parameter, the ``Idempotent-Replayed`` header and the replay
of a ``201``, the problem responses the extension may answer (``400``, ``409``, ``410``, ``422``,
``503``, and the ``303`` of a late retry or of a route that keeps only the ``Location``) and an
``x-idempotency`` object with the same facts for machines; ``docs/openapi.rst`` shows a whole operation.

apispec is an optional dependency: install ``flask-idem[openapi]``.

.. _apispec: https://apispec.readthedocs.io/
"""

from __future__ import annotations

import copy
from typing import Any

from apispec import APISpec, BasePlugin
from flask import Flask, current_app, has_app_context
from werkzeug.routing import Rule

from ._keys import HEADER
from ._policy import Fingerprint
from ._replay import REPLAYED_HEADER
from ._state import get_state
from ._view import OPTIONS_ATTR, ViewOptions
from .errors import (
    PROBLEM_JSON,
    ConfigurationError,
    DatabaseUnavailable,
    IdempotencyError,
    InvalidBody,
    InvalidKey,
    KeyExpired,
    KeyInUse,
    KeyMismatch,
    MissingKey,
    OutcomePending,
)

__all__ = ["PROBLEM_SCHEMA", "IdempotencyPlugin"]

#: The operations a decorated view protects; reads pass through it untouched.
WRITE_METHODS = ("post", "put", "patch", "delete")

#: The ``Problem`` schema component registered when the document has none of that name (RFC 9457).
PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "An RFC 9457 problem document; extension members may follow.",
    "properties": {
        "type": {"type": "string", "description": "A URI reference: about:blank or urn:flask-idem:..."},
        "title": {"type": "string"},
        "status": {"type": "integer", "minimum": 400, "maximum": 599},
        "detail": {"type": "string"},
        "retryable": {
            "type": "boolean",
            "description": (
                "Whether the same request with the same Idempotency-Key may get another answer later (after"
                " Retry-After, when the answer has one): true for 409 and 503, false for 400, 410 and 422."
            ),
        },
        "retry_after": {"type": "integer", "description": "Seconds, as in the Retry-After header."},
        "retention": {
            "type": "object",
            "description": "409, 410 and 422: how long keys are kept (response_seconds, tombstone_seconds).",
        },
    },
    "required": ["type", "title", "status", "retryable"],
    "additionalProperties": True,
}

_RETRY_AFTER = {
    "description": "Seconds to wait before retrying with the same Idempotency-Key.",
    "required": True,
    "schema": {"type": "integer"},
}

_REPLAYED_SCHEMA = {"type": "string", "enum": ["true"]}

_MAYBE_REPLAYED = {
    "description": "Present on a replay: an earlier request with this key got this answer.",
    "required": False,
    "schema": _REPLAYED_SCHEMA,
}

_CONFLICT = (
    "A request with the same Idempotency-Key is still being processed; retry with the same key after"
    " Retry-After seconds to receive its result."
)
_MISMATCH = (
    "The Idempotency-Key was already used for a different request (another method, path, query, media"
    " type or body)."
)
#: What the default policy counts: the whole request, the body's media type included.
_WHOLE_REQUEST = Fingerprint().counted()
_EXPIRED = (
    "The request first sent with this Idempotency-Key was carried out, and its stored answer has expired."
    " It will not be carried out again; a new operation needs a new key."
)
_UNAVAILABLE = (
    "Unavailable for now: the database cannot be reached, or a call this request depends on ended without"
    " a known outcome. Retry with the same key after Retry-After seconds; it is never carried out twice."
)


class IdempotencyPlugin(BasePlugin):
    """Add flask-idem's contract to the operations of decorated views: an ``extra_plugins`` entry of
    flask-smorest's :class:`~flask_smorest.Api`, or a plugin of an :class:`~apispec.APISpec` beside
    apispec-webframeworks' ``FlaskPlugin`` (the sections above show both).

    A view is found from the ``view`` argument of :meth:`~apispec.APISpec.path`, or from its ``rule``
    (what flask-smorest passes). Operations are described only if they are in the document already: the
    plugin completes them, it does not invent them, and what the document already says wins.

    :param app: the application whose configuration (``IDEM_REQUIRE_KEY``, ``IDEM_KEY_TTL``,
        ``IDEM_ON_MISMATCH``) and routes are read; else the ``app`` passed to ``spec.path``, else the
        current application.
    :param problem_schema: the name of the schema component that describes problem documents. If the
        document has none of that name when it is first needed, :data:`PROBLEM_SCHEMA` is registered
        under it; register your own first to describe more members.
    """

    def __init__(self, app: Flask | None = None, *, problem_schema: str = "Problem") -> None:
        self._app = app
        self.problem_schema = problem_schema
        self._spec: APISpec | None = None

    def init_spec(self, spec: APISpec) -> None:
        """Keep the spec, to register the ``Problem`` schema on first use.

        :raises ConfigurationError: for an OpenAPI 2 document.
        """
        if spec.openapi_version.major < 3:
            raise ConfigurationError("IdempotencyPlugin describes OpenAPI 3 documents only.")
        self._spec = spec

    def operation_helper(
        self,
        path: str | None = None,
        operations: dict[Any, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Complete the write operations of a decorated view (called by :meth:`apispec.APISpec.path`)."""
        view, rule = kwargs.get("view"), kwargs.get("rule")
        if not operations or (view is None and not isinstance(rule, Rule)):
            return
        app = self._application(kwargs.get("app"))
        if view is None:
            assert isinstance(rule, Rule)
            view = app.view_functions.get(rule.endpoint)
        for method, operation in operations.items():
            options = _options(view, method) if method in WRITE_METHODS else None
            if options is not None:
                self._complete(operation, _Contract(app, options))

    def _application(self, app: Flask | None) -> Flask:
        if app is not None:
            return app
        if self._app is not None:
            return self._app
        if has_app_context():
            result: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
            return result
        raise ConfigurationError(
            "IdempotencyPlugin needs the application: pass IdempotencyPlugin(app), pass app= to"
            " spec.path(), or build the document in an application context."
        )

    def _complete(self, operation: dict[str, Any], contract: _Contract) -> None:
        parameters = operation.setdefault("parameters", [])
        if contract.from_header and not any(
            isinstance(p, dict) and p.get("name") == HEADER for p in parameters
        ):
            parameters.append(contract.parameter())
        responses = operation.setdefault("responses", {})
        for status in [s for s in responses if str(s).startswith("2")]:
            response = responses[status]
            if not isinstance(response, dict):
                continue
            if contract.store_response == "location":
                continue  # a retry gets the 303 below, not this answer again
            if str(status) == "201" and not any(str(s) == "200" for s in responses):
                responses["200"] = _replay_of(response)
            else:
                response.setdefault("headers", {}).setdefault(REPLAYED_HEADER, dict(_MAYBE_REPLAYED))
        if contract.store_response == "location" and not any(str(s) == "303" for s in responses):
            responses["303"] = {
                "description": (
                    "A retry: the request was carried out, and its result is at the Location the first"
                    " answer gave. The first answer's body is not kept, so it is not sent again."
                ),
                "headers": {
                    "Location": _location(responses) or {"schema": {"type": "string"}, "required": True},
                    REPLAYED_HEADER: dict(_MAYBE_REPLAYED),
                },
            }
        if contract.tombstone_ttl and not any(str(s) == "303" for s in responses):
            location = _location(responses)
            if location is not None:
                responses["303"] = {
                    "description": (
                        "A retry after the stored answer expired: the request was carried out, and its"
                        " result is at the Location the first answer gave."
                    ),
                    "headers": {"Location": location},
                }
        documented = {str(s): s for s in responses}
        for status, description in contract.problems().items():
            if status not in documented:
                responses[status] = self._problem(description, retry=status in ("409", "503"))
            elif status in ("409", "503") and isinstance(responses[documented[status]], dict):
                responses[documented[status]].setdefault("headers", {}).setdefault(
                    "Retry-After", dict(_RETRY_AFTER)
                )
        operation["x-idempotency"] = contract.extension()

    def _problem(self, description: str, *, retry: bool) -> dict[str, Any]:
        response: dict[str, Any] = {
            "description": description,
            "content": {PROBLEM_JSON: {"schema": self._problem_ref()}},
        }
        if retry:
            response["headers"] = {"Retry-After": dict(_RETRY_AFTER)}
        return response

    def _problem_ref(self) -> dict[str, str]:
        spec = self._spec
        if spec is None:
            raise ConfigurationError("IdempotencyPlugin was not initialised by an APISpec.")
        components = spec.components
        name = self.problem_schema
        if name not in components.schemas and name not in components.schemas_lazy:
            components.schema(name, copy.deepcopy(PROBLEM_SCHEMA))
        return components.get_ref("schema", name)


def _options(view: Any, method: str) -> ViewOptions | None:
    """The options :meth:`.Idempotency.idempotent` left on ``view`` (or on a ``MethodView``'s method)."""
    options = getattr(view, OPTIONS_ATTR, None)
    view_class = getattr(view, "view_class", None)
    if options is None and view_class is not None:
        options = getattr(getattr(view_class, method, None), OPTIONS_ATTR, None)
    return options if isinstance(options, ViewOptions) else None


def _location(responses: dict[Any, Any]) -> Any:
    """The ``Location`` header a success response documents, if one does."""
    for status, response in responses.items():
        if str(status).startswith("2") and isinstance(response, dict):
            location = response.get("headers", {}).get("Location")
            if location is not None:
                return copy.deepcopy(location)
    return None


def _replay_of(created: dict[str, Any]) -> dict[str, Any]:
    """The ``200`` a retry gets for a stored ``201``: the same body and headers, marked as a replay."""
    replay = copy.deepcopy(created)
    replay["description"] = (
        "A replay: the 201 answer of the first request with this Idempotency-Key, sent again unchanged"
        " except for the status."
    )
    replay.setdefault("headers", {})[REPLAYED_HEADER] = {
        "description": "This answer was stored by an earlier request with the same key.",
        "required": True,
        "schema": _REPLAYED_SCHEMA,
    }
    return replay


class _Contract:
    """What one decorated route promises: the route's options over the application's settings."""

    def __init__(self, app: Flask, options: ViewOptions) -> None:
        settings = get_state(app).settings
        self.multi_step = options.flow is not None
        self.required: bool = self.multi_step or (
            settings.require_key if options.required is None else options.required
        )
        self.ttl = int(options.key_ttl(settings))
        self.tombstone_ttl = int(settings.tombstone_ttl)
        #: Whether the key comes from the header; ``key_from=`` takes it from elsewhere, such as a form field.
        self.from_header = options.key_from is None
        self.on_mismatch: str = options.on_mismatch or settings.on_mismatch
        self.policy = options.fingerprint
        self.store_response = options.store_response

    def parameter(self) -> dict[str, Any]:
        """The ``Idempotency-Key`` header parameter."""
        description = (
            "A UUID the client generates once per operation and repeats on every retry; the structured-field"
            ' form "<uuid>" (in double quotes) is accepted too. The key and its answer are kept for'
            f" {_duration(self.ttl)}: a retry within that time gets the first answer again."
        )
        if self.tombstone_ttl:
            description += (
                f" Then the key is remembered for {_duration(self.tombstone_ttl)}: a retry is never run again"
                " (303 to the first answer's Location, or 410)."
            )
        if self.policy is not None:
            description += (
                f" A retry must repeat what this route compares: {'; '.join(self.policy.counted())}."
            )
        if not self.required:
            description += " Without the header the request runs once, unprotected against retries."
        return {
            "name": HEADER,
            "in": "header",
            "required": self.required,
            "description": description,
            "schema": {"type": "string", "format": "uuid"},
        }

    def problems(self) -> dict[str, str]:
        """The statuses the extension itself may answer, with their descriptions."""
        result = {
            "400": (
                f"The {HEADER if self.from_header else 'idempotency key'} is"
                f" {'missing or ' if self.required else ''}not one UUID, or the JSON body cannot be parsed."
            ),
            "409": _CONFLICT,
            "503": _UNAVAILABLE,
        }
        if self.on_mismatch == "reject":
            result["422"] = _MISMATCH
            if self.policy is not None:
                result["422"] = (
                    "The Idempotency-Key was already used for a different request. This route compares:"
                    f" {'; '.join(self.policy.counted())}. The problem's 'differs' member names the parts"
                    " that differ, when the server can tell."
                )
        if self.tombstone_ttl:
            result["410"] = _EXPIRED
        return dict(sorted(result.items()))

    def problem_types(self) -> list[type[IdempotencyError]]:
        """The errors behind the problem responses of :meth:`problems`, in order of status."""
        found: list[type[IdempotencyError]] = [MissingKey] if self.required else []
        found += [InvalidKey, InvalidBody, KeyInUse]
        if self.tombstone_ttl:
            found.append(KeyExpired)
        if self.on_mismatch == "reject":
            found.append(KeyMismatch)
        found.append(DatabaseUnavailable)
        if self.multi_step:
            found.append(OutcomePending)
        return found

    def extension(self) -> dict[str, Any]:
        """The ``x-idempotency`` object: the policy, for machines."""
        extension: dict[str, Any] = {
            "header": HEADER if self.from_header else None,
            "required": self.required,
            "keyRetentionSeconds": self.ttl,
            "tombstoneRetentionSeconds": self.tombstone_ttl,
            "fingerprint": list(_WHOLE_REQUEST),
            "onMismatch": self.on_mismatch,
            "multiStep": self.multi_step,
            "problemTypes": [
                {"type": error.problem_type, "status": error.code, "retryable": error.retryable}
                for error in self.problem_types()
            ],
        }
        if self.policy is not None:
            extension["fingerprint"] = self.policy.counted()
            extension["fingerprintPolicy"] = {
                "id": self.policy.id,
                **{k: v for k, v in self.policy.description.items() if v is not None},
                "previous": [earlier.id for earlier in self.policy.previous],
            }
        if self.store_response != "full":
            extension["storeResponse"] = self.store_response
        return extension


def _duration(seconds: int) -> str:
    """``86400`` -> ``"1 day"``: the largest unit that divides the period."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds % size == 0:
            count = seconds // size
            return f"{count} {unit}{'' if count == 1 else 's'}"
    raise AssertionError("unreachable: every integer divides by 1")
