"""Graph nodes per step: what MLX dispatches one by one when a step's graph is evaluated.

On the CPU backend each node costs its dispatch from the evaluating thread, whatever its size, so on a
small model the count says much of a step's time (docs/how-it-works.md, "Graph nodes per step").
"""

import io
from contextlib import contextmanager
from unittest import mock

import mlx.core as mx
from mlx.utils import tree_flatten


def graph_nodes(*arrays) -> int:
    """The primitive nodes of the lazy graphs behind `arrays` (any nesting of lists and tuples)."""
    out = io.StringIO()
    mx.export_to_dot(out, *[a for _, a in tree_flatten(list(arrays))])
    return out.getvalue().count("shape=rectangle")


@contextmanager
def nodes_per_async_eval():
    """Within the block, every mx.async_eval (one per step, minivllm's and mlx-lm's alike) records the
    nodes of what it is handed; yields the list. Counting is slow: time nothing inside the block."""
    counts: list[int] = []
    real = mx.async_eval

    def counted(*arrays):
        counts.append(graph_nodes(*arrays))
        return real(*arrays)

    with mock.patch.object(mx, "async_eval", counted):
        yield counts
