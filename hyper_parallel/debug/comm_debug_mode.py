"""CommDebugMode: count collectives (and bytes) issued through the ground floor's collectives (hyper_parallel.distributed).

Counts are keyed by hyper_parallel's collective kinds (``"all_gather"``...) and
also answer PyTorch's keys (``torch.ops.c10d_functional.all_gather_into_tensor``,
``funcol.all_reduce``...), so code written for
``torch.distributed.tensor.debug.CommDebugMode`` runs unchanged.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Dict

from hyper_parallel.distributed import comm_keys
from hyper_parallel.distributed import comm_record


class CommCounts(dict):
    """Collective counts keyed by kind string that also accept PyTorch's key objects.

    A missing key reads as 0 (like torch's ``defaultdict(int)``). Iteration,
    equality and printing use the kind strings (``{'all_gather': 1}``).
    """

    __slots__ = ()

    @staticmethod
    def _kind(key):
        if isinstance(key, str):
            return key
        try:
            return comm_keys.torch_comm_keys().get(key, key)
        except TypeError:  # unhashable
            return key

    def __getitem__(self, key):
        return dict.get(self, self._kind(key), 0)

    def get(self, key: Any, default: Any = None) -> Any:
        return dict.get(self, self._kind(key), default)

    def __contains__(self, key):
        return dict.__contains__(self, self._kind(key))

    def __missing__(self, key):  # pragma: no cover - __getitem__ never raises
        return 0


class CommDebugMode:
    """Context manager that counts every collective hyper_parallel issues inside it.

    Example::

        with CommDebugMode() as comm:
            y = x.redistribute(mesh, [Replicate()])
        comm.get_comm_counts()      # {'all_gather': 1}
        comm.get_comm_counts()[torch.ops.c10d_functional.all_gather_into_tensor]   # 1 (torch's key)
        comm.get_total_counts()     # 1
        comm.get_bytes()            # {'all_gather': 12288}  bytes this rank sent
        comm.comm_module_counts     # {'Global': {'forward': {...}, 'backward': {...}}, 'MLP.net1': ...}

    Bytes follow :func:`hyper_parallel.distributed.comm_record.bytes_sent` (what this
    rank puts on the wire under a bandwidth-optimal algorithm). Nested modes each
    see all collectives. Per-module counts (``comm_module_counts``,
    ``get_parameter_info``, ``get_sharding_info``) use torch's module names
    (``"Global"``, ``"RootClass.child"``).
    """

    def __init__(self):
        self.comm_counts = CommCounts()
        self.bytes = Counter()
        self.events = []
        self.comm_module_counts = {}
        self._tracker = None

    @property
    def counts(self) -> Dict[Any, int]:
        return self.comm_counts

    def _record(self, kind, nbytes, group_size, group_ranks):
        c = self.comm_counts
        dict.__setitem__(c, kind, dict.get(c, kind, 0) + 1)
        self.bytes[kind] += nbytes
        self.events.append((kind, nbytes, group_ranks))
        tr = self._tracker
        if tr is not None:
            phase = "backward" if tr.is_bw else "forward"
            for name in tr.parents:
                entry = self.comm_module_counts.get(name)
                if entry is None:
                    entry = self.comm_module_counts[name] = {"forward": CommCounts(), "backward": CommCounts()}
                d = entry[phase]
                dict.__setitem__(d, kind, dict.get(d, kind, 0) + 1)

    def __enter__(self):
        self.comm_counts.clear()
        self.bytes.clear()
        self.events.clear()
        self.comm_module_counts.clear()
        self.comm_module_counts["Global"] = {"forward": CommCounts(), "backward": CommCounts()}
        self._tracker = comm_keys.module_tracker()
        if self._tracker is not None:
            self._tracker.__enter__()
        comm_record.push_recorder(self._record)
        return self

    def __exit__(self, *exc):
        comm_record.pop_recorder(self._record)
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
        return False

    def get_comm_counts(self) -> CommCounts:
        """Counts per collective kind; also indexable by torch's keys (missing -> 0)."""
        return self.comm_counts

    def get_total_counts(self) -> int:
        return sum(self.comm_counts.values())

    def get_comm_module_counts(self) -> dict:
        return self.comm_module_counts

    def get_parameter_info(self) -> dict:
        """``{module name: {param name: param.data}}`` of the modules run inside the mode."""
        return self._tracker.parameter_info if self._tracker is not None else {}

    def get_sharding_info(self) -> dict:
        """``{"module.param": placements}`` of the DTensor parameters of the modules run inside the mode."""
        return self._tracker.sharding_info if self._tracker is not None else {}

    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """A readable per-module table of the collectives (torch's method; one detail level here)."""
        lines = []
        for name, phases in self.comm_module_counts.items():
            depth = 0 if name == "Global" else name.count(".") + 1
            lines.append("  " * depth + name)
            for phase in ("forward", "backward"):
                counts = phases[phase]
                if counts:
                    lines.append("  " * (depth + 1) + f"{phase.upper()} PASS")
                    lines.extend("  " * (depth + 2) + f"*{kind}: {n}" for kind, n in sorted(counts.items()))
        return "\n".join(lines) + "\n"

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt", noise_level: int = 3) -> None:
        """Write :meth:`generate_comm_debug_tracing_table` to ``file_name``."""
        with open(file_name, "w") as f:
            f.write(self.generate_comm_debug_tracing_table(noise_level))

    def generate_json_dump(self, file_name: str = "comm_mode_log.json", noise_level: int = 3) -> None:
        """Dump the per-module counts (and DTensor parameters' placements) as JSON to ``file_name``."""
        import json
        data = {"comm_module_counts": {m: {ph: dict(c) for ph, c in phases.items()}
                                       for m, phases in self.comm_module_counts.items()},
                "sharding_info": {k: [str(p) for p in v] for k, v in self.get_sharding_info().items()}}
        with open(file_name, "w") as f:
            json.dump(data, f, indent=2)

    def get_bytes(self) -> dict:
        return dict(self.bytes)

    def get_total_bytes(self) -> int:
        return sum(self.bytes.values())
