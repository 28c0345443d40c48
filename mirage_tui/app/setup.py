"""The Setup screen: the topology as a form, checked as it is typed by the command line's own rules.

Every change rebuilds a :class:`~mirage_tui.config.topology.Topology` from the form and
runs :func:`~mirage_tui.config.topology.validate` on it (and :func:`parse_env` on each
env line), then the command line's own checks of flags that contradict each
other and of the program (:func:`~mirage_tui.config.topology.check_combination`,
:func:`~mirage_tui.config.topology.check_command`), so the form accepts exactly what
``mirage run`` accepts and shows the same one-line message when it does not.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.suggester import Suggester
from textual.widgets import Button, Footer, Header, Input, Label, Select, Static, Switch, TextArea

from mirage_tui.config import launch_forms, topology_file
from mirage_tui.config.completion import complete_path
from mirage_tui.config.topology import (
    ExecMode,
    ProgramClock,
    Topology,
    UsageError,
    check_combination,
    check_command,
    parse_env,
    parse_size,
    validate,
)
from wire.profiles import ProfileError, load_profile, profile_names

_LAUNCH_FORMS = [("torchrun on every node", launch_forms.TORCHRUN),
                 ("direct: one process per node", launch_forms.DIRECT)]
_EXEC_MODES = [("functional: right answers, no notion of time", ExecMode.FUNCTIONAL.value),
               ("clocked: also predicts step times (emulated clock)", ExecMode.CLOCKED.value),
               ("estimate: step time and memory at any size, no values", ExecMode.ESTIMATE.value)]


class PathSuggester(Suggester):
    """Offers :func:`~mirage_tui.config.completion.complete_path` as the command field's suggestion (→ accepts it)."""

    def __init__(self) -> None:
        # the file system changes under the form: never answer from a cache
        super().__init__(use_cache=False, case_sensitive=True)

    async def get_suggestion(self, value: str) -> str | None:
        """The completed value."""
        return complete_path(value)


def _profile_options(current: str) -> list[tuple[str, str]]:
    """The bundled and user profiles, and ``current`` too when it is a profile file."""
    names = profile_names()
    return [(n, n) for n in names] + ([] if current in names else [(current, current)])


def _hbm_text(hbm_bytes: int | None) -> str:
    """``--hbm`` as the form shows it: blank for the profile's, else whole GiB or MiB where exact."""
    if hbm_bytes is None:
        return ""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if hbm_bytes % size == 0:
            return f"{hbm_bytes // size}{unit}"
    return str(hbm_bytes)


def _optional(value: int | None) -> str:
    """An optional number as its field shows it: blank when the flag is not given."""
    return "" if value is None else str(value)


def _generated(t: Topology) -> tuple[str, ...] | None:
    """``t``'s command when it has its launch form's own shape (so it may follow the topology), else None."""
    built = launch_forms.build(launch_forms.launch_form(t.command), t.command, t.num_nodes, t.gpus_per_node)
    return t.command if built == t.command else None


def profile_figures(name: str) -> str:
    """One line of a profile's key figures, or why it cannot be loaded."""
    try:
        p = load_profile(name)
    except ProfileError as e:
        return str(e)
    return (f"{p.product} ({p.arch}, {p.gfx}): {p.compute_units} CUs, {p.hbm_gib:g} GiB {p.hbm_type} at "
            f"{p.hbm_tbps:g} TB/s, {p.fp16_tflops:g} FP16 TFLOPS")


class SetupScreen(Screen):
    """Edit the topology; Enter (on Start) launches it."""

    AUTO_FOCUS = "#start"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+s", "start", "Start", tooltip="start the run (so does Enter on Start or in a field)"),
        Binding("ctrl+l", "load", "Load TOML", tooltip="fill the form from the topology TOML in the load field"),
        Binding("ctrl+d", "demo", "Demo", tooltip="fill the form with the bundled DDP demo"),
    ]

    def __init__(self, initial: Topology, demo: Topology, load_path: str = topology_file.LAST_PATH) -> None:
        super().__init__()
        self.initial = initial
        self.demo = demo
        self.load_path = load_path
        #: The topology the form describes, when it is valid.
        self.topology: Topology | None = None
        self._written: tuple[str, ...] | None = None  # the command this form generated last
        # --program-clock has no field: the form keeps the command line's (or a loaded file's) while clocked
        self._program_clock = initial.program_clock

    def compose(self) -> ComposeResult:
        t = self.initial
        yield Header()
        with VerticalScroll(id="setup"):
            with Horizontal(classes="row"):
                yield Label("profile", classes="field")
                yield Select(_profile_options(t.profile), value=t.profile, allow_blank=False, id="profile")
            yield Static(profile_figures(t.profile), markup=False, id="figures")
            with Horizontal(classes="row"):
                yield Label("nodes", classes="field")
                yield Input(str(t.num_nodes), type="integer", id="nodes")
                yield Label("GPUs per node", classes="field")
                yield Input(str(t.gpus_per_node), type="integer", id="gpus")
                yield Label("nproc per node", classes="field")
                yield Input(_optional(t.nproc_per_node), type="integer", placeholder="launcher's", id="nproc")
            with Horizontal(classes="row"):
                yield Label("launch", classes="field")
                yield Select(_LAUNCH_FORMS, value=launch_forms.launch_form(t.command), allow_blank=False,
                             id="launch")
            with Horizontal(classes="row"):
                yield Label("command", classes="field")
                yield Input(shlex.join(t.command), placeholder="python train.py (→ completes a file name)",
                            suggester=PathSuggester(), id="command")
            with Horizontal(classes="row"):
                yield Label("workdir", classes="field")
                yield Input(t.workdir or "", placeholder="the current folder", suggester=PathSuggester(),
                            id="workdir")
                yield Label("clear env", classes="field")
                yield Switch(value=t.clear_env, id="clear-env")
            with Horizontal(classes="row env-row"):
                yield Label("env\nKEY=VALUE\none a line", classes="field")
                yield TextArea("\n".join(f"{k}={v}" for k, v in t.env), id="env")
            with Horizontal(classes="row"):
                yield Label("HBM per GPU", classes="field")
                yield Input(_hbm_text(t.hbm_bytes), placeholder="the profile's (or e.g. 8GiB to rehearse OOM)",
                            id="hbm")
            with Horizontal(classes="row"):
                yield Label("hang timeout (s)", classes="field")
                yield Input(f"{t.hang_timeout_s:g}", type="number", id="hang")
                yield Label("debug rank", classes="field")
                yield Input(_optional(t.debug_rank), type="integer", placeholder="none", id="debug-rank")
                yield Label("in-process", classes="field")
                yield Switch(value=t.in_process, id="in-process")
            with Horizontal(classes="row"):
                yield Label("exec mode", classes="field")
                yield Select(_EXEC_MODES, value=t.exec_mode.value, allow_blank=False, id="exec-mode")
            with Horizontal(classes="row"):
                yield Label("load topology", classes="field")
                yield Input(self.load_path, placeholder="path/to/topology.toml", id="load-path")
                yield Button("Load", id="load")
                yield Button("Demo", id="demo")
            yield Static("", markup=False, id="setup-error")
            yield Button("Start", id="start", variant="success")
        yield Footer()

    def on_mount(self) -> None:
        """Check the prefilled form at once (the command line may have left it invalid)."""
        self.sub_title = "setup: Enter starts the run"
        self.query_one("#setup").border_title = "topology"
        self._written = _generated(self.initial)
        self._check()

    # ------------------------------------------------------------ form -> topology

    def _read(self) -> Topology:
        """The topology the form describes; raise :class:`UsageError` naming the first problem."""
        def number(widget_id: str, flag: str, kind: type) -> int | float:
            text = self.query_one(f"#{widget_id}", Input).value.strip()
            try:
                return kind(text)
            except ValueError:
                what = "a whole number" if kind is int else "a number"
                raise UsageError(f"{flag} must be {what}, got {text!r}") from None

        def optional(widget_id: str, flag: str) -> int | None:  # blank: the flag not given
            return int(number(widget_id, flag, int)) if self.query_one(f"#{widget_id}", Input).value.strip() else None

        try:
            command = tuple(shlex.split(self.query_one("#command", Input).value))
        except ValueError as e:
            raise UsageError(f"command: {e} (quote arguments as a shell would)") from None
        env_text = self.query_one("#env", TextArea).text
        hbm = self.query_one("#hbm", Input).value.strip()
        topology = dataclasses.replace(
            self.initial,
            profile=str(self.query_one("#profile", Select).value),
            num_nodes=int(number("nodes", "--num-nodes", int)),
            gpus_per_node=int(number("gpus", "--gpus-per-node", int)),
            env=tuple(parse_env(line.strip()) for line in env_text.splitlines() if line.strip()),
            hang_timeout_s=float(number("hang", "--hang-timeout", float)),
            in_process=self.query_one("#in-process", Switch).value,
            exec_mode=(mode := ExecMode(str(self.query_one("#exec-mode", Select).value))),
            program_clock=self._program_clock if mode.keeps_time else ProgramClock.WALL,
            hbm_bytes=parse_size(hbm) if hbm else None,
            command=command,
            nproc_per_node=optional("nproc", "--nproc-per-node"),
            workdir=self.query_one("#workdir", Input).value.strip() or None,
            clear_env=self.query_one("#clear-env", Switch).value,
            debug_rank=optional("debug-rank", "--debug-rank"),
        )
        validate(topology)
        check_combination(topology)
        check_command(topology)
        return topology

    def _check(self) -> None:
        error = self.query_one("#setup-error", Static)
        try:
            self.topology = self._read()
        except UsageError as e:
            self.topology = None
            error.update(f"✗ {e}")
            error.set_class(True, "invalid")
        else:
            error.update("✓ ready: Enter or Start launches the run")
            error.set_class(False, "invalid")
        self.query_one("#start", Button).disabled = self.topology is None

    def _follow_topology(self, force: bool = False) -> None:
        """Rewrite the command for the launch form and shape, unless the user wrote their own."""
        try:
            command = tuple(shlex.split(self.query_one("#command", Input).value))
            nodes = int(self.query_one("#nodes", Input).value)
            gpus = int(self.query_one("#gpus", Input).value)
        except ValueError:
            return
        if not (force or command == self._written) or nodes < 1 or gpus < 1:
            return
        self._written = launch_forms.build(str(self.query_one("#launch", Select).value), command, nodes, gpus)
        self.query_one("#command", Input).value = shlex.join(self._written)

    def on_input_changed(self, event: Input.Changed) -> None:
        """Re-check the form; the shape also updates a generated command."""
        if event.input.id in ("nodes", "gpus"):
            self._follow_topology()
        if event.input.id != "load-path":
            self._check()

    def on_select_changed(self, event: Select.Changed) -> None:
        """Show the profile's figures, or rewrite the command for the launch form."""
        if event.select.id == "profile":
            self.query_one("#figures", Static).update(profile_figures(str(event.value)))
        elif event.select.id == "launch" and launch_forms.launch_form(self._command()) != event.value:
            self._follow_topology(force=True)
        self._check()

    def _command(self) -> tuple[str, ...]:
        try:
            return tuple(shlex.split(self.query_one("#command", Input).value))
        except ValueError:
            return ()

    def on_switch_changed(self, _: Switch.Changed) -> None:
        """Re-check the form."""
        self._check()

    def on_text_area_changed(self, _: TextArea.Changed) -> None:
        """Re-check the env lines."""
        self._check()

    # ------------------------------------------------------------ actions

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in a field starts the run (Enter in the load path loads it)."""
        if event.input.id == "load-path":
            self.action_load()
        else:
            self.action_start()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        """Start, Load or Demo."""
        {"start": self.action_start, "load": self.action_load, "demo": self.action_demo}[str(event.button.id)]()

    def action_start(self) -> None:
        """Launch the form's topology, if it is valid."""
        self._check()
        if self.topology is None:
            self.notify(str(self.query_one("#setup-error", Static).content), severity="error")
            return
        self.app.launch(self.topology)

    def action_load(self) -> None:
        """Fill the form from the topology TOML named in the load field."""
        path = self.query_one("#load-path", Input).value.strip()
        try:
            self.fill(topology_file.load(path, base=self.initial))
        except UsageError as e:
            self.notify(str(e), severity="error", timeout=8)
            return
        self.notify(f"loaded {path}")

    def action_demo(self) -> None:
        """Fill the form with the bundled DDP demo."""
        self.fill(self.demo)

    def fill(self, t: Topology) -> None:
        """Put ``t`` into the form."""
        profile = self.query_one("#profile", Select)
        profile.set_options(_profile_options(t.profile))
        profile.value = t.profile
        self.query_one("#nodes", Input).value = str(t.num_nodes)
        self.query_one("#gpus", Input).value = str(t.gpus_per_node)
        self.query_one("#nproc", Input).value = _optional(t.nproc_per_node)
        self.query_one("#workdir", Input).value = t.workdir or ""
        self.query_one("#clear-env", Switch).value = t.clear_env
        self.query_one("#debug-rank", Input).value = _optional(t.debug_rank)
        self.query_one("#launch", Select).value = launch_forms.launch_form(t.command)
        self._written = _generated(t)
        self.query_one("#command", Input).value = shlex.join(t.command)
        self.query_one("#env", TextArea).text = "\n".join(f"{k}={v}" for k, v in t.env)
        self.query_one("#hang", Input).value = f"{t.hang_timeout_s:g}"
        self.query_one("#hbm", Input).value = _hbm_text(t.hbm_bytes)
        self.query_one("#in-process", Switch).value = t.in_process
        self.query_one("#exec-mode", Select).value = t.exec_mode.value
        self._program_clock = t.program_clock
        self._check()
