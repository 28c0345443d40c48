"""The Run screen's ranks pane: node → rank, each rank's GPUs and state in its theme colour."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from mirage_tui.app.output_pane import Source
from mirage_tui.app.themes import RANK_STATE_VARIABLES
from mirage_tui.state.runstate import RunState


class RankTree(Tree[Source]):
    """Node → rank as the run's fold knows them; picking an item shows its output (the screen listens)."""

    def __init__(self, **kwargs) -> None:
        super().__init__("cluster", **kwargs)
        self.show_root = False
        self.node_items: dict[int, TreeNode[Source]] = {}
        self.rank_items: dict[int, TreeNode[Source]] = {}

    def on_mount(self) -> None:
        """Title the pane."""
        self.border_title = "ranks"

    def sync(self, state: RunState, nodes: int = 0) -> bool:
        """Add the nodes (at least ``nodes``) and registered ranks not in the tree yet; True if a rank was added."""
        for node in range(max(nodes, state.nodes)):
            self._node_item(node, state)
        added = False
        for rank, status in state.registered.items():
            if rank in self.rank_items:
                continue
            assert status.node is not None  # registered
            parent = self._node_item(status.node, state)
            # ranks register in any order; keep the tree sorted
            later = [item for r, item in self.rank_items.items() if r > rank and item.parent is parent]
            before = min(later, key=lambda item: item.data[1]) if later else None
            self.rank_items[rank] = parent.add_leaf(self._rank_label(state, rank), data=("rank", rank), before=before)
            added = True
        return added

    def redraw(self, state: RunState) -> None:
        """Redraw every label (also after a theme change: the colours are theme variables)."""
        for node, item in self.node_items.items():
            item.set_label(self._node_label(state, node))
        for rank, item in self.rank_items.items():
            item.set_label(self._rank_label(state, rank))

    def _node_item(self, node: int, state: RunState) -> TreeNode[Source]:
        item = self.node_items.get(node)
        if item is None:
            item = self.node_items[node] = self.root.add(self._node_label(state, node), data=("node", node),
                                                         expand=True)
        return item

    @staticmethod
    def _node_label(state: RunState, node: int) -> Text:
        """``node 1`` (``on h2`` when the run spans hosts), then how its process is: starting (no rank has
        registered yet) or its exit code."""
        how = state.node_state(node)
        host = state.node_host(node)
        name = f"node {node} on {host}" if host else f"node {node}"
        return Text.assemble(f"{name} ", (how, "dim")) if how else Text(name)

    def _rank_label(self, state: RunState, rank: int) -> Text:
        word = state.rank_state(rank)
        colour = self.app.current_theme.variables.get(RANK_STATE_VARIABLES[word], "")
        gpus = state.ranks[rank].gpus
        gpu = f"gpu {','.join(map(str, sorted(gpus)))} " if gpus else ""  # known once it used one
        return Text.assemble(("● ", colour), f"rank {rank} ", (gpu, "dim"), (word, colour))
