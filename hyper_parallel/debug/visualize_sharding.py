"""``visualize_sharding``: a text table of which ranks hold which block of a 1-D or 2-D DTensor.

Same contract as ``torch.distributed.tensor.debug.visualize_sharding``: printed
once per DTensor, by the mesh's rank whose coordinate is 0 on every mesh dim;
nothing for an empty tensor or on ranks outside the mesh; a RuntimeError for 3 or
more dims. The table is plain text, so it needs neither ``tabulate`` nor ``rich``
(which PyTorch requires); ``use_rich`` is accepted and ignored, ``header`` is
printed above the table, and ranks holding an empty shard are left out.
"""
from __future__ import annotations

from typing import Any


def visualize_sharding(dtensor: Any, header: str = "", use_rich: bool = False) -> None:
    """Print the block (rows, columns) each rank of ``dtensor``'s mesh holds, e.g. ``Row 0-3  cpu:0``."""
    if dtensor.numel() == 0:
        return
    if dtensor.dim() >= 3:
        raise RuntimeError("visualize sharding supports only 1D or 2D DTensor")
    mesh = dtensor.device_mesh
    coord = mesh.get_coordinate()
    if coord is None or any(c != 0 for c in coord):
        return
    print(sharding_table(dtensor, header))


def sharding_table(dtensor: Any, header: str = "") -> str:
    """The table :func:`visualize_sharding` prints (every rank can build it; no communication)."""
    layout, shape = dtensor._layout, tuple(dtensor.shape)
    blocks: dict = {}  # (row range, col range) -> ranks holding it
    for rank in layout.rank_list:
        lshape, offset = layout.local_shape_and_offset(shape, rank)
        if len(shape) == 1:
            lshape, offset = (lshape[0], 1), (offset[0], 0)
        if 0 in lshape:  # an empty shard (uneven sharding): no block to show
            continue
        key = ((offset[0], offset[0] + lshape[0] - 1), (offset[1], offset[1] + lshape[1] - 1))
        blocks.setdefault(key, []).append(rank)
    rows = sorted({k[0] for k in blocks})
    cols = sorted({k[1] for k in blocks})
    kind = dtensor.device_mesh.device_type
    cells = [[f"Row {r[0]}-{r[1]}"] + [f"{kind}:" + ",".join(map(str, blocks[(r, c)])) if (r, c) in blocks else ""
                                       for c in cols] for r in rows]
    head = [""] + [f"Col {c[0]}-{c[1]}" for c in cols]
    widths = [max(len(line[i]) for line in [head] + cells) for i in range(len(head))]
    fmt = lambda line: "  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip()  # noqa: E731
    out = [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(line) for line in cells]
    return "\n".join(([header] if header else []) + out)
