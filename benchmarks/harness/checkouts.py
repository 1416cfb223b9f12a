"""Another version of the code beside this checkout, for benchmarks that compare against a baseline."""

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[tuple[Path, str]]:
    """A directory holding ref (a checkout directory, or a commit put in a temporary worktree)."""
    root, worktree = Path(ref), None
    if not root.is_dir():
        worktree = Path(tempfile.mkdtemp(prefix="minivllm-baseline-"))
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(worktree), ref], check=True, capture_output=True
        )
        root = worktree
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    try:
        yield root, commit.stdout.strip() or str(root)
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], capture_output=True)
