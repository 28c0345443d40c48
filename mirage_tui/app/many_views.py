"""Which of the Run screen's two sets of views is up: the tree, ledger and per-GPU lines, or those for many ranks.

The screen composes both sets once; this puts one up, draws the set for many
ranks from :mod:`mirage_tui.state.rank_summary`, and leaves the hidden set undrawn
until it comes back (drawn in full then) — which is what keeps a frame cheap
at 256 ranks, where the tree and the per-rank ledger would redraw every row.
"""

from __future__ import annotations

from textual.screen import Screen

from mirage_tui.app.gpu_pane import GpuMemory
from mirage_tui.app.ledger_pane import LedgerGrid
from mirage_tui.app.rank_grid import HISTOGRAM_BINS, CommProgressPane, MemoryDistributionPane, RankGrid
from mirage_tui.app.ranks_pane import RankTree
from mirage_tui.state.rank_summary import MANY_RANKS, memory_distribution, summarize
from mirage_tui.state.runstate import RunState


class ManyRankViews:
    """The switch between the two sets of views on ``screen`` (widgets of class ``many`` are the second)."""

    def __init__(self, screen: Screen) -> None:
        self.screen = screen
        self.choice: bool | None = None  # the user's (g); None: by the number of ranks
        self.shown = False  # whether the views for many ranks are up

    def wanted(self, state: RunState) -> bool:
        """Whether the views for many ranks should be up: the user's choice, else past MANY_RANKS ranks."""
        if self.choice is not None:
            return self.choice
        return sum(1 for status in state.ranks.values() if status.node is not None) > MANY_RANKS

    def show(self, state: RunState, now: float) -> None:
        """Put up the set :meth:`wanted` asks for, drawn from ``state`` as it is now; focus follows."""
        screen = self.screen
        many = self.shown = self.wanted(state)
        focused = screen.focused
        for widget in screen.query(".many"):
            widget.display = many
        tree, ledger, grid = screen.query_one(RankTree), screen.query_one(LedgerGrid), screen.query_one(RankGrid)
        for widget in (tree, ledger, screen.query_one(GpuMemory)):
            widget.display = not many
        screen.query_one("#gpu-pane").border_title = "GPU memory: distribution" if many else "GPU memory"
        if many:
            self.redraw(state, now, cells=True, memory=True)
            if focused is tree or focused is ledger:
                grid.focus()
        else:
            tree.redraw(state)
            ledger.redraw(state, now)
            screen.query_one(GpuMemory).redraw(state)
            item = tree.rank_items.get(grid.cursor) if grid.cursor is not None else None
            if item is not None:  # the rank looked at in the grid is the one the tree shows
                tree.move_cursor(item)
            if focused is grid:
                tree.focus()
        screen.refresh_bindings()

    def redraw(self, state: RunState, now: float, cells: bool, memory: bool) -> None:
        """Redraw the grid and the communicators (``cells``: ranks or the ledger changed), the distribution."""
        if cells:
            summary = summarize(state, now)
            self.screen.query_one(RankGrid).redraw(summary)
            self.screen.query_one(CommProgressPane).redraw(summary)
        if memory:
            pane = self.screen.query_one(MemoryDistributionPane)
            own = {} if pane.picked is None else {
                device: m.allocated for (rank, device), m in state.memory.items() if rank == pane.picked}
            pane.redraw(memory_distribution(state, HISTOGRAM_BINS), own)

    def picked(self, state: RunState, rank: int) -> None:
        """``rank`` was picked in the grid: its memory beside the distribution, its item in the hidden tree."""
        self.screen.query_one(MemoryDistributionPane).picked = rank
        self.redraw(state, state.last_t, cells=False, memory=True)
        tree = self.screen.query_one(RankTree)
        item = tree.rank_items.get(rank)
        if item is not None:
            tree.move_cursor(item)
