"""Printing a benchmark's result as JSON (and writing it to --json PATH), shared by tools/bench_*."""

from __future__ import annotations

from typing import Any

import orjson


def emit(result: dict[str, Any], json_path: str | None) -> None:
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
