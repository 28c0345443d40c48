"""The typed messages background threads post to the console (the only way they reach it)."""

from __future__ import annotations

from textual.message import Message

from mirage_tui.reports.hang_stacks import RankStacks
from mirage_tui.state.runstate import Outcome


class EventsReady(Message):
    """Events are waiting in the feed's buffer; one of these stands for any number of them."""

    def can_replace(self, message: Message) -> bool:
        # a burst of events collapses into one drain
        return isinstance(message, EventsReady)


class RunFinished(Message):
    """The run is over (a live session stopped and closed, or a replay reached its end)."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__()
        self.outcome = outcome


class AlertReady(Message):
    """Text a background job produced for the alerts pane (stack dumps, Flight-Recorder dumps)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class StacksReady(Message):
    """A stack dump of the run's ranks finished (the ``s`` key): ``ranks`` answered."""

    def __init__(self, title: str, ranks: list[RankStacks]) -> None:
        super().__init__()
        self.title = title
        self.ranks = ranks


class ReplayProgress(Message):
    """Where a replay is: events played, of how many, at which speed, paused or not."""

    def __init__(self, position: int, total: int, speed: float, paused: bool) -> None:
        super().__init__()
        self.position, self.total, self.speed, self.paused = position, total, speed, paused

    def can_replace(self, message: Message) -> bool:
        # only the latest position matters
        return isinstance(message, ReplayProgress)
