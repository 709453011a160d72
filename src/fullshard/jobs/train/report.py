"""Reporting shared by the training jobs: the JSON-lines metrics file and byte sizes for humans."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class MetricsFile:
    """Appends one JSON object per line to ``path`` (rank 0 only); truncates it on open unless
    ``append`` (a resumed run continues the file)."""

    def __init__(self, path: str | None, enabled: bool, append: bool = False) -> None:
        self.path = Path(path) if path and enabled else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not append or not self.path.exists():
                self.path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
