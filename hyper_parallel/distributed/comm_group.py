"""``CommGroup``: the ranks of a communication group, its torch process group, and the mesh dims it serves."""
from __future__ import annotations


class CommGroup:
    """A communication group: the global ranks in it and the torch process group.

    ``ranks`` is ordered by in-group rank; ``rank`` is this process's index in it
    (or -1 when the process is not a member).
    """

    __slots__ = ("ranks", "handle", "rank", "size", "dims")

    def __init__(self, ranks, handle, my_global_rank):
        self.ranks = tuple(ranks)
        self.handle = handle
        self.size = len(self.ranks)
        self.rank = self.ranks.index(my_global_rank) if my_global_rank in self.ranks else -1
        self.dims = ()  # "mesh dim 'tp' of mesh (2, 2)"...: named in collective errors (see name_dim)

    def name_dim(self, description: str) -> None:
        """Record that this group serves a mesh dim (``description``), for the messages of failed collectives.

        Meshes share groups over the same ranks: the three most recent descriptions are kept, newest first.
        """
        self.dims = ((description,) + tuple(d for d in self.dims if d != description))[:3]

    def __repr__(self):
        return f"CommGroup(ranks={self.ranks})"
