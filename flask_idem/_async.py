"""``async def`` views and flow steps: run to completion through Flask's :meth:`~flask.Flask.ensure_sync`.

Flask runs a coroutine function with asgiref's ``async_to_sync``: in a WSGI worker thread it starts an
event loop of its own, on a new thread, runs the coroutine there to the end and returns its result,
while the request's thread waits. So everything the extension does around the view stays where it was:
the key is reserved before the coroutine starts and the transaction commits after it returned, on the
request's thread; the coroutine, and every awaitable in it, runs in between, inside that transaction.

What that means for the coroutine, which runs on another thread:

- ``flask.g``, ``flask.request`` and ``idem.connection`` work: asgiref runs it in a copy of the request
  thread's context, and Flask's contexts and the extension's state live in context variables.
- ``idem.connection`` is a synchronous psycopg connection. psycopg connections are thread-safe, and only
  one thread uses it at a time: the request's thread is waiting. A call on it blocks the coroutine's
  event loop while it runs, which under WSGI is a loop of this request alone.
- An object bound to an event loop (an ``httpx.AsyncClient``, an asyncpg pool) must be created inside the
  coroutine: each request, and each async flow step, gets a new loop.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

from flask import current_app

from .errors import ConfigurationError

__all__ = ["synchronous"]


def synchronous(func: Callable[..., Any], what: str) -> Callable[..., Any]:
    """``func`` itself when it is synchronous; for a coroutine function, a function that runs it through
    the current application's :meth:`~flask.Flask.ensure_sync` and returns its result.

    :param what: what ``func`` is, for the error message ("view", "step").
    :raises ConfigurationError: for a coroutine function when asgiref (``flask[async]``) is missing.
    """
    if not inspect.iscoroutinefunction(func):
        return func
    if importlib.util.find_spec("asgiref") is None:
        raise ConfigurationError(
            f"{func.__qualname__} is an async {what}, and Flask runs those with asgiref, which is not"
            " installed: install flask-idem[async] (or flask[async])."
        )

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        return current_app.ensure_sync(func)(*args, **kwargs)

    return run
