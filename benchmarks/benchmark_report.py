"""What every benchmark script does with its report: print it as JSON and write it to ``--json``."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(report: dict, path: Path | None, *, echo: bool = True) -> None:
    """Print ``report`` as indented JSON (unless ``echo`` is False) and write it to ``path``
    (folders created) when given."""
    text = json.dumps(report, indent=2)
    if echo:
        print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
