"""The console: Setup, then Run (a live session, one started elsewhere, or a replay), then Report.

The app only switches screens, themes and quitting; each screen holds what it
shows. Runs and replays happen on feed threads that talk to the Run screen
through typed messages (:mod:`mirage_tui.app.messages`).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import ClassVar

from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.screen import Screen

from mirage_tui.app.confirm import ConfirmScreen
from mirage_tui.app.feeds import STOPPED_EXIT, AttachFeed, LiveFeed, ReplayFeed
from mirage_tui.app.help_screen import HelpScreen
from mirage_tui.app.report import ReportScreen
from mirage_tui.app.run_screen import RunScreen
from mirage_tui.app.session_picker import SessionPicker
from mirage_tui.app.setup import SetupScreen
from mirage_tui.app.themes import DEFAULT_THEME, register_themes
from mirage_tui.config import topology_file
from mirage_tui.config.topology import Topology
from mirage_tui.session import Session
from mirage_tui.session.registry import SessionEntry
from mirage_tui.state.replay import Recording
from mirage_tui.state.runstate import Outcome


class MirageApp(App[int]):
    """Configure, run (or replay) and report on one emulated cluster run."""

    CSS_PATH = "mirage.tcss"
    TITLE = "mirage"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit", tooltip="quit; a live run is stopped first (asks), no process is left"),
        Binding("t", "cycle_theme", "Theme", tooltip="the next theme: dark, high contrast, light"),
        Binding("question_mark", "help", "Help", key_display="?", tooltip="every key of every screen"),
    ]

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        setup: bool = False,
        demo: Topology | None = None,
        recording: Recording | None = None,
        attach: SessionEntry | None = None,
        pick: list[SessionEntry] | None = None,
        speed: float = 1.0,
        theme: str = DEFAULT_THEME,
        last_path: str = topology_file.LAST_PATH,
    ) -> None:
        """Run ``topology`` at once; or, with ``setup``, show it in the form first (``demo`` is the
        form's Demo button); or play ``recording`` at ``speed`` (0: as fast as possible); or follow the
        live session ``attach`` that another process owns (quitting detaches), or the one picked among
        ``pick``.
        ``last_path`` is where a started topology is saved for the next Setup form."""
        super().__init__()
        if recording is None and topology is None and attach is None and not pick:
            raise ValueError("MirageApp needs a topology, a recording or a session to attach to")
        self.topology = topology
        self.setup = setup
        self.demo = demo or topology
        self.recording = recording
        self.attach = attach
        self.pick = pick
        self.speed = speed
        self.initial_theme = theme
        self.last_path = last_path
        #: The Run screen, once there is one.
        self.run_screen: RunScreen | None = None
        self._quitting = False
        self._restarting = False  # a stop asked for by restart: the next RunFinished starts the run again
        self._theme_names: list[str] = []

    @property
    def outcome(self) -> Outcome | None:
        """How the run ended; None before it ends (or if it never started)."""
        return self.run_screen.outcome if self.run_screen else None

    @property
    def session(self) -> Session | None:
        """The live session, if this app runs one."""
        feed = self.run_screen.feed if self.run_screen else None
        return feed.session if isinstance(feed, LiveFeed) else None

    def on_mount(self) -> None:
        """Register the themes and open the first screen."""
        self._theme_names = register_themes(self)
        self.theme = self.initial_theme
        if self.recording is not None:
            rec = self.recording
            self._show_run(RunScreen(ReplayFeed(rec, self.speed), f"replay of {rec.run_dir}"))
        elif self.attach is not None:
            self._attach_to(self.attach)
        elif self.pick:
            self.push_screen(SessionPicker(self.pick), self._attach_to)
        elif self.setup:
            assert self.topology is not None and self.demo is not None
            self.push_screen(SetupScreen(self.topology, self.demo, self.last_path))
        else:
            assert self.topology is not None
            self.launch(self.topology)

    def _attach_to(self, entry: SessionEntry | None) -> None:
        """Follow ``entry`` on the Run screen (None: the picker was left without a choice)."""
        if entry is None:
            return
        self.attach = entry
        title = f"attached to session {entry.session} (pid {entry.pid}; q detaches): {' '.join(entry.command)}"
        self._show_run(RunScreen(AttachFeed(entry), title, entry.num_nodes))

    def _show_run(self, screen: RunScreen) -> None:
        self.run_screen = screen
        if isinstance(self.screen, (SetupScreen, RunScreen)):  # a run replaces the form, or the run before it
            self.switch_screen(screen)
        else:
            self.push_screen(screen)

    def _back_to_run_screen(self) -> None:
        """Close whatever is over the Run screen (the report, a question, stacks)."""
        while self.screen is not self.run_screen and len(self.screen_stack) > 1:
            self.pop_screen()

    def launch(self, topology: Topology) -> None:
        """Start ``topology``'s run on the Run screen; remember it for the next Setup form."""
        try:
            topology_file.save(topology, self.last_path)
        except OSError as e:  # not worth failing the run over
            self.notify(f"could not save the topology to {self.last_path}: {e.strerror}", severity="warning")
        title = f"{topology.num_nodes} x {topology.gpus_per_node} {topology.profile}: {' '.join(topology.command)}"
        self._show_run(RunScreen(LiveFeed(topology), f"running: {title}", topology.num_nodes))

    def run_finished(self, screen: RunScreen) -> None:
        """The run on ``screen`` ended: quit if the user asked to, else show its report."""
        o = screen.outcome
        assert o is not None
        if self._quitting:
            self.exit(o.returncode, return_code=o.returncode)
            return
        if self._restarting:
            self._restarting = False
            self._start_again(screen)
            return
        if isinstance(self.screen, ConfirmScreen):
            self.pop_screen()  # a question about the live run (kill, quit) has no object any more
        skipped = self.recording.skipped if self.recording else 0
        self.push_screen(ReportScreen(screen.state, o, o.run_dir, skipped))

    def stop_session(self, timeout: float = 30.0) -> None:
        """Tear the run (or replay) down and wait for it (safe to call twice)."""
        if self.run_screen is not None:
            self.run_screen.feed.stop(timeout)

    def restart(self) -> None:
        """Run the current topology again (a live run is stopped cleanly first, after a yes); a replay restarts."""
        screen = self.run_screen
        assert screen is not None
        if screen.replaying or screen.outcome is not None or not screen.feed.running:
            if screen.replaying:
                screen.feed.stop()  # the player ends at once; its RunFinished goes to a screen on its way out
            self._start_again(screen)
            return
        if self._restarting:
            return

        def answered(yes: bool | None) -> None:
            if not yes:
                return
            if screen.outcome is not None:  # the run ended while the question was up
                self._start_again(screen)
                return
            self._restarting = True
            screen.feed.stop(timeout=0)  # asks; the RunFinished it posts when every process is gone restarts
            screen.sub_title = "stopping the run to restart it..."
            self.notify("stopping the run; it starts again when every process is gone")

        self.push_screen(ConfirmScreen("The run is live. Stop it and start it again?"), answered)

    def _start_again(self, old: RunScreen) -> None:
        self._back_to_run_screen()
        if isinstance(old.feed, ReplayFeed):
            self._show_run(RunScreen(ReplayFeed(old.feed.recording, self.speed), old.title_text))
        else:
            assert isinstance(old.feed, LiveFeed)
            self.launch(old.feed.topology)

    def new_run(self) -> None:
        """Back to the Setup form, filled with the finished run's topology, to start another."""
        screen = self.run_screen
        assert screen is not None and isinstance(screen.feed, LiveFeed) and screen.outcome is not None
        self._back_to_run_screen()
        self.run_screen = None
        topology = screen.feed.topology
        self.switch_screen(SetupScreen(topology, self.demo or topology, self.last_path))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The command palette: every key the screen (and the app) offers right now, then Textual's own."""
        ours = set()
        for owner in (screen, self):
            for binding in owner.BINDINGS:
                assert isinstance(binding, Binding)  # ours are all Binding instances
                target, _, name = binding.action.rpartition(".")
                if (self if target == "app" else owner).check_action(name, ()) is not True:
                    continue  # not available here and now (a live-run key during a replay, ...)
                ours.add(binding.description)
                key = binding.key_display or binding.key
                yield SystemCommand(f"{binding.description} ({key})", binding.tooltip or binding.description,
                                    partial(owner.run_action, binding.action))
        # Textual's Quit and Theme would duplicate ours (its Theme picks among themes without rank colours)
        yield from (c for c in super().get_system_commands(screen) if c.title not in ours)

    # ------------------------------------------------------------ actions

    async def action_quit(self) -> None:
        """Quit; a live run is torn down first (the app exits when it has ended)."""
        screen = self.run_screen
        if screen is None:  # still on the Setup form: nothing was started
            self.exit(0, return_code=0)
            return
        if screen.outcome is not None or not screen.feed.running:
            code = screen.outcome.returncode if screen.outcome else STOPPED_EXIT
            self.exit(code, return_code=code)
            return
        if isinstance(screen.feed, ReplayFeed):
            screen.feed.stop()  # the player ends at once
            self.exit(STOPPED_EXIT, return_code=STOPPED_EXIT)
            return
        if isinstance(screen.feed, AttachFeed):  # detach: the run goes on under its owner
            screen.feed.stop()
            self.exit(0, return_code=0)
            return
        if self._quitting or isinstance(self.screen, ConfirmScreen):
            return

        def answered(yes: bool | None) -> None:
            if yes and screen.outcome is None:
                self._quitting = True
                screen.feed.stop(timeout=0)  # asks; the RunFinished it posts when done ends the app
                screen.sub_title = "stopping the run..."
                self.notify("stopping the run; quitting when every process is gone")
            elif yes:  # the run ended while the question was up
                self.exit(screen.outcome.returncode, return_code=screen.outcome.returncode)

        self.push_screen(ConfirmScreen("The run is live. Stop it and quit?"), answered)

    def action_cycle_theme(self) -> None:
        """Switch to the next mirage theme."""
        names = self._theme_names
        i = names.index(self.theme) if self.theme in names else -1
        self.theme = names[(i + 1) % len(names)]
        if self.run_screen is not None:
            self.run_screen.update_rank_labels()  # tree labels take their colours from the theme's variables
        self.notify(f"theme: {self.theme}")

    def action_help(self) -> None:
        """Show the help screen: every key of every screen (again: close it)."""
        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
        else:
            self.push_screen(HelpScreen())

    def on_unmount(self) -> None:
        """However the app ends, no process of the run may outlive it."""
        self.stop_session()

