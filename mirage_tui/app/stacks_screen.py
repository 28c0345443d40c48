"""Python stacks of a run's ranks over the Run screen: a rank list on the left, its stacks on the right."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, OptionList, Static
from textual.widgets.option_list import Option

from mirage_tui.reports.hang_stacks import RankStacks


class StacksScreen(ModalScreen[None]):
    """Show ``ranks``' stacks (the first one's at once); up/down picks a rank, esc closes."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss", "Close", key_display="esc",
                                                   tooltip="close the stacks; up/down picks a rank")]

    def __init__(self, title: str, ranks: list[RankStacks]) -> None:
        super().__init__()
        self.title_text = title
        self.ranks = ranks

    def compose(self) -> ComposeResult:
        with Vertical(id="stacks-box"):
            yield Static(self.title_text, markup=False, id="stacks-title")
            with Horizontal():
                yield OptionList(*(Option(f"rank {r.rank} {r.role}", id=str(i)) for i, r in enumerate(self.ranks)),
                                 id="stacks-ranks")
                with VerticalScroll(id="stacks-scroll"):
                    yield Static("", markup=False, id="stacks-text")
        yield Footer()

    def on_mount(self) -> None:
        """Show the first rank (a hang's first missing rank: the one the others wait for)."""
        self.query_one("#stacks-box").border_title = "stacks"
        ranks = self.query_one("#stacks-ranks", OptionList)
        ranks.highlighted = 0
        ranks.focus()
        self.show(0)

    def show(self, index: int) -> None:
        """Show the stacks of ``ranks[index]``."""
        r = self.ranks[index]
        self.query_one("#stacks-text", Static).update(f"{r.heading}\n\n{r.stacks}")
        self.query_one("#stacks-scroll", VerticalScroll).scroll_home(animate=False)

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        """Follow the highlighted rank."""
        if event.option_index is not None and event.option_index < len(self.ranks):
            self.show(event.option_index)
