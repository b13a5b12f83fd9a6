"""CommDebugMode: count collectives (and bytes) issued through the platform layer."""
from __future__ import annotations

from collections import Counter

from hyper_parallel.platform import comm_record


class CommDebugMode:
    """Context manager that counts every collective hyper_parallel issues inside it.

    Example::

        with CommDebugMode() as comm:
            y = x.redistribute(mesh, [Replicate()])
        comm.get_comm_counts()      # {'all_gather': 1}
        comm.get_total_counts()     # 1
        comm.get_bytes()            # {'all_gather': 12288}  bytes this rank sent

    Bytes follow :func:`hyper_parallel.platform.comm_record.bytes_sent` (what this
    rank puts on the wire under a bandwidth-optimal algorithm). Nested modes each
    see all collectives.
    """

    def __init__(self):
        self.counts = Counter()
        self.bytes = Counter()
        self.events = []

    def _record(self, kind, nbytes, group_size, group_ranks):
        self.counts[kind] += 1
        self.bytes[kind] += nbytes
        self.events.append((kind, nbytes, group_ranks))

    def __enter__(self):
        self.counts.clear()
        self.bytes.clear()
        self.events.clear()
        comm_record.push_recorder(self._record)
        return self

    def __exit__(self, *exc):
        comm_record.pop_recorder(self._record)
        return False

    def get_comm_counts(self) -> dict:
        return dict(self.counts)

    def get_total_counts(self) -> int:
        return sum(self.counts.values())

    def get_bytes(self) -> dict:
        return dict(self.bytes)

    def get_total_bytes(self) -> int:
        return sum(self.bytes.values())
