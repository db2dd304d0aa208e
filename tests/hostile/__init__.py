"""Hostile input: odd headers and bodies never cause a 5xx, a partial row, or an unescaped echo in the logs.

The properties run against the shop (its routes, its authentication, its problem handler) and against the
notes app (the extension alone), through the Werkzeug test client where it can carry the input, and over
raw sockets to real servers where only a server can decide: CR and LF inside header values, NUL bytes,
non-UTF-8 bytes, lying Content-Length, chunked bodies.

Every example starts from empty key, order, payment and note tables, so what is left afterwards is what
that one request wrote. The rule for what a request may leave behind:

- a ``201``: one completed key row and the one row it created;
- an error raised by the extension before the view ran (``400`` for the key or the body, ``401``, ``409``,
  ``413``, ``422`` key mismatch; their problem type is ``urn:flask-idem:problem:...``, or they are ``401``
  and ``413``): nothing at all;
- an error the view answered (the shop's ``422`` validation errors, ``415``, ``404``): one completed key
  row holding exactly that answer, and nothing else. Flask's own ``about:blank`` ``400`` comes from either
  side (a body cut short fails as it is read for the fingerprint; an empty JSON body fails in the view),
  so it leaves nothing or exactly its stored answer.
"""
