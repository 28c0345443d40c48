"""The Run screen's views for many ranks: a grid of ranks, communicators' progress, memory as a distribution.

They replace the tree, the per-rank ledger and the per-device memory lines when
a run has more than :data:`~mirage_tui.state.rank_summary.MANY_RANKS` ranks (``g``
switches), and draw only what :mod:`mirage_tui.state.rank_summary` computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Region
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Static

from mirage_tui.app.themes import RANK_STATE_VARIABLES
from mirage_tui.glyphs import histogram, human_bytes
from mirage_tui.state.rank_summary import CELL_STATES, CommProgress, MemoryDistribution, Summary

#: One character per rank; the shapes differ too, so the states read without colour (NO_COLOR).
GLYPHS = {"running": "●", "compiling": "◐", "in collective": "◆", "behind": "▲", "stuck": "■", "missing": "✖",
          "exited 0": "○", "exited": "○", "failed": "✗"}
#: The states ``b`` visits: the ranks others wait for.
LAGGARD_STATES = ("behind", "missing", "stuck")


def state_colour(app, word: str) -> str:
    """The current theme's colour for a rank state."""
    return app.current_theme.variables.get(RANK_STATE_VARIABLES[word], "")


class RankGrid(Static, can_focus=True):
    """One cell per rank, coloured by state, grouped by host and node; arrows move, Enter or a click picks."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("left", "move(-1, 0)", "Left", show=False),
        Binding("right", "move(1, 0)", "Right", show=False),
        Binding("up", "move(0, -1)", "Up", show=False),
        Binding("down", "move(0, 1)", "Down", show=False),
        Binding("home", "first", "First", show=False),
        Binding("end", "last", "Last", show=False),
        Binding("enter", "pick", "Pick", show=False, tooltip="show the rank under the cursor's output"),
    ]

    @dataclass
    class Picked(Message):
        """The user picked ``rank`` (Enter or a click): the screen shows its output."""

        rank: int

    def __init__(self, **kwargs) -> None:
        super().__init__("no rank registered yet", markup=False, **kwargs)
        self.summary = Summary()
        self.cursor: int | None = None  # the rank under the cursor
        self._cells: dict[tuple[int, int], int] = {}  # (line, column) -> rank
        self._where: dict[int, tuple[int, int]] = {}  # rank -> (line, column)
        self._drawn: tuple = ()  # what the text was drawn from: width, height, cursor, theme, cells
        self._line_count = 0

    def redraw(self, summary: Summary) -> None:
        """Draw ``summary`` (the cursor stays on its rank)."""
        self.summary = summary
        if self.cursor is None or self.cursor not in summary.states:
            order = summary.order()
            self.cursor = order[0] if order else None
        self._draw()

    def on_resize(self, _: events.Resize) -> None:
        """Lay the cells out again for the new width."""
        self._draw()

    def _draw(self) -> None:
        width = self.content_size.width or 40
        height = self.parent.content_size.height if isinstance(self.parent, Widget) else 0
        nodes = tuple(c for cells in self.summary.hosts.values() for c in cells)
        key = (width, height, self.cursor, self.app.current_theme.name, nodes)
        if key == self._drawn:
            return  # at 256 ranks most drains move no cell: building the text would be the frame's cost
        self._drawn = key
        colours = {word: state_colour(self.app, word) for word in CELL_STATES}
        legend = self._legend(width, colours)
        # as roomy as the pane allows: a node a line with spaced cells (two nodes of eight), spaced cells
        # with several nodes a line, then dense cells (256 ranks in 4 hosts of 8 nodes take 16 lines)
        label_width = len(f"n{max((c.node for c in nodes), default=0)}")
        layouts = ((True, " "), (False, " "), (False, ""))
        one_per_line, gap = next((layout for layout in layouts
                                  if not height or len(legend) + self._lines_needed(width, label_width, *layout)
                                  <= height), layouts[-1])
        lines, cells = self._cells_laid_out(width, label_width, one_per_line, gap, len(legend), colours)
        if self.cursor is not None and self.parent is not None:
            self.parent.border_subtitle = self._detail(self.cursor)  # the grid itself fits the pane
        self._cells = cells
        self._where = {rank: at for at, rank in cells.items()}
        shown = legend + lines
        # a new layout only when the height changes: a frame's layout of the whole screen costs more than its paint
        self.update(Text("\n").join(shown) if shown else Text("no rank registered yet"),
                    layout=len(shown) != self._line_count)
        self._line_count = len(shown)

    def _legend(self, width: int, colours: dict[str, str]) -> list[Text]:
        """The counts per state, each with its glyph in its colour, wrapped to ``width``."""
        lines: list[Text] = []
        legend = Text()
        for word in CELL_STATES:
            n = self.summary.counts.get(word, 0)
            if not n:
                continue
            item = Text.assemble((GLYPHS[word], colours[word]), f" {n} {word}")
            if legend and legend.cell_len + 2 + item.cell_len > width:
                lines.append(legend)
                legend = Text()
            legend.append("  " if legend else "")
            legend.append_text(item)
        return [*lines, legend] if legend else lines

    def _groups(self, width: int, label_width: int, one_per_line: bool, gap: str):
        """Per host: its heading ("" for none) and its nodes cut into lines of groups that fit ``width``."""
        for host, nodes in self.summary.hosts.items():
            lines: list[list] = []
            used = 0
            for node_cells in nodes:
                group = label_width + 1 + len(node_cells.ranks) * (1 + len(gap)) - len(gap)
                if lines and not one_per_line and used + 1 + group <= width:
                    lines[-1].append(node_cells)
                    used += 1 + group
                else:
                    lines.append([node_cells])
                    used = group
            yield host, lines

    def _lines_needed(self, width: int, label_width: int, one_per_line: bool, gap: str) -> int:
        return sum(bool(host) + len(lines) for host, lines in self._groups(width, label_width, one_per_line, gap))

    def _cells_laid_out(self, width: int, label_width: int, one_per_line: bool, gap: str, first: int,
                        colours: dict[str, str]) -> tuple[list[Text], dict[tuple[int, int], int]]:
        """Host headings and node groups (``n12`` then its cells, ``gap`` between them), from line ``first``.

        Neighbouring cells of one state are appended as one run: a span per run, not per rank."""
        out: list[Text] = []
        cells: dict[tuple[int, int], int] = {}
        for host, lines in self._groups(width, label_width, one_per_line, gap):
            if host:
                out.append(Text(host, style="bold"))
            for groups in lines:
                line = Text()
                y = first + len(out)
                for g, node_cells in enumerate(groups):
                    line.append((" " if g else "") + f"n{node_cells.node}".rjust(label_width) + " ", style="dim")
                    run, run_style = "", ""
                    for i, (rank, word) in enumerate(node_cells.ranks):
                        style = colours[word]
                        if rank == self.cursor:
                            style = f"reverse {style}"
                        if i:
                            run += gap  # the gap takes the style of the cell before it
                        if style != run_style and run:
                            line.append(run, style=run_style)
                            run = ""
                        cells[(y, line.cell_len + len(run))] = rank
                        run += GLYPHS[word]
                        run_style = style
                    line.append(run, style=run_style)
                out.append(line)
        return out, cells

    def _detail(self, rank: int) -> Text:
        """The rank under the cursor, for the pane's foot: its node and state, and how far behind it is."""
        word = self.summary.states.get(rank, "running")
        node = next((c.node for nodes in self.summary.hosts.values() for c in nodes
                     if any(r == rank for r, _ in c.ranks)), None)
        behind = self.summary.behind_in.get(rank, ())
        lag = f" #{behind[0][1]} of #{behind[0][2]}" if behind and word == "behind" else ""
        return Text.assemble(f"rank {rank} n{node} ", (word + lag, state_colour(self.app, word)))

    def move_to(self, rank: int) -> None:
        """Put the cursor on ``rank`` and keep it in view."""
        if rank not in self.summary.states:
            return
        self.cursor = rank
        self._draw()
        line = self._where.get(rank, (0, 0))[0]
        if self.parent is not None and hasattr(self.parent, "scroll_to_region"):
            self.parent.scroll_to_region(Region(0, max(0, line - 1), 1, 3), animate=False)

    def action_move(self, dx: int, dy: int) -> None:
        """Left/right: the previous or next rank in the grid's order; up/down: the nearest cell a line away."""
        if self.cursor is None:
            return
        if dx:
            order = self.summary.order()
            i = order.index(self.cursor) + dx
            if 0 <= i < len(order):
                self.move_to(order[i])
            return
        line, column = self._where[self.cursor]
        others = sorted({at[0] for at in self._cells if (at[0] - line) * dy > 0}, key=lambda n: abs(n - line))
        if others:
            target = others[0]
            nearest = min((at for at in self._cells if at[0] == target), key=lambda at: abs(at[1] - column))
            self.move_to(self._cells[nearest])

    def action_first(self) -> None:
        """The first rank."""
        order = self.summary.order()
        if order:
            self.move_to(order[0])

    def action_last(self) -> None:
        """The last rank."""
        order = self.summary.order()
        if order:
            self.move_to(order[-1])

    def action_pick(self) -> None:
        """Show the output of the rank under the cursor."""
        if self.cursor is not None:
            self.post_message(self.Picked(self.cursor))

    def pick_next_laggard(self) -> None:
        """Move to the next rank the others wait for (behind, missing, stuck) after the cursor, and pick it."""
        order = self.summary.order()
        laggards = [r for r in order if self.summary.states.get(r) in LAGGARD_STATES]
        if not laggards:
            self.notify("nobody is behind: no rank is behind, missing or stuck")
            return
        after = [r for r in laggards if self.cursor is None or order.index(r) > order.index(self.cursor)]
        rank = (after or laggards)[0]
        self.move_to(rank)
        self.post_message(self.Picked(rank))

    def on_click(self, event: events.Click) -> None:
        """A click on a cell moves the cursor there and picks the rank."""
        offset = event.get_content_offset(self)
        rank = None if offset is None else self._cells.get((offset.y, offset.x))
        if rank is not None:
            self.move_to(rank)
            self.post_message(self.Picked(rank))


class CommProgressPane(Static):
    """Per communicator: k of N ranks at collective #s and how long the first has waited, then its laggards.

    The communicators someone waits in come first; the settled ones (every member done) fold into one line per
    name, so 32 ``mesh_tp`` groups in step take one line. Lines do not wrap (the pane's style), so the pane's
    height is its line count.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__("no communicators yet", markup=False, **kwargs)
        self._line_count = 0

    def redraw(self, summary: Summary) -> None:
        """Draw every communicator's progress from ``summary``."""
        error = self.app.current_theme.error or ""
        waiting = sorted((c for c in summary.comms if not c.settled or c.failed),
                         key=lambda c: (not c.failed, -c.waiting_s))
        lines = [line for c in waiting for line in self._lines(c, error)]
        settled: dict[str, list[CommProgress]] = {}
        for c in summary.comms:
            if c.settled and not c.failed:
                settled.setdefault(c.label.split(" (")[0], []).append(c)
        for name, comms in settled.items():
            seqs = sorted({c.seq for c in comms})
            at = f"#{seqs[0]}" if len(seqs) == 1 else f"#{seqs[0]}–#{seqs[-1]}"
            many = f" ×{len(comms)}" if len(comms) > 1 else ""
            what = "no collective yet" if seqs == [0] else f"every rank done, at {at}"
            lines.append(Text.assemble((f"{name}{many}", "bold"), f"  {comms[0].size} ranks  ", (what, "dim")))
        self.update(Text("\n").join(lines) if lines else Text("no communicators yet"),
                    layout=len(lines) != self._line_count)
        self._line_count = len(lines)

    def _lines(self, c: CommProgress, error: str) -> list[Text]:
        """The communicator's line, then (if any) its laggards' line."""
        line = Text.assemble((c.label, "bold"), "  ")
        if c.failed:
            line.append(f"FAILED: {c.failed}", style=error)
            return [line]
        line.append(f"{c.at} of {c.size} ranks at {c.op.lower()} #{c.seq}")
        if c.waiting_s:
            line.append(f", waiting {c.waiting_s:.1f} s", style="dim")
        if c.unjoined:
            line.append(f"; {c.unjoined} not joined")
        if not c.laggards:
            return [line]
        behind = Text("  behind: ")
        for i, lag in enumerate(c.laggards[:LAGGARDS_SHOWN]):
            behind.append(", " if i else "")
            behind.append(f"r{lag.rank}", style=f"bold {state_colour(self.app, lag.state)}")
            # a laggard held up itself says where: the one that holds it is named on its own line
            how = f"waits in {lag.waits_in}" if lag.waits_in else "" if lag.state == "behind" else lag.state
            behind.append(f" at #{lag.seq}" + (f" ({how})" if how else ""))
        if len(c.laggards) > LAGGARDS_SHOWN:
            behind.append(f", +{len(c.laggards) - LAGGARDS_SHOWN} more")
        return [line, behind]


#: Laggards named per communicator line; the rest are counted.
LAGGARDS_SHOWN = 6
#: Outliers named under the memory histogram, one a line; the rest are counted.
OUTLIERS_SHOWN = 2
#: Bins of the memory histogram: it fits between its ends ("1.2 GiB", "24.4 GiB") in the pane.
HISTOGRAM_BINS = 18


class MemoryDistributionPane(Static):
    """Allocated memory over every GPU: min, median, p90, max, a histogram, the outliers, the picked rank's."""

    def __init__(self, **kwargs) -> None:
        super().__init__("no GPU memory reported yet", markup=False, **kwargs)
        self.picked: int | None = None
        self._line_count = 1

    def redraw(self, dist: MemoryDistribution | None, own: dict[int, int]) -> None:
        """Draw ``dist``; ``own`` is the picked rank's allocated bytes by GPU."""
        if dist is None:
            self.update("no GPU memory reported yet")
            return
        warn = self.app.current_theme.warning or ""
        lines = [
            Text.assemble(f"{dist.gpus} GPUs of {human_bytes(dist.total)} allocated",
                          (f", {dist.near_full} over 90%", f"bold {warn}") if dist.near_full else ""),
            Text(f"median {human_bytes(dist.p50)}  p90 {human_bytes(dist.p90)}"),
            # the histogram between its ends: min on the left, max on the right
            Text.assemble((human_bytes(dist.low), "dim"), " ", (histogram(dist.histogram), self.app.current_theme.primary
                                                                 or ""), " ", (human_bytes(dist.high), "dim")),
        ]
        if dist.outliers:
            # one a line (a narrow pane): the furthest from the median first, the rest counted on the last
            for i, o in enumerate(dist.outliers[:OUTLIERS_SHOWN]):
                line = Text("outlier " if i == 0 else "        ")
                line.append(f"{'↑' if o.high else '↓'} r{o.rank} g{o.device} {human_bytes(o.allocated)}",
                            style=warn if o.high else "")
                if i == OUTLIERS_SHOWN - 1 and len(dist.outliers) > OUTLIERS_SHOWN:
                    line.append(f"  +{len(dist.outliers) - OUTLIERS_SHOWN} more", style="dim")
                lines.append(line)
        else:
            lines.append(Text("no outliers", style="dim"))
        if self.picked is not None and own:
            lines.append(Text(f"r{self.picked}: " + ", ".join(
                f"g{g} {human_bytes(b)} (p{dist.percentile_of(b)})" for g, b in sorted(own.items()))))
        self.update(Text("\n").join(lines), layout=len(lines) != self._line_count)
        self._line_count = len(lines)
