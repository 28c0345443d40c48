"""The Run screen: a cluster tree, the selected rank's output, collectives (grid and in flight), alerts;
in a clocked run, the ranks' timeline in emulated time. Past 16 ranks the tree, the per-rank ledger and the
per-device memory give way to views made for many ranks (``rank_grid.py``, ``many_views.py``; ``g`` switches).

Its events come from a feed (a live session or a replay) that runs on another
thread and only buffers events and posts messages. Every widget update happens
here, in the handler that drains the buffer: each event goes into the run's
fold (:class:`~mirage_tui.state.runstate.RunState`, the one batch mode's session and
``mirage status`` keep too), and the panes (``*_pane.py``) then redraw what
it says changed, reading only the fold.

Up to 530 lines on purpose: one screen's keys, each with its handler, over panes that draw themselves; what
switches between the views for few and many ranks lives in ``many_views.py``.
"""

from __future__ import annotations

import os
import time
from typing import ClassVar

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, Log, Static, Tree

from mirage_tui.app.confirm import ConfirmScreen
from mirage_tui.app.feeds import AttachFeed, Feed, LiveFeed, ReplayFeed
from mirage_tui.app.gpu_pane import GpuMemory
from mirage_tui.app.inflight_pane import InFlightPane
from mirage_tui.app.ledger_pane import LedgerGrid, row_rank
from mirage_tui.app.many_views import ManyRankViews
from mirage_tui.app.messages import AlertReady, EventsReady, ReplayProgress, RunFinished, StacksReady
from mirage_tui.app.output_pane import OutputPane, Source
from mirage_tui.app.rank_grid import CommProgressPane, MemoryDistributionPane, RankGrid
from mirage_tui.app.ranks_pane import RankTree
from mirage_tui.app.stacks_screen import StacksScreen
from mirage_tui.app.themes import RANK_STATE_VARIABLES
from mirage_tui.app.timeline_pane import TimelineBox, TimelinePane
from mirage_tui.reports import diagnosis, flight_recorder, hang_stacks
from mirage_tui.reports.hang_stacks import RankStacks
from mirage_tui.state.runstate import Changed, Outcome, RunState
from wire import schema as s


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
        Binding("g", "toggle_grid", "Grid", show=False,
                tooltip="the views for many ranks (rank grid, communicators' progress, memory distribution) or "
                        "the tree, the per-rank ledger and per-GPU memory"),
        Binding("b", "next_laggard", "Laggard",
                tooltip="the grid's cursor to the next rank the others wait for (behind, missing, stuck)"),
        Binding("c", "toggle_timeline", "Timeline",
                tooltip="clocked runs: hide or show the ranks' timeline in emulated time (the last steps)"),
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
        #: The run as its events tell it; the panes draw from it.
        self.state = RunState()
        #: How the run ended; None while it runs.
        self.outcome: Outcome | None = None
        self._user_selected = False  # until the user picks a source, the lowest rank's output shows
        self._timeline_hidden = False  # the user hid the clocked timeline (c)
        self.views = ManyRankViews(self)  # the tree and the per-rank panes, or those for many ranks
        self._alerts: list[Text] = []

    @property
    def replaying(self) -> bool:
        """Whether this screen plays a recording (rather than a live run)."""
        return isinstance(self.feed, ReplayFeed)

    # ------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield RankTree(id="ranks")
                with VerticalScroll(id="grid-pane", classes="many"):
                    yield RankGrid(id="rank-grid")
                with VerticalScroll(id="gpu-pane"):
                    yield GpuMemory(id="gpu-memory")
                    yield MemoryDistributionPane(id="memory-dist", classes="many")
            with Vertical(id="output-pane"):
                yield OutputPane(id="logs")
                yield Input(placeholder="show lines containing… (enter: keep, esc: clear)", id="filter")
                with VerticalScroll(id="traffic"):
                    yield InFlightPane(id="inflight")
        with TimelineBox(id="timeline-box"):  # shown once the run turns out to be clocked
            yield TimelinePane(id="timeline")
        with Horizontal(id="bottom"):
            yield LedgerGrid(id="collectives")
            with VerticalScroll(id="comm-pane", classes="many"):
                yield CommProgressPane(id="comm-progress")
            with VerticalScroll(id="alerts"):
                yield Static("no alerts", markup=False, id="alerts-text")
        if self.replaying:
            yield Static("", markup=False, id="replay-bar")
        yield Footer()

    def on_mount(self) -> None:
        """Set up the widgets and start the feed."""
        self.sub_title = self.title_text
        self.query_one("#alerts").border_title = "alerts"
        self.query_one("#gpu-pane").border_title = "GPU memory"
        self.query_one("#grid-pane").border_title = "ranks by host and node (g: tree)"
        self.query_one("#comm-pane").border_title = "communicators: who is behind"
        self.query_one("#traffic").border_title = "collectives in flight"
        self.query_one(TimelineBox).border_title = "clocked timeline: the last steps in emulated time (c hides)"
        self.query_one(RankTree).sync(self.state, self.nodes)
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
            if self.views.shown:  # how long the first rank has waited grows too
                self.views.redraw(self.state, self.clock(), cells=True, memory=False)
            else:
                self.query_one(LedgerGrid).redraw(self.state, self.clock())
            # idle seconds bring the throughput down to zero; a replay's come with its next event
            self.state.traffic.advance(self.clock())
            self.query_one(InFlightPane).redraw(self.state.traffic, self.clock(), self.state.comm_label)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Replay keys only while replaying, stacks and stop only while live, the report once there is one."""
        if action in ("toggle_pause", "step", "faster", "slower"):
            return self.replaying and self.outcome is None
        if action in ("dump_stacks", "kill_rank", "stop"):
            return not self.replaying and self.outcome is None
        if action == "report":
            return self.outcome is not None
        if action == "next_laggard":
            return self.views.shown
        if action == "toggle_timeline":
            return self.state.clocked
        if action == "hang_stacks":
            return bool(self.state.hang_reports) or None  # None: shown, greyed out, until there is a hang
        if action == "new_run":
            return isinstance(self.feed, LiveFeed) and self.outcome is not None
        if action == "restart":
            return not isinstance(self.feed, AttachFeed)  # the owner runs it; it alone may start it again
        return True

    # ------------------------------------------------------------ events -> fold -> panes

    @property
    def superseded(self) -> bool:
        """Whether a restart replaced this screen: its feed's last messages may still arrive, and are dropped."""
        return self.app.run_screen is not self

    def on_events_ready(self, _: EventsReady) -> None:
        """Drain the feed's buffer into the fold and the panes."""
        if not self.superseded:
            self._drain()

    def _drain(self) -> None:
        """Fold the buffered events in, keep their output lines and alerts, then redraw what changed."""
        buffer = self.feed.claim()
        output = self.query_one(OutputPane)
        changed = Changed.NOTHING
        while buffer:
            e = buffer.popleft()
            changed |= self.state.apply(e)
            if isinstance(e, s.OutputLine):
                output.take(e)
            elif isinstance(e, s.HangReport):
                self._alert(self._hang_alert(e))
                self.refresh_bindings()
            elif isinstance(e, s.CommFailed):
                self._alert(Text(f"communicator {self.state.comm_label(e.comm)} failed: {e.code}: {e.message}",
                                 style=self.app.current_theme.error or ""))
            elif isinstance(e, s.RankDebugging) and e.phase is s.DebugPhase.WAITING:
                self._alert(Text(f"rank {e.rank} is stopped and waits for a debugger ({e.debugger}); connect "
                                 f"with:\n  {e.connect}", style=f"bold {self.app.current_theme.accent or ''}"))
            elif isinstance(e, s.StragglerWarning):
                self._alert(f"rank {e.rank} arrived last at {e.count} collectives in a row of communicator "
                            f"{self.state.comm_label(e.comm)}, {e.mean_margin_s:.2f} s behind on average (a straggler)")
        if changed & Changed.RANKS:
            tree = self.query_one(RankTree)
            if tree.sync(self.state) and not self._user_selected:
                output.select(("rank", min(tree.rank_items)))
            if self.views.wanted(self.state) != self.views.shown:
                self.views.show(self.state, self.clock())
            elif not self.views.shown:  # the hidden views are drawn in full when they come back
                tree.redraw(self.state)
        output.flush()  # after a new selection's refill, which includes what it would write
        if self.views.shown:
            self.views.redraw(self.state, self.clock(), cells=bool(changed & (Changed.RANKS | Changed.LEDGER)),
                              memory=bool(changed & Changed.MEMORY))
        else:
            if changed & Changed.LEDGER:
                self.query_one(LedgerGrid).redraw(self.state, self.clock())
            if changed & Changed.MEMORY:
                self.query_one(GpuMemory).redraw(self.state)
        if changed & Changed.TRAFFIC:
            self.query_one(InFlightPane).redraw(self.state.traffic, self.clock(), self.state.comm_label)
        if changed & Changed.CLOCK:
            self._redraw_timeline()

    def _redraw_timeline(self) -> None:
        """Show the timeline (unless hidden with c) once the run is clocked, and draw it."""
        box = self.query_one(TimelineBox)
        if not box.display and not self._timeline_hidden and self.state.clocked:
            box.display = True
            self.refresh_bindings()  # c now applies
        if box.display:
            self.query_one(TimelinePane).redraw(self.state)

    def update_rank_labels(self) -> None:
        """Redraw every rank's state (also after a theme change: the colours are theme variables)."""
        if self.views.shown:
            self.views.redraw(self.state, self.clock(), cells=True, memory=True)
        else:
            self.query_one(RankTree).redraw(self.state)

    def on_rank_grid_picked(self, message: RankGrid.Picked) -> None:
        """A cell picked in the grid: that rank's output, its memory beside the distribution, its tree item."""
        self._user_selected = True
        self.query_one(OutputPane).select(("rank", message.rank))
        self.views.picked(self.state, message.rank)

    def action_toggle_grid(self) -> None:
        """Switch between the views for many ranks and the tree, ledger and per-GPU memory."""
        self.views.choice = not self.views.shown
        self.views.show(self.state, self.clock())

    def action_next_laggard(self) -> None:
        """The grid's cursor to the next rank the others wait for, and its output."""
        self.query_one(RankGrid).pick_next_laggard()

    def _hang_alert(self, e: s.HangReport) -> Text:
        """The session's hang report with the missing ranks in the theme's colour, and the key to their stacks."""
        text = Text(e.text)
        colour = self.app.current_theme.variables.get(RANK_STATE_VARIABLES["missing"], "")
        text.highlight_regex(r"missing ranks: \{[^}]*\}", f"bold {colour}")
        for rank in (r for r, status in self.state.ranks.items() if status.hung == "missing"):
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
            self.query_one(OutputPane).select(event.node.data)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter on a grid row picks its rank in the tree (and so shows its output)."""
        tree = self.query_one(RankTree)
        item = tree.rank_items.get(row_rank(str(event.row_key.value)))
        if item is not None:
            tree.move_cursor(item)
            tree.select_node(item)

    def on_replay_progress(self, message: ReplayProgress) -> None:
        """Show where the replay is."""
        state = "paused" if message.paused else "playing"
        speed = "max" if message.speed <= 0 else f"{message.speed:g}x"
        # one line high (the style sheet): ten times a second, it needs no layout of the screen
        self.query_one("#replay-bar", Static).update(
            f"replay {state} at {speed}: event {message.position} of {message.total}   "
            "space pause · . step · +/- speed", layout=False)

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
        live = self.feed.live_ranks()
        run_dir = self.feed.run_dir
        if live is None or not live[0] or run_dir is None:
            self.notify("no ranks to ask yet", severity="warning")
            return
        pids, session = live
        ranks_dir = os.path.join(run_dir, "ranks")

        def dump() -> None:
            stacks = diagnosis.dump_stacks(pids, ranks_dir, session)
            ranks = [RankStacks(r, "live", f"rank {r}: pid {pids[r]}",
                                hang_stacks.current_thread_first(text or "(no answer)"))
                     for r, text in sorted(stacks.items())]
            self.post_message(StacksReady(f"stacks of {len(ranks)} live rank(s) at {time.strftime('%H:%M:%S')} "
                                          f"(also appended to {ranks_dir}/rank-N.stacks)", ranks))

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
        report = self.state.hang_reports[-1]
        run_dir = self.feed.run_dir or ""
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
            self.query_one(OutputPane).set_filter(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Keep the filter and go back to the output."""
        if event.input.id == "filter":
            event.input.display = bool(self.query_one(OutputPane).filter)
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
        self.query_one(OutputPane).toggle_pin()

    def action_toggle_stderr(self) -> None:
        """Show or hide the selected source's stderr lines."""
        self.query_one(OutputPane).toggle_stderr()

    def action_toggle_timestamps(self) -> None:
        """Prefix each output line with the time it was printed, or not."""
        self.query_one(OutputPane).toggle_timestamps()

    def action_kill_rank(self) -> None:
        """Kill the selected rank's process (after a yes), as a crash or the OOM killer would."""
        feed = self.feed
        selected = self.query_one(OutputPane).selected
        if self.replaying or selected is None or selected[0] != "rank":
            self.notify("select a rank in the tree first", severity="warning")
            return
        rank = selected[1]

        def answered(yes: bool | None) -> None:
            if not yes:
                return
            pid = feed.kill_rank(rank)
            if pid is None:
                self.notify(f"rank {rank} has no live process of this run", severity="warning")
            else:
                self.state.rank_killed(rank)
                self._alert(f"killed rank {rank} (pid {pid}) from the console")

        self.app.push_screen(ConfirmScreen(f"Kill rank {rank} (SIGKILL)? Its peers will see a dead peer."),
                             answered)

    def action_fr_dump(self) -> None:
        """Write Flight-Recorder dumps of the run so far (a replay: of the events played) on a thread."""
        feed = self.feed
        if not isinstance(feed, ReplayFeed):
            run_dir = feed.run_dir
            if run_dir is None:
                self.notify("the run has not started yet", severity="warning")
                return

            def dump() -> str:
                return flight_recorder.dump_run(run_dir)
        else:
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

    def action_toggle_timeline(self) -> None:
        """Hide or show the clocked timeline."""
        self._timeline_hidden = not self._timeline_hidden
        self.query_one(TimelineBox).display = not self._timeline_hidden
        self._redraw_timeline()

    def action_report(self) -> None:
        """Show the report of the finished run."""
        self.app.run_finished(self)

    def action_stop(self) -> None:
        """Stop the live run after a yes; the report follows, as after any end."""
        def answered(yes: bool | None) -> None:
            if not yes or self.outcome is not None:
                return
            if isinstance(self.feed, AttachFeed):  # its owner stops it, as after a Ctrl-C there
                if self.feed.stop_run():
                    self.sub_title = f"asked the session's owner (pid {self.feed.entry.pid}) to stop the run..."
                return
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
