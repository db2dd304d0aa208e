"""Retention on the partitioned key table: partitions made ahead, and dropped whole.

The key table and its compact tombstones (``<table>_tombstones``) are partitioned by range of
``expires_at`` (:mod:`flask_idem.migrations.v4_partitions`). One room a concept, each with its part of
the guarantees, and their statements in ``partitions.sql``:

- :mod:`.run`: :func:`maintain`, one run of ``flask idem purge``, and why two runs at once are safe;
- :mod:`.ahead`: partitions made ahead, and the spare one;
- :mod:`.retire`: a passed partition's tombstones written, then detached and dropped without blocking
  anyone;
- :mod:`.overview`: the catalog's view of them for ``flask idem stats``, the metrics and the health check;
- :mod:`.tables`: the tables' names and statements, and their partitions as the catalog lists them;
- :mod:`.clock`: the time arithmetic, and why nothing is written into a partition once its range passed.
"""

from .clock import MAX_GRACE as MAX_GRACE
from .clock import duration as duration
from .overview import Overview as Overview
from .overview import overview as overview
from .run import maintain as maintain
from .tables import Partition as Partition
from .tables import RetentionReport as RetentionReport
from .tables import partitions as partitions

__all__ = [
    "MAX_GRACE",
    "Overview",
    "Partition",
    "RetentionReport",
    "duration",
    "maintain",
    "overview",
    "partitions",
]
