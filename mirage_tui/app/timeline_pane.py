"""The Run screen's clocked timeline: one lane per rank over emulated time, for the last few steps.

Drawn from the fold's :meth:`~mirage_tui.state.runstate.RunState.timeline` (each rank's steps and its
communicators' collectives in emulated seconds) with block characters: compute ``█``, a collective
``▓`` (a glyph and colour per communicator), waiting for a collective to start ``░``. A slow rank's
lane is solid while the others' show ``░`` before the collectives it holds up, and a wider step.
Shown in clocked runs only (``c`` hides and shows it).
"""

from __future__ import annotations

from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from mirage_tui.glyphs import human_seconds
from mirage_tui.state.clocked import Timeline
from mirage_tui.state.runstate import RunState

#: Steps the timeline shows: the last ones every rank reported.
STEPS = 3
#: A communicator's collectives: a glyph each (so they differ without colour too), cycled.
COMM_GLYPHS = "▓▚▞▙"
COMPUTE, WAIT, IDLE = "█", "░", " "
#: A collective wins a cell it covers a quarter of: a short all-reduce stays visible next to long compute.
COMM_WEIGHT = 3.0
_RIGHT = 24  # the figures right of each lane


def cells(timeline: Timeline, width: int) -> dict[int, list[tuple[str, int]]]:
    """Each rank's lane as ``width`` cells: (kind, communicator index), kind ``compute``, ``comm``, ``wait``
    or ``idle`` (outside the rank's steps), each cell what covers most of its stretch of emulated time."""
    span = max(timeline.t1 - timeline.t0, 1e-12)
    dt = span / width
    index = {comm: i for i, comm in enumerate(timeline.comms)}
    out = {}
    for rank, lane in timeline.lanes.items():
        cover: dict[tuple[str, int], list[float]] = {}
        for seg in lane.segments():
            key = (seg.kind, index.get(seg.coll.comm, 0) if seg.coll is not None else -1)
            weights = cover.setdefault(key, [0.0] * width)
            weight = COMM_WEIGHT if seg.kind == "comm" else 1.0
            a, b = (seg.start - timeline.t0) / dt, (seg.end - timeline.t0) / dt
            for i in range(max(0, int(a)), min(width, int(b) + 1)):
                weights[i] += weight * max(0.0, min(b, i + 1) - max(a, i))
        row = []
        for i in range(width):
            best, key = max(((w[i], k) for k, w in cover.items()), default=(0.0, ("idle", -1)))
            row.append(key if best > 0.05 else ("idle", -1))
        out[rank] = row
    return out


def draw(state: RunState, width: int, colours: dict[str, str], steps: int = STEPS) -> Text:
    """The whole pane as text ``width`` columns wide. ``colours``: ``compute``, ``wait``, ``muted`` and
    ``comm0``, ``comm1``, ... (styles; empty strings draw without colour)."""
    timeline = state.timeline(steps)
    if timeline is None:
        return Text("clocked run: no rank has reported an optimizer step yet", style=colours.get("muted", ""))
    label_w = max(len(f"r{rank}") for rank in timeline.lanes) + 1
    bar_w = max(10, width - label_w - _RIGHT)
    span = timeline.t1 - timeline.t0
    lanes = cells(timeline, bar_w)
    comm_style = [colours.get(f"comm{i}", "") for i in range(len(COMM_GLYPHS))]
    muted = colours.get("muted", "")

    def col(t: float) -> int:
        return min(bar_w - 1, max(0, int((t - timeline.t0) / span * bar_w))) if span > 0 else 0

    p = state.prediction()
    head = Text()
    if p is not None:
        head.append(f"predicted step {human_seconds(p.step_s)}", style="bold")
        head.append(f" (compute {human_seconds(p.compute_s)}, communication {human_seconds(p.comm_s)}, "
                    f"exposed {human_seconds(p.exposed_comm_s)}), slowest rank {p.slowest_rank}")
    steps_text = (f"step {timeline.last_step}" if timeline.first_step == timeline.last_step
                  else f"steps {timeline.first_step}-{timeline.last_step}")
    head.append(f" · {steps_text}, {human_seconds(span)} of emulated time", style=muted)

    # the steps' starts (each the earliest rank's), over the lanes
    axis = [" "] * bar_w
    for step in range(timeline.first_step, timeline.last_step + 1):
        starts = [x.t_start for lane in timeline.lanes.values() for x in lane.steps if x.step == step]
        if not starts:
            continue
        at, mark = col(min(starts)), f"▏step {step}"
        for i, ch in enumerate(mark[: bar_w - col(min(starts))]):
            axis[at + i] = ch
    lines = [head, Text.assemble(" " * label_w, ("".join(axis), muted), (f"{'step':>10}{'waited':>10}", muted))]

    for rank, row in lanes.items():
        line = Text(f"r{rank}".ljust(label_w), style="bold")
        for kind, i in row:
            if kind == "comm":
                line.append(COMM_GLYPHS[i % len(COMM_GLYPHS)], style=comm_style[i % len(comm_style)])
            elif kind == "compute":
                line.append(COMPUTE, style=colours.get("compute", ""))
            elif kind == "wait":
                line.append(WAIT, style=colours.get("wait", ""))
            else:
                line.append(IDLE)
        lane = timeline.lanes[rank]
        waited = sum(seg.end - seg.start for seg in lane.segments() if seg.kind == "wait")
        last = lane.steps[-1].t_end - lane.steps[-1].t_start if lane.steps else 0.0
        slow = p is not None and rank == p.slowest_rank and len(lanes) > 1
        line.append(f"{human_seconds(last):>10}", style="bold" if slow else "")
        line.append(f"{human_seconds(waited):>10}")
        lines.append(line)

    end = human_seconds(span)
    lines.append(Text(" " * label_w + "0".ljust(bar_w - len(end)) + end, style=muted))
    legend = Text.assemble(" " * label_w, (COMPUTE, colours.get("compute", "")), " compute  ",
                           (WAIT, colours.get("wait", "")), " waiting for a collective to start  ")
    algos: dict[str, set[str]] = {}
    ops: dict[str, set[str]] = {}
    for lane in timeline.lanes.values():
        for c in lane.colls:
            algos.setdefault(c.comm, set()).add(c.algo)
            ops.setdefault(c.comm, set()).add(c.op.lower())
    for i, comm in enumerate(timeline.comms):
        what = "/".join(sorted(ops.get(comm, ()))) or "collective"
        legend.append(COMM_GLYPHS[i % len(COMM_GLYPHS)], style=comm_style[i % len(comm_style)])
        legend.append(f" {what} on {state.comm_label(comm)} ({', '.join(sorted(algos.get(comm, ())))})  ")
    lines.append(legend)
    return Text("\n").join(lines)


class TimelineBox(VerticalScroll):
    """The pane's frame on the Run screen: hidden until the run turns out to be clocked; scrolls past 10 ranks."""

    DEFAULT_CSS = """
    TimelineBox {
        display: none;
        height: auto;
        max-height: 16;
        border: round $secondary;
        background: $surface;
        padding: 0 1;
    }
    TimelineBox:focus-within {
        border: round $accent;
    }
    """


class TimelinePane(Static):
    """Draws the fold's timeline at the pane's width (again when it is resized)."""

    def __init__(self, **kwargs) -> None:
        super().__init__("clocked run: no rank has reported an optimizer step yet", markup=False, **kwargs)
        self._state: RunState | None = None

    def colours(self) -> dict[str, str]:
        """The theme's styles for each kind of cell: the rank-state colours, then the theme's own."""
        theme = self.app.current_theme
        var = theme.variables
        comms = [var.get("rank-collective", ""), theme.secondary or "", theme.accent or "", theme.primary or ""]
        return {"compute": var.get("rank-running", ""), "wait": var.get("rank-exited", ""), "muted": "dim",
                **{f"comm{i}": c for i, c in enumerate(comms)}}

    def redraw(self, state: RunState) -> None:
        """Draw ``state``'s last steps."""
        self._state = state
        width = self.content_region.width or self.app.size.width - 4
        self.update(draw(state, width, self.colours()))

    def on_resize(self) -> None:
        """Draw again at the new width."""
        if self._state is not None:
            self.redraw(self._state)
