"""The Run screen: a cluster tree, the selected rank's output, collectives (grid and in flight), alerts.

Its events come from a feed (a live session or a replay) that runs on another
thread and only buffers events and posts messages; every widget update happens
here, in the handler that drains the buffer into the shared
:class:`~mirage_tui.runstate.RunState` fold.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import ClassVar

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, Log, Static, Tree
from textual.widgets.tree import TreeNode

from emulator import schema as s
from emulator.kernels import KernelError, itemsize
from mirage_tui import diagnosis, flight_recorder
from mirage_tui.app import hang_stacks
from mirage_tui.app.confirm import ConfirmScreen
from mirage_tui.app.feeds import Feed, LiveFeed, ReplayFeed
from mirage_tui.app.gpu_pane import GpuMemory
from mirage_tui.app.hang_stacks import RankStacks
from mirage_tui.app.inflight_pane import InFlightPane
from mirage_tui.app.messages import AlertReady, EventsReady, ReplayProgress, RunFinished, StacksReady
from mirage_tui.app.stacks_screen import StacksScreen
from mirage_tui.app.summary import Summary
from mirage_tui.app.themes import RANK_STATE_VARIABLES
from mirage_tui.app.traffic import Traffic
from mirage_tui.runstate import RunState, human_bytes
from mirage_tui.session import Outcome

#: Lines kept per rank (and per node process); older ones are only in the run directory's logs.
MAX_LINES = 10_000

Source = tuple[str, int]  # ("rank", r) or ("node", n): whose output a Log shows
_COLUMNS = (("comm", "comm"), ("rank", "rank"), ("enq", "enqueued"), ("start", "started"),
            ("done", "completed"), ("op", "op"), ("size", "size"), ("dtype", "dtype"), ("age", "age"))


def _size(numel: int, dtype: str) -> str:
    """A collective's bytes per rank (its element count where the dtype is not one the emulator knows)."""
    try:
        return human_bytes(numel * itemsize(dtype))
    except KernelError:
        return f"{numel} el"


class RunScreen(Screen):
    """Watch one run, live or replayed; the Report screen follows when it ends."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("h", "hang_stacks", "Hang stacks",
                tooltip="the Python stacks of the ranks in the latest hang, the missing rank's first"),
        Binding("s", "dump_stacks", "Stacks", tooltip="dump every live rank's Python stacks now and show them"),
        Binding("k", "kill_rank", "Kill rank", tooltip="SIGKILL the selected rank (asks first)"),
        Binding("d", "fr_dump", "FR dump", tooltip="Flight-Recorder dumps of the run so far, for fr_trace"),
        Binding("x", "stop", "Stop", tooltip="stop the live run (asks first); the report follows"),
        Binding("R", "restart", "Restart",
                tooltip="stop the run (asks first if it is live) and start the same topology again"),
        Binding("N", "new_run", "New run", show=False,
                tooltip="back to the Setup form, filled with this run's topology"),
        Binding("slash", "filter", "Filter", key_display="/", tooltip="show only output lines containing a text"),
        Binding("e", "toggle_stderr", "Stderr", show=False, tooltip="hide or show the output's stderr lines"),
        Binding("T", "toggle_timestamps", "Timestamps", show=False, tooltip="prefix output lines with their time"),
        Binding("v", "pin", "Compare", show=False,
                tooltip="pin this output beside the pane to compare it with another rank's; again: unpin"),
        Binding("r", "report", "Report", tooltip="the report of the finished run"),
        # priority: the tree would take space (expand/collapse) first
        Binding("space", "toggle_pause", "Pause", priority=True, tooltip="pause or resume the replay"),
        Binding("full_stop,n", "step", "Step", key_display=". / n", tooltip="play one event of the replay, paused"),
        Binding("plus,equals_sign", "faster", "Faster", key_display="+", tooltip="replay twice as fast"),
        Binding("minus", "slower", "Slower", key_display="-", tooltip="replay half as fast"),
    ]

    def __init__(self, feed: Feed, title: str, nodes: int = 0) -> None:
        super().__init__()
        self.feed = feed
        self.title_text = title
        self.nodes = nodes
        self.state = RunState()
        self.summary = Summary()
        self.traffic = Traffic()
        #: How the run ended; None while it runs.
        self.outcome: Outcome | None = None
        self._lines: dict[Source, deque[s.OutputLine]] = {}
        # what the output pane shows of the selected source's lines
        self._filter = ""
        self._show_stderr = True
        self._timestamps = False
        # per output pane: lines of its source drained but not yet written to it
        self._unwritten: dict[str, list[str]] = {"output": [], "pinned": []}
        self._selected: Source | None = None
        self._pinned: Source | None = None  # shown beside the selected source, to compare two ranks
        self._user_selected = False
        self._node_items: dict[int, TreeNode[Source]] = {}
        self._rank_items: dict[int, TreeNode[Source]] = {}
        self._rank_node: dict[int, int] = {}
        self._rank_gpus: dict[int, set[int]] = {}  # the node's GPU indices a rank has used
        self._hung: dict[int, str] = {}  # rank -> "stuck" (waits in the hung collective) or "missing"
        self._exited: set[int] = set()
        # how exited ranks ended: no event carries a torchrun worker's exit code, so this is what is known
        self._exited_ok: set[int] = set()  # their node process exited 0 (torchrun only does if every worker did)
        self._failed: set[int] = set()  # raised (a traceback on stderr), killed from here, or exited non-zero itself
        self._raised: set[int] = set()
        self._rows: dict[str, tuple] = {}  # grid row key -> the values it shows
        self._alerts: list[Text] = []
        self._hang_reports: list[s.HangReport] = []

    @property
    def replaying(self) -> bool:
        """Whether this screen plays a recording (rather than a live run)."""
        return isinstance(self.feed, ReplayFeed)

    # ------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="left"):
                tree: Tree[Source] = Tree("cluster", id="ranks")
                tree.show_root = False
                yield tree
                with VerticalScroll(id="gpu-pane"):
                    yield GpuMemory(id="gpu-memory")
            with Vertical(id="output-pane"):
                with Horizontal(id="logs"):
                    yield Log(max_lines=MAX_LINES, id="output")
                    yield Log(max_lines=MAX_LINES, id="pinned")
                yield Input(placeholder="show lines containing… (enter: keep, esc: clear)", id="filter")
                with VerticalScroll(id="traffic"):
                    yield InFlightPane(id="inflight")
        with Horizontal(id="bottom"):
            yield DataTable(id="collectives", cursor_type="row", zebra_stripes=True)
            with VerticalScroll(id="alerts"):
                yield Static("no alerts", markup=False, id="alerts-text")
        if self.replaying:
            yield Static("", markup=False, id="replay-bar")
        yield Footer()

    def on_mount(self) -> None:
        """Set up the widgets and start the feed."""
        self.sub_title = self.title_text
        self.query_one("#ranks", Tree).border_title = "ranks"
        self.query_one("#output", Log).border_title = "output"
        grid = self.query_one("#collectives", DataTable)
        grid.border_title = "collectives"
        for key, label in _COLUMNS:
            grid.add_column(label, key=key)
        self.query_one("#alerts").border_title = "alerts"
        self.query_one("#gpu-pane").border_title = "GPU memory"
        self.query_one("#traffic").border_title = "collectives in flight"
        for node in range(self.nodes):
            self._node_item(node)
        if isinstance(self.feed, ReplayFeed):
            self.on_replay_progress(self.feed.progress())
            if self.feed.recording.skipped:
                self._alert(f"replay: {self.feed.recording.skipped} unreadable line(s) of events.jsonl skipped")
        # once the screen has drawn: a fast replay could otherwise end (and cover it) mid-mount
        self.call_after_refresh(self.feed.start, self)
        if not self.replaying:
            # ages grow while nothing happens (a hang above all); a replay's clock is its events'
            self.set_interval(1.0, self._tick)

    def clock(self) -> float:
        """Now, for ages: the wall clock while a live run runs, else the time of the last event seen."""
        return time.time() if not self.replaying and self.outcome is None else self.state.last_t

    def _tick(self) -> None:
        if self.outcome is None:
            self._update_grid()
            # idle seconds bring the throughput down to zero; a replay's come with its next event
            self.traffic.advance(self.clock())
            self.query_one("#inflight", InFlightPane).redraw(self.traffic, self.clock())

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Replay keys only while replaying, stacks and stop only while live, the report once there is one."""
        if action in ("toggle_pause", "step", "faster", "slower"):
            return self.replaying and self.outcome is None
        if action in ("dump_stacks", "kill_rank", "stop"):
            return not self.replaying and self.outcome is None
        if action == "report":
            return self.outcome is not None
        if action == "hang_stacks":
            return bool(self._hang_reports) or None  # None: shown, greyed out, until there is a hang
        if action == "new_run":
            return not self.replaying and self.outcome is not None
        return True

    # ------------------------------------------------------------ events -> widgets

    @property
    def superseded(self) -> bool:
        """Whether a restart replaced this screen: its feed's last messages may still arrive, and are dropped."""
        return self.app.run_screen is not self

    def on_events_ready(self, _: EventsReady) -> None:
        """Drain the feed's buffer into the fold and the widgets."""
        if not self.superseded:
            self._drain()

    def _drain(self) -> None:
        buffer = self.feed.claim()
        grid_dirty = ranks_dirty = memory_dirty = traffic_dirty = False
        gpus = self.query_one("#gpu-memory", GpuMemory)
        while buffer:
            e = buffer.popleft()
            self.state.apply(e)
            self.summary.apply(e)
            traffic_dirty = self.traffic.apply(e) or traffic_dirty
            if isinstance(e, s.OutputLine):
                source: Source = ("rank", e.rank) if e.rank >= 0 else ("node", e.node)
                # anywhere in the line: torch prefixes a rank's stderr lines with "[rankN]: "
                if e.rank >= 0 and e.stream is s.Stream.STDERR and "Traceback (most recent call last)" in e.text:
                    self._raised.add(e.rank)
                self._lines.setdefault(source, deque(maxlen=MAX_LINES)).append(e)
                if self._shows(e):
                    for pane, shown in (("output", self._selected), ("pinned", self._pinned)):
                        if source == shown:
                            self._unwritten[pane].append(self._render_line(e))
            elif isinstance(e, s.DaemonReady):
                for node in range(e.nodes):  # a replay learns the cluster's shape here
                    self._node_item(node)
            elif isinstance(e, s.RankRegistered):
                self._add_rank(e.rank, e.node)
                ranks_dirty = True  # its node is no longer starting
            elif isinstance(e, (s.CommJoined, s.CollectiveEnqueued, s.CollectiveStarted, s.CollectiveCompleted)):
                grid_dirty = ranks_dirty = True
                if isinstance(e, s.CollectiveEnqueued) and e.comm in self.state.comms:
                    # the event names the communicator's rank; the tree shows global ranks
                    self._rank_gpus.setdefault(self.state.comms[e.comm].global_of.get(e.rank, e.rank),
                                               set()).add(e.device)
            elif isinstance(e, s.MemoryUsage):
                gpus.record(e)
                self._rank_gpus.setdefault(e.rank, set()).add(e.device)
                memory_dirty = ranks_dirty = True
            elif isinstance(e, s.HangDetected):
                self._hung.update({r: "stuck" for r in e.joined})
                self._hung.update({r: "missing" for r in e.missing})
                ranks_dirty = True
            elif isinstance(e, s.HangReport):
                self._hang_reports.append(e)
                self._alert(self._hang_alert(e))
                self.refresh_bindings()
            elif isinstance(e, s.CommFailed):
                self._alert(Text(f"communicator {e.comm[:8]} failed: {e.code}: {e.message}",
                                 style=self.app.current_theme.error or ""))
            elif isinstance(e, s.StragglerWarning):
                self._alert(f"rank {e.rank} arrived last at {e.count} collectives in a row of communicator "
                            f"{e.comm[:8]}, {e.mean_margin_s:.2f} s behind on average (a straggler)")
            elif isinstance(e, s.RankGone):
                self._exited.add(e.rank)
                if e.rank in self._raised:
                    self._failed.add(e.rank)
                ranks_dirty = True
            elif isinstance(e, s.ProcessExited):
                ranks = {r for r, n in self._rank_node.items() if n == e.node}
                self._exited |= ranks
                if e.returncode == 0:
                    self._exited_ok |= ranks
                    self._failed -= ranks  # a traceback it printed and handled
                else:
                    # launched directly, the node process is the rank: its exit code is the rank's
                    self._failed |= {r for r in ranks if r in self._raised or self.state.rank_pids.get(r) == e.pid}
                ranks_dirty = True
        for pane, lines in self._unwritten.items():
            if lines:
                # one write per drain; a selection change mid-drain (a rank registering) refilled the pane instead
                self.query_one(f"#{pane}", Log).write_lines(lines)
                self._unwritten[pane] = []
        if grid_dirty:
            self._update_grid()
        if ranks_dirty:
            self.update_rank_labels()
        if memory_dirty:
            gpus.redraw(self.state.memory)
        if traffic_dirty:
            self.query_one("#inflight", InFlightPane).redraw(self.traffic, self.clock())

    def _node_item(self, node: int) -> TreeNode[Source]:
        item = self._node_items.get(node)
        if item is None:
            item = self._node_items[node] = self.query_one("#ranks", Tree).root.add(
                self._node_label(node), data=("node", node), expand=True)
        return item

    def _node_label(self, node: int) -> Text:
        """``node 1``, then how its process is: starting (no rank has registered yet) or its exit code."""
        code = self.state.node_exits.get(node)
        if code is not None:
            return Text.assemble(f"node {node} ", (f"exit {code}", "dim"))
        if node not in self._rank_node.values():
            return Text.assemble(f"node {node} ", ("starting", "dim"))
        return Text(f"node {node}")

    def _add_rank(self, rank: int, node: int) -> None:
        if rank in self._rank_items:
            return
        self._rank_node[rank] = node
        parent = self._node_item(node)
        # ranks register in any order; keep the tree sorted
        later = [item for r, item in self._rank_items.items() if r > rank and item.parent is parent]
        before = min(later, key=lambda item: item.data[1]) if later else None
        self._rank_items[rank] = parent.add_leaf(self._rank_label(rank), data=("rank", rank), before=before)
        if not self._user_selected:  # until the user picks one, show the lowest rank
            self._select(("rank", min(self._rank_items)))

    def rank_state(self, rank: int) -> str:
        """running, in collective, stuck, missing; then exited 0, failed, or exited (its exit code unknown).

        A rank is in the tree once it registered; until then its node says ``starting``.
        """
        if rank in self._failed:
            return "failed"
        if rank in self._exited:
            return "exited 0" if rank in self._exited_ok else "exited"
        if rank in self._hung:
            return self._hung[rank]
        for comm in self.state.comms.values():
            pos = comm.ranks.get(rank)
            if pos is not None and pos.last_enqueued > pos.last_completed:
                return "in collective"
        return "running"

    def _rank_label(self, rank: int) -> Text:
        state = self.rank_state(rank)
        colour = self.app.current_theme.variables.get(RANK_STATE_VARIABLES[state], "")
        gpus = self._rank_gpus.get(rank)
        gpu = f"gpu {','.join(map(str, sorted(gpus)))} " if gpus else ""  # known once it used one
        return Text.assemble(("● ", colour), f"rank {rank} ", (gpu, "dim"), (state, colour))

    def update_rank_labels(self) -> None:
        """Redraw every rank's state (also after a theme change: the colours are theme variables)."""
        for node, item in self._node_items.items():
            item.set_label(self._node_label(node))
        for rank, item in self._rank_items.items():
            item.set_label(self._rank_label(rank))

    def _update_grid(self) -> None:
        grid = self.query_one("#collectives", DataTable)
        now = self.clock()
        added = False
        for comm in self.state.comms.values():
            for rank in sorted(comm.ranks):
                p = comm.ranks[rank]
                key = f"{comm.comm}:{rank}"
                # age: since the rank last enqueued on this communicator (a waiting rank's grows as it waits)
                age = f"{max(0.0, now - p.enqueued_at):.0f} s" if p.enqueued_at else ""
                row = (comm.comm[:8], rank, p.last_enqueued, p.last_started, p.last_completed, p.op,
                       _size(p.numel, p.dtype) if p.op else "", p.dtype, age)
                old = self._rows.get(key)
                if old == row:
                    continue
                if old is None:
                    grid.add_row(*row, key=key)
                    added = True
                else:
                    for (column, _), value, before in zip(_COLUMNS, row, old):
                        if value != before:
                            grid.update_cell(key, column, value, update_width=True)
                self._rows[key] = row
        if added:  # ranks join in any order: keep each communicator's rows in rank order
            grid.sort("comm", "rank")

    def _hang_alert(self, e: s.HangReport) -> Text:
        """The session's hang report with the missing ranks in the theme's colour, and the key to their stacks."""
        text = Text(e.text)
        colour = self.app.current_theme.variables.get(RANK_STATE_VARIABLES["missing"], "")
        text.highlight_regex(r"missing ranks: \{[^}]*\}", f"bold {colour}")
        for rank in (r for r, state in self._hung.items() if state == "missing"):
            text.highlight_regex(rf"(?m)^  \[{rank}\] .*$", colour)  # what the rank did instead
        text.append("\n  h: the Python stacks of these ranks", style=f"bold {self.app.current_theme.accent or ''}")
        return text

    def _alert(self, text: str | Text) -> None:
        self._alerts.append(Text(text) if isinstance(text, str) else text)
        self.query_one("#alerts-text", Static).update(Text("\n\n").join(self._alerts))
        self.query_one("#alerts", VerticalScroll).scroll_end(animate=False)

    def on_tree_node_selected(self, event: Tree.NodeSelected[Source]) -> None:
        """Show the output of the rank (or node process) picked in the tree."""
        if event.node.data is not None:
            self._user_selected = True
            self._select(event.node.data)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a grid row picks its rank in the tree (and so shows its output)."""
        rank = int(str(event.row_key.value).rpartition(":")[2])
        item = self._rank_items.get(rank)
        if item is not None:
            tree = self.query_one("#ranks", Tree)
            tree.move_cursor(item)
            tree.select_node(item)

    def _select(self, source: Source) -> None:
        if source == self._selected:
            return
        self._selected = source
        self._refill(("output",))

    def _shows(self, e: s.OutputLine) -> bool:
        """Whether the output pane shows ``e`` under the current stderr toggle and filter."""
        if not self._show_stderr and e.stream is s.Stream.STDERR:
            return False
        return not self._filter or self._filter.lower() in e.text.lower()

    def _render_line(self, e: s.OutputLine) -> str:
        if not self._timestamps:
            return e.text
        stamp = time.strftime("%H:%M:%S", time.localtime(e.t))
        return f"{stamp}.{int(e.t * 1000) % 1000:03d} {e.text}"

    def _refill(self, panes: tuple[str, ...] = ("output", "pinned")) -> None:
        """Redraw output panes for their source, the filter, the stderr toggle and timestamps."""
        for pane in panes:
            source = self._selected if pane == "output" else self._pinned
            if source is not None:
                self._refill_pane(pane, source)

    def _refill_pane(self, pane: str, source: Source) -> None:
        log = self.query_one(f"#{pane}", Log)
        title = f"{source[0]} {source[1]} output" + (" (pinned)" if pane == "pinned" else "")
        if self._filter:
            title += f" · lines with {self._filter!r}"
        if not self._show_stderr:
            title += " · stdout only"
        log.border_title = title
        log.clear()
        self._unwritten[pane] = []  # the refill below includes them
        log.write_lines([self._render_line(e) for e in self._lines.get(source, ()) if self._shows(e)])

    def on_replay_progress(self, message: ReplayProgress) -> None:
        """Show where the replay is."""
        state = "paused" if message.paused else "playing"
        speed = "max" if message.speed <= 0 else f"{message.speed:g}x"
        self.query_one("#replay-bar", Static).update(
            f"replay {state} at {speed}: event {message.position} of {message.total}   "
            "space pause · . step · +/- speed")

    def on_run_finished(self, message: RunFinished) -> None:
        """Record the outcome and show the report (the app quits instead if the user asked to)."""
        if self.superseded:
            return
        self._drain()
        self.outcome = o = message.outcome
        status = "ok" if o.returncode == 0 else "FAILED"
        self.sub_title = f"{status}: exit {o.returncode}"
        self._alert(f"run {status}: {o.summary} (exit {o.returncode}); run dir: {o.run_dir}")
        if isinstance(self.feed, ReplayFeed):
            p = self.feed.player
            self.query_one("#replay-bar", Static).update(
                f"replay finished: {p.position} of {p.total} events played")
        self.refresh_bindings()
        self.app.run_finished(self)

    def on_alert_ready(self, message: AlertReady) -> None:
        """Put a background job's text into the alerts pane."""
        self._alert(message.text)

    # ------------------------------------------------------------ actions

    def action_dump_stacks(self) -> None:
        """Ask every live rank for its Python stacks (on a thread: it waits up to a second), then show them."""
        session = self.feed.session if isinstance(self.feed, LiveFeed) else None
        if session is None or not session.state.rank_pids:
            self.notify("no ranks to ask yet", severity="warning")
            return
        pids = dict(session.state.rank_pids)

        def dump() -> None:
            stacks = diagnosis.dump_stacks(pids, session.run.ranks, session.run.session)
            ranks = [RankStacks(r, "live", f"rank {r}: pid {pids[r]}",
                                hang_stacks.current_thread_first(text or "(no answer)"))
                     for r, text in sorted(stacks.items())]
            self.post_message(StacksReady(f"stacks of {len(ranks)} live rank(s) at {time.strftime('%H:%M:%S')} "
                                          f"(also appended to {session.run.ranks}/rank-N.stacks)", ranks))

        self.run_worker(dump, thread=True, group="stacks", exclusive=True)

    def on_stacks_ready(self, message: StacksReady) -> None:
        """Show a finished stack dump (unless another screen, such as the report, came up meanwhile)."""
        if not message.ranks:
            self._alert("stacks: no live rank of this run answered")
        elif self.app.screen is self:
            self.app.push_screen(StacksScreen(message.title, message.ranks))
        else:  # covering a question or the report with it would hide what the user is looking at
            self.notify(f"{message.title}; not shown: another screen is up", timeout=10)

    def action_hang_stacks(self) -> None:
        """Show the Python stacks the session took at the latest hang, the missing ranks' first."""
        report = self._hang_reports[-1]
        if isinstance(self.feed, LiveFeed):
            run_dir = self.feed.session.run.path if self.feed.session else ""
        else:
            assert isinstance(self.feed, ReplayFeed)
            run_dir = self.feed.recording.run_dir
        try:
            ranks = hang_stacks.load(run_dir, report.comm, report.seq, report.path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.notify(f"no stacks for this hang: {e}", severity="error", timeout=8)
            return
        self.app.push_screen(StacksScreen(
            f"hang at collective #{report.seq} of {report.comm[:8]}: the ranks' Python stacks when it was "
            f"reported (up/down: rank, esc: close)", ranks))

    def action_filter(self) -> None:
        """Show the filter field under the output pane."""
        field = self.query_one("#filter", Input)
        field.display = True
        field.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        """Filter the output as the pattern is typed."""
        if event.input.id == "filter":
            self._filter = event.value
            self._refill()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Keep the filter and go back to the output."""
        if event.input.id == "filter":
            event.input.display = bool(self._filter)
            self.query_one("#output", Log).focus()

    def on_key(self, event: events.Key) -> None:
        """Escape in the filter field clears it."""
        field = self.query_one("#filter", Input)
        if event.key == "escape" and field.has_focus:
            field.value = ""
            field.display = False
            self.query_one("#output", Log).focus()
            event.stop()

    def action_pin(self) -> None:
        """Pin the selected source's output beside the pane (then pick another to compare); again: unpin."""
        pinned = self.query_one("#pinned", Log)
        if self._pinned is not None or self._selected is None:
            self._pinned = None
            pinned.display = False
            return
        self._pinned = self._selected
        pinned.display = True
        self._refill(("pinned",))

    def action_toggle_stderr(self) -> None:
        """Show or hide the selected source's stderr lines."""
        self._show_stderr = not self._show_stderr
        self._refill()

    def action_toggle_timestamps(self) -> None:
        """Prefix each output line with the time it was printed, or not."""
        self._timestamps = not self._timestamps
        self._refill()

    def action_kill_rank(self) -> None:
        """Kill the selected rank's process (after a yes), as a crash or the OOM killer would."""
        feed = self.feed
        if not isinstance(feed, LiveFeed) or self._selected is None or self._selected[0] != "rank":
            self.notify("select a rank in the tree first", severity="warning")
            return
        rank = self._selected[1]

        def answered(yes: bool | None) -> None:
            if not yes:
                return
            pid = feed.kill_rank(rank)
            if pid is None:
                self.notify(f"rank {rank} has no live process of this run", severity="warning")
            else:
                self._failed.add(rank)
                self._alert(f"killed rank {rank} (pid {pid}) from the console")

        self.app.push_screen(ConfirmScreen(f"Kill rank {rank} (SIGKILL)? Its peers will see a dead peer."),
                             answered)

    def action_fr_dump(self) -> None:
        """Write Flight-Recorder dumps of the run so far (a replay: of the events played) on a thread."""
        feed = self.feed
        if isinstance(feed, LiveFeed):
            if feed.session is None:
                self.notify("the run has not started yet", severity="warning")
                return
            run_dir = feed.session.run.path

            def dump() -> str:
                return flight_recorder.dump_run(run_dir)
        else:
            assert isinstance(feed, ReplayFeed)
            played = feed.recording.events[: feed.player.position]
            out_dir = os.path.join(feed.recording.run_dir, flight_recorder.DUMP_DIR)

            def dump() -> str:
                flight_recorder.write_dumps(played, out_dir)
                return out_dir

        def job() -> None:
            try:
                folder = dump()
            except OSError as e:
                self.post_message(AlertReady(f"Flight Recorder dump failed: {e}"))
                return
            self.post_message(AlertReady(
                f"Flight Recorder dumps: {folder} (python -m torch.distributed.flight_recorder.fr_trace "
                f"{folder} -p {flight_recorder.PREFIX})"))

        self.run_worker(job, thread=True, group="fr-dump", exclusive=True)

    def action_report(self) -> None:
        """Show the report of the finished run."""
        self.app.run_finished(self)

    def action_stop(self) -> None:
        """Stop the live run after a yes; the report follows, as after any end."""
        def answered(yes: bool | None) -> None:
            if yes and self.outcome is None:
                self.feed.stop(timeout=0)  # asks; the feed's thread tears down and posts RunFinished
                self.sub_title = "stopping the run..."

        self.app.push_screen(ConfirmScreen("Stop the run? Every process of it is ended."), answered)

    def action_restart(self) -> None:
        """Run the same topology (or replay the same recording) again on a fresh screen."""
        self.app.restart()

    def action_new_run(self) -> None:
        """Back to the Setup form, filled with this run's topology."""
        self.app.new_run()

    def _player_changed(self) -> None:
        assert isinstance(self.feed, ReplayFeed)
        self.on_replay_progress(self.feed.progress())

    def action_toggle_pause(self) -> None:
        """Pause or resume the replay."""
        assert isinstance(self.feed, ReplayFeed)
        self.feed.player.toggle_pause()
        self._player_changed()

    def action_step(self) -> None:
        """Pause the replay and play one event."""
        assert isinstance(self.feed, ReplayFeed)
        self.feed.player.step()
        self._player_changed()

    def action_faster(self) -> None:
        """Replay faster."""
        assert isinstance(self.feed, ReplayFeed)
        self.feed.player.faster()
        self._player_changed()

    def action_slower(self) -> None:
        """Replay slower."""
        assert isinstance(self.feed, ReplayFeed)
        self.feed.player.slower()
        self._player_changed()
