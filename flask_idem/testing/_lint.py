"""A report of the routes that accept unsafe methods without ``@idem.idempotent()``."""

from __future__ import annotations

from typing import Any

from flask import Flask

from .._view import OPTIONS_ATTR

__all__ = ["UNSAFE_METHODS", "unprotected_routes"]

#: Methods that may change state: a retry of one of them needs an idempotency key.
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _decorated(view: Any) -> bool:
    """Whether ``view`` went through ``@idem.idempotent()``, under any number of ``functools.wraps``."""
    seen = 0
    while view is not None and seen < 100:
        if OPTIONS_ATTR in getattr(view, "__dict__", {}):
            return True
        view, seen = getattr(view, "__wrapped__", None), seen + 1
    return False


def unprotected_routes(app: Flask) -> list[str]:
    """The routes of ``app`` that accept POST, PUT, PATCH or DELETE and are not made idempotent.

    A report, not a verdict: a route may be safe to retry by nature (a ``DELETE`` of one resource, a
    ``PUT`` that sets a whole value), or may not change state at all (a search sent as ``POST``). Each
    entry reads ``"POST /orders (orders.create_order)"``. For a class-based view, the method of the class
    that handles each unsafe method is looked at.
    """
    found = []
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: (r.rule, r.endpoint)):
        methods = sorted((rule.methods or set()) & UNSAFE_METHODS)
        view = app.view_functions.get(rule.endpoint)
        if not methods or view is None:
            continue
        view_class = getattr(view, "view_class", None)
        for method in methods:
            handler = getattr(view_class, method.lower(), None) if view_class is not None else view
            if not _decorated(handler):
                found.append(f"{method} {rule.rule} ({rule.endpoint})")
    return found
