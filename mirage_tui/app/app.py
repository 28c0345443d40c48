"""The console's Run screen: a cluster tree, the selected rank's output, the collectives grid, alerts.

The session runs on a worker thread and knows nothing of the UI: its sink only
appends events to a deque and posts :class:`EventsReady`. Every widget update
happens on the app's thread, in the handler that drains the deque into the
shared :class:`~mirage_tui.runstate.RunState` fold.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import DataTable, Footer, Header, Log, Static, Tree
from textual.widgets.tree import TreeNode

from emulator import schema as s
from mirage_tui import diagnosis
from mirage_tui.app.themes import DEFAULT_THEME, register_themes
from mirage_tui.runstate import RunState
from mirage_tui.session import LaunchError, Outcome, Session
from mirage_tui.topology import Topology

#: Lines kept per rank (and per node process); older ones are only in the run directory's logs.
MAX_LINES = 10_000
#: Exit code of a run the user stopped from the console (as a Ctrl-C in batch mode).
STOPPED_EXIT = 130

Source = tuple[str, int]  # ("rank", r) or ("node", n): whose output a Log shows
_COLUMNS = (("comm", "communicator"), ("rank", "rank"), ("enq", "enqueued"), ("start", "started"),
            ("done", "completed"), ("op", "op"), ("numel", "numel"), ("dtype", "dtype"))


class EventsReady(Message):
    """Events are waiting in the app's buffer; one of these stands for any number of them."""

    def can_replace(self, message: Message) -> bool:
        # a burst of events collapses into one drain
        return isinstance(message, EventsReady)


class RunFinished(Message):
    """The session has been stopped and closed."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__()
        self.outcome = outcome


class StacksDumped(Message):
    """The text of a stack dump of every live rank (key ``s``)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class MirageApp(App[int]):
    """Run one topology's command and watch it: ranks, output, collectives, hangs."""

    CSS_PATH = "mirage.tcss"
    TITLE = "mirage"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("s", "dump_stacks", "Stacks"),
        Binding("t", "cycle_theme", "Theme"),
        Binding("question_mark", "help", "Help", key_display="?"),
    ]

    def __init__(self, topology: Topology) -> None:
        super().__init__()
        self.topology = topology
        self.state = RunState()
        #: How the run ended; None while it runs.
        self.outcome: Outcome | None = None
        self.session: Session | None = None
        self._buffer: deque[s.Event] = deque()  # appended by the dispatcher thread, drained here
        self._stop_requested = threading.Event()
        self._runner: threading.Thread | None = None
        self._quitting = False
        self._lines: dict[Source, deque[str]] = {}
        self._selected: Source | None = None
        self._user_selected = False
        self._node_items: dict[int, TreeNode[Source]] = {}
        self._rank_items: dict[int, TreeNode[Source]] = {}
        self._rank_node: dict[int, int] = {}
        self._hung: dict[int, str] = {}  # rank -> "stuck" (waits in the hung collective) or "missing"
        self._exited: set[int] = set()
        self._rows: dict[str, tuple] = {}  # grid row key -> the values it shows
        self._alerts: list[str] = []
        self._theme_names: list[str] = []

    # ------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            tree: Tree[Source] = Tree("cluster", id="ranks")
            tree.show_root = False
            yield tree
            yield Log(max_lines=MAX_LINES, id="output")
        with Horizontal(id="bottom"):
            yield DataTable(id="collectives", cursor_type="row", zebra_stripes=True)
            with VerticalScroll(id="alerts"):
                yield Static("no alerts", markup=False, id="alerts-text")
        yield Footer()

    def on_mount(self) -> None:
        """Register the themes, set up the widgets and start the session's thread."""
        self._theme_names = register_themes(self)
        self.theme = DEFAULT_THEME
        topo = self.topology
        self.sub_title = f"running: {topo.num_nodes} x {topo.gpus_per_node} {topo.profile}: {' '.join(topo.command)}"
        self.query_one("#ranks", Tree).border_title = "ranks"
        self.query_one("#output", Log).border_title = "output"
        grid = self.query_one("#collectives", DataTable)
        grid.border_title = "collectives"
        for key, label in _COLUMNS:
            grid.add_column(label, key=key)
        self.query_one("#alerts").border_title = "alerts"
        tree = self.query_one("#ranks", Tree)
        for node in range(topo.num_nodes):
            self._node_items[node] = tree.root.add(f"node {node}", data=("node", node), expand=True)
        self._runner = threading.Thread(target=self._run_session, name="mirage-session")
        self._runner.start()

    # ------------------------------------------------------------ the session's thread

    def _sink(self, event: s.Event) -> None:
        # called on the session's dispatcher thread: no widget may be touched here
        self._buffer.append(event)
        self.post_message(EventsReady())

    def _run_session(self) -> None:
        """Start, wait, stop, close (as batch mode does, without signal handlers); then post RunFinished."""
        try:
            session = Session(self.topology, self._sink)
        except Exception as e:  # e.g. the log directory cannot be created
            self.post_message(RunFinished(Outcome(1, f"could not create the run: {e}", "")))
            return
        self.session = session
        outcome: Outcome | None = None
        result: list[Outcome | BaseException] = []

        def wait() -> None:
            try:
                result.append(session.wait())
            except BaseException as e:  # handed to the runner thread below
                result.append(e)

        # wait() has no way to be interrupted, so it runs on its own thread and this one
        # watches for the user's quit; session.stop() then ends the nodes and so the wait
        waiter = threading.Thread(target=wait, name="mirage-wait", daemon=True)
        try:
            try:
                if not self._stop_requested.is_set():
                    session.start()
                    waiter.start()
                    while waiter.is_alive() and not self._stop_requested.is_set():
                        waiter.join(0.1)
                if self._stop_requested.is_set() and not result:
                    outcome = Outcome(STOPPED_EXIT, "stopped from the console; run stopped", session.run.path)
                elif isinstance(result[0], BaseException):
                    raise result[0]
                else:
                    outcome = result[0]
            except LaunchError as e:
                outcome = Outcome(e.returncode, str(e), session.run.path)
            except Exception as e:
                outcome = Outcome(1, f"the console's runner failed: {e!r}", session.run.path)
            finally:
                session.stop()
                if waiter.is_alive():
                    waiter.join(10)  # its nodes are gone: it returns within one poll
        finally:
            session.close(outcome)
            self.post_message(RunFinished(outcome or Outcome(1, "the run ended without an outcome", session.run.path)))

    def stop_session(self, timeout: float = 30.0) -> None:
        """Ask the session's thread to tear the run down and wait for it (safe to call twice)."""
        self._stop_requested.set()
        if self._runner is not None and self._runner is not threading.current_thread():
            self._runner.join(timeout)

    # ------------------------------------------------------------ events -> widgets

    def on_events_ready(self, _: EventsReady) -> None:
        """Drain the buffer into the fold and the widgets."""
        self._drain()

    def _drain(self) -> None:
        new_lines: list[str] = []
        grid_dirty = ranks_dirty = False
        while self._buffer:
            e = self._buffer.popleft()
            self.state.apply(e)
            if isinstance(e, s.OutputLine):
                source: Source = ("rank", e.rank) if e.rank >= 0 else ("node", e.node)
                self._lines.setdefault(source, deque(maxlen=MAX_LINES)).append(e.text)
                if source == self._selected:
                    new_lines.append(e.text)
            elif isinstance(e, s.RankRegistered):
                self._add_rank(e.rank, e.node)
            elif isinstance(e, (s.CommJoined, s.CollectiveEnqueued, s.CollectiveStarted, s.CollectiveCompleted)):
                grid_dirty = ranks_dirty = True
            elif isinstance(e, s.HangDetected):
                self._hung.update({r: "stuck" for r in e.joined})
                self._hung.update({r: "missing" for r in e.missing})
                ranks_dirty = True
            elif isinstance(e, s.HangReport):
                self._alert(e.text)
            elif isinstance(e, s.CommFailed):
                self._alert(f"communicator {e.comm[:8]} failed: {e.code}: {e.message}")
            elif isinstance(e, s.StragglerWarning):
                self._alert(f"rank {e.rank} arrived last at {e.count} collectives in a row of communicator "
                            f"{e.comm[:8]}, {e.mean_margin_s:.2f} s behind on average (a straggler)")
            elif isinstance(e, s.RankGone):
                self._exited.add(e.rank)
                ranks_dirty = True
            elif isinstance(e, s.ProcessExited):
                self._exited.update(r for r, n in self._rank_node.items() if n == e.node)
                ranks_dirty = True
        if new_lines:
            self.query_one("#output", Log).write_lines(new_lines)
        if grid_dirty:
            self._update_grid()
        if ranks_dirty:
            self._update_rank_labels()

    def _add_rank(self, rank: int, node: int) -> None:
        if rank in self._rank_items:
            return
        self._rank_node[rank] = node
        parent = self._node_items.get(node)
        if parent is None:  # a node the topology did not announce: show it anyway
            parent = self._node_items[node] = self.query_one("#ranks", Tree).root.add(
                f"node {node}", data=("node", node), expand=True)
        # ranks register in any order; keep the tree sorted
        later = [item for r, item in self._rank_items.items() if r > rank and item.parent is parent]
        before = min(later, key=lambda item: item.data[1]) if later else None
        self._rank_items[rank] = parent.add_leaf(self._rank_label(rank), data=("rank", rank), before=before)
        if not self._user_selected:  # until the user picks one, show the lowest rank
            self._select(("rank", min(self._rank_items)))

    def _rank_state(self, rank: int) -> str:
        if rank in self._exited:
            return "exited"
        if rank in self._hung:
            return self._hung[rank]
        for comm in self.state.comms.values():
            pos = comm.ranks.get(rank)
            if pos is not None and pos.last_enqueued > pos.last_completed:
                return "in collective"
        return "running"

    def _rank_label(self, rank: int) -> Text:
        state = self._rank_state(rank)
        variable = "rank-" + {"in collective": "collective"}.get(state, state)
        colour = self.current_theme.variables.get(variable, "")
        return Text.assemble(("● ", colour), f"rank {rank} ", (state, colour))

    def _update_rank_labels(self) -> None:
        for rank, item in self._rank_items.items():
            item.set_label(self._rank_label(rank))

    def _update_grid(self) -> None:
        grid = self.query_one("#collectives", DataTable)
        for comm in self.state.comms.values():
            for rank in sorted(comm.ranks):
                p = comm.ranks[rank]
                key = f"{comm.comm}:{rank}"
                row = (comm.comm[:8], rank, p.last_enqueued, p.last_started, p.last_completed, p.op, p.numel, p.dtype)
                old = self._rows.get(key)
                if old == row:
                    continue
                if old is None:
                    grid.add_row(*row, key=key)
                else:
                    for (column, _), value, before in zip(_COLUMNS, row, old):
                        if value != before:
                            grid.update_cell(key, column, value, update_width=True)
                self._rows[key] = row

    def _alert(self, text: str) -> None:
        self._alerts.append(text)
        self.query_one("#alerts-text", Static).update("\n\n".join(self._alerts))
        self.query_one("#alerts", VerticalScroll).scroll_end(animate=False)

    def on_tree_node_selected(self, event: Tree.NodeSelected[Source]) -> None:
        """Show the output of the rank (or node process) picked in the tree."""
        if event.node.data is not None:
            self._user_selected = True
            self._select(event.node.data)

    def _select(self, source: Source) -> None:
        if source == self._selected:
            return
        self._selected = source
        log = self.query_one("#output", Log)
        log.border_title = f"{source[0]} {source[1]} output"
        log.clear()
        log.write_lines(list(self._lines.get(source, ())))

    def on_run_finished(self, message: RunFinished) -> None:
        """Record the outcome; quit now if the user asked to while the run was being stopped."""
        self._drain()
        self.outcome = message.outcome
        o = message.outcome
        status = "ok" if o.returncode == 0 else "FAILED"
        self.sub_title = f"{status}: exit {o.returncode}"
        self._alert(f"run {status}: {o.summary} (exit {o.returncode}); run dir: {o.run_dir}")
        if self._quitting:
            self.exit(o.returncode, return_code=o.returncode)

    def on_stacks_dumped(self, message: StacksDumped) -> None:
        """Put a stack dump into the alerts pane."""
        self._alert(message.text)

    # ------------------------------------------------------------ actions

    async def action_quit(self) -> None:
        """Quit; a live run is torn down first (the app exits when its RunFinished arrives)."""
        if self.outcome is not None or self._runner is None or not self._runner.is_alive():
            code = self.outcome.returncode if self.outcome else STOPPED_EXIT
            self.exit(code, return_code=code)
            return
        if not self._quitting:
            self._quitting = True
            self._stop_requested.set()
            self.sub_title = "stopping the run..."
            self.notify("stopping the run; quitting when every process is gone")

    def action_dump_stacks(self) -> None:
        """Ask every live rank for its Python stacks (on a thread: it waits up to a second)."""
        session = self.session
        if session is None or not session.state.rank_pids:
            self.notify("no ranks to ask yet", severity="warning")
            return
        pids = dict(session.state.rank_pids)

        def dump() -> None:
            stacks = diagnosis.dump_stacks(pids, session.run.ranks, session.run.session)
            text = "\n".join(f"--- rank {r} stacks ---\n{t or '(no answer)'}" for r, t in sorted(stacks.items()))
            self.post_message(StacksDumped(text or "stacks: no live rank of this run answered"))

        self.run_worker(dump, thread=True, group="stacks", exclusive=True)

    def action_cycle_theme(self) -> None:
        """Switch to the next mirage theme."""
        names = self._theme_names
        i = names.index(self.theme) if self.theme in names else -1
        self.theme = names[(i + 1) % len(names)]
        self._update_rank_labels()  # tree labels take their colours from the theme's variables
        self.notify(f"theme: {self.theme}")

    def action_help(self) -> None:
        """Toggle Textual's key help panel."""
        if self.screen.query("HelpPanel"):
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()

    def on_unmount(self) -> None:
        """However the app ends, no process of the run may outlive it."""
        self.stop_session()
