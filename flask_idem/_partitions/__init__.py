"""Retention on the partitioned key table: partitions made ahead, and dropped whole (:doc:`/retention`).

One room a concept, their statements in ``partitions.sql``: :mod:`.run` (one run of ``flask idem purge``),
:mod:`.ahead` (partitions made ahead, and the spare one), :mod:`.retire` (passed ones dropped without
blocking anyone), :mod:`.overview` (the catalog's view of them), :mod:`.tables` (their names and
statements), :mod:`.clock` (the time arithmetic).
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
