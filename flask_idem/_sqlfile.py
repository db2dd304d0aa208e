"""Named blocks of SQL in the package's ``.sql`` files, composed with :mod:`psycopg.sql`.

A file holds statements for a reviewer to read as SQL (``_store.sql``, ``_outbox.sql``). Each block starts
with ``-- name: <name>``; lines that start with ``--`` are comments and are dropped, and white space is
collapsed. A block named ``fragment <name>`` is a piece that later blocks use as ``{name}``. A block whose
name is followed by variants (``citus``: on a Citus distributed table; ``partitioned``: on the key table
of layout 4 and later, partitioned by time) replaces its namesake where all of its variants apply; of
several that apply, the one with the most variants wins. Braces are filled in by name, ``%(name)s`` are
parameters.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib.resources import files

from psycopg import sql

__all__ = ["SqlFile", "blocks"]

_NAME = re.compile(r"^-- name: (fragment )?(\w+)((?: citus| partitioned)*)$")


@functools.cache
def blocks(
    filename: str, distributed: bool, partitioned: bool = False
) -> tuple[dict[str, str], dict[str, str]]:
    """The fragments and the statements of the package's file ``filename``, comments dropped and white
    space collapsed; on Citus (``distributed``) a block named ``... citus`` replaces its plain namesake,
    and on a partitioned key table (``partitioned``) one named ``... partitioned`` does."""
    active = {"citus"} if distributed else set()
    if partitioned:
        active.add("partitioned")
    fragments: dict[str, str] = {}
    statements: dict[str, str] = {}
    ranks: dict[tuple[bool, str], int] = {}
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
            fragment, name, variants = match.groups()
            wanted = set(variants.split())
            lines = []
            rank = len(wanted)
            keep = wanted <= active and rank >= ranks.get((bool(fragment), name), 0)
            if keep:
                ranks[bool(fragment), name] = rank
            block = ((fragments if fragment else statements), name) if keep else None
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
        partitioned: bool = False,
    ) -> None:
        fragments, self._statements = blocks(filename, distributed, partitioned)
        #: The names given, and the fragments composed with them.
        self.names: dict[str, sql.Composable] = dict(names)
        for fragment, text in fragments.items():
            self.names[fragment] = sql.SQL(text).format(**self.names)

    def __call__(self, block: str, **more: sql.Composable) -> bytes:
        """Statement ``block``, rendered once: executing a Composed would compose it again on every call."""
        return sql.SQL(self._statements[block]).format(**self.names, **more).as_bytes(None)
