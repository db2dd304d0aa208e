"""``async def`` views and flow steps: run to completion through Flask's :meth:`~flask.Flask.ensure_sync`.

Flask runs a coroutine function with asgiref's ``async_to_sync``, on an event loop of its own while the
request's thread waits, so the key is reserved before the coroutine starts and the transaction commits
after it returned; ``docs/async.rst`` says what that means for the coroutine. A thread whose own event
loop is running cannot wait through asgiref; there the view is run from a new thread, in a copy of the
context, the same way.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib.util
import inspect
import threading
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
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no event loop runs in this thread: the usual case, under WSGI
            return current_app.ensure_sync(func)(*args, **kwargs)
        return _from_another_thread(lambda: current_app.ensure_sync(func)(*args, **kwargs))

    return run


def _from_another_thread(call: Callable[[], Any]) -> Any:
    """``call()`` run from a new thread, in a copy of this thread's context, while this one waits.

    asgiref cannot wait for a coroutine from a thread whose event loop is running: a WSGI application
    called from such a thread (in a test process where Playwright's synchronous API or an async test
    framework holds a loop open) would fail. The request's thread waits here as it would for asgiref, so
    the transaction and the view's connection are used by one thread at a time as usual. ``call`` makes
    asgiref's wrapper in the new thread: asgiref before 3.12 gives a wrapper made where a loop runs to
    that loop, which is blocked here, and the request would hang.
    """
    context = contextvars.copy_context()
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append((True, context.run(call)))
        except BaseException as e:  # handed to the request's thread, which raises it
            outcome.append((False, e))

    thread = threading.Thread(target=target, name="flask-idem-async-view")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
