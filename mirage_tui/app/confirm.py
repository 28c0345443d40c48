"""A yes/no question over the current screen (killing a rank, quitting a live run)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class ConfirmScreen(ModalScreen[bool]):
    """Ask ``question``; dismiss with True for y or Yes, False for n, esc or No."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Static(self.question, markup=False, id="question")
            with Horizontal(id="answers"):
                yield Button("Yes (y)", id="yes", variant="error")
                yield Button("No (n)", id="no")

    def on_mount(self) -> None:
        """Focus No: a stray Enter must not kill anything."""
        self.query_one("#no", Button).focus()

    def action_answer(self, yes: bool) -> None:
        """Close the question with the answer."""
        self.dismiss(yes)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        """The buttons answer as the keys do."""
        self.dismiss(event.button.id == "yes")
