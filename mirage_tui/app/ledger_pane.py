"""The Run screen's collectives grid: the ledger per communicator and rank, as the run's fold keeps it."""

from __future__ import annotations

from textual.widgets import DataTable

from mirage_tui.glyphs import human_bytes
from mirage_tui.state.runstate import RunState
from wire.kernels import KernelError, itemsize

_COLUMNS = (("comm", "comm"), ("rank", "rank"), ("enq", "enqueued"), ("start", "started"),
            ("done", "completed"), ("op", "op"), ("size", "size"), ("dtype", "dtype"), ("age", "age"))


def _size(numel: int, dtype: str) -> str:
    """A collective's bytes per rank (its element count where the dtype is not one the emulator knows)."""
    try:
        return human_bytes(numel * itemsize(dtype))
    except KernelError:
        return f"{numel} el"


def row_rank(key: str) -> int:
    """The global rank of a grid row, from its key."""
    return int(key.rpartition(":")[2])


class LedgerGrid(DataTable):
    """One row per communicator (as torch names it) and rank: last enqueued, started, completed, op, size,
    dtype, age."""

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self._rows: dict[str, tuple] = {}  # row key -> the values it shows

    def on_mount(self) -> None:
        """Title the grid and add its columns."""
        self.border_title = "collectives"
        for key, label in _COLUMNS:
            self.add_column(label, key=key)

    def redraw(self, state: RunState, now: float) -> None:
        """Update the rows that changed, ages as of ``now`` (the run's clock)."""
        added = False
        for comm in state.comms.values():
            for rank in sorted(comm.ranks):
                p = comm.ranks[rank]
                key = f"{comm.comm}:{rank}"
                # age: since the rank last enqueued on this communicator (a waiting rank's grows as it waits)
                age = f"{max(0.0, now - p.enqueued_at):.0f} s" if p.enqueued_at else ""
                row = (state.comm_label(comm.comm), rank, p.last_enqueued, p.last_started, p.last_completed, p.op,
                       _size(p.numel, p.dtype) if p.op else "", p.dtype, age)
                old = self._rows.get(key)
                if old == row:
                    continue
                if old is None:
                    self.add_row(*row, key=key)
                    added = True
                else:
                    for (column, _), value, before in zip(_COLUMNS, row, old, strict=True):
                        if value != before:
                            self.update_cell(key, column, value, update_width=True)
                self._rows[key] = row
        if added:  # ranks join in any order: keep each communicator's rows in rank order
            self.sort("comm", "rank")
