"""Named blocks of SQL in the package's ``.sql`` files, composed with :mod:`psycopg.sql`.

A file holds statements for a reviewer to read as SQL (``_store.sql``, ``_outbox.sql``). Each block starts
with ``-- name: <name>``; lines that start with ``--`` are comments and are dropped, and white space is
collapsed (so no comment stands at the end of a line of SQL). A block named ``fragment <name>`` is a piece
that later blocks use as ``{name}``. A block named ``<name> citus`` replaces its namesake on a Citus
distributed table. Braces are filled in by name, ``%(name)s`` are parameters. The revisions of
:mod:`flask_idem.migrations` keep their DDL so too.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib.resources import files

from psycopg import sql

__all__ = ["SqlFile", "blocks"]

_NAME = re.compile(r"^-- name: (fragment )?(\w+)( citus)?$")


@functools.cache
def blocks(filename: str, distributed: bool) -> tuple[dict[str, str], dict[str, str]]:
    """The fragments and the statements of the package's file ``filename`` (a path under the package),
    comments dropped and white space collapsed; on Citus (``distributed``) a block named ``... citus``
    replaces its plain namesake."""
    fragments: dict[str, str] = {}
    statements: dict[str, str] = {}
    block: tuple[dict[str, str], str] | None = None
    lines: list[str] = []

    def close() -> None:
        if block is not None:
            target, name = block
            target[name] = " ".join(" ".join(lines).split())

    for line in files(__package__).joinpath(filename).read_text("utf-8").splitlines():
        match = _NAME.match(line)
        if match is not None:
            close()
            fragment, name, citus = match.groups()
            lines = []
            target = fragments if fragment else statements
            # A citus block wins on Citus wherever it stands; a plain one never replaces it there.
            keep = distributed if citus else not (distributed and name in target)
            block = (target, name) if keep else None
        elif not line.lstrip().startswith("--"):
            lines.append(line)
    close()
    return fragments, statements


class SqlFile:
    """The blocks of ``filename`` composed for one set of names (a table's, its indexes').

    The fragments are composed in the file's order, each with the names and the fragments before it,
    and join :attr:`names`; calling the object renders one statement.
    """

    def __init__(
        self,
        filename: str,
        names: Mapping[str, sql.Composable],
        *,
        distributed: bool,
    ) -> None:
        fragments, self._statements = blocks(filename, distributed)
        #: The names given, and the fragments composed with them.
        self.names: dict[str, sql.Composable] = dict(names)
        for fragment, text in fragments.items():
            self.names[fragment] = sql.SQL(text).format(**self.names)

    def __call__(self, block: str, **more: sql.Composable) -> bytes:
        """Statement ``block``, rendered once: executing a Composed would compose it again on every call."""
        return sql.SQL(self._statements[block]).format(**self.names, **more).as_bytes(None)
