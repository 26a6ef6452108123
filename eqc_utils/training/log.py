"""A training log: one JSON object a line, each with the optimiser step it describes.

Rows are appended as the run goes, so a killed run keeps what it logged. A resumed run first cuts the log
back to its checkpoint's step (the steps after it are about to be trained again, and would otherwise appear
twice); a fresh run starts from an empty log."""
from __future__ import annotations

import json
from pathlib import Path

from eqc_utils.io import write_jsonl


class JsonlLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, row: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def read(self) -> list[dict]:
        """The rows; a last line cut short (the process was killed while appending it) is left out."""
        if not self.path.exists():
            return []
        lines = [line for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]
        rows = []
        for i, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(lines) - 1:
                    raise ValueError(f"{self.path}:{i + 1}: not valid JSON; fix or delete that line") from None
        return rows

    def truncate(self, after_step: int) -> None:
        """Keep the rows of steps <= after_step (rewritten atomically: a kill leaves the old log or the new)."""
        if self.path.exists():
            write_jsonl(self.path, [row for row in self.read() if row["step"] <= after_step])

    def reset(self) -> None:
        self.path.unlink(missing_ok=True)
