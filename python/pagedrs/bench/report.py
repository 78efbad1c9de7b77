"""Write a benchmark's JSON and markdown table, and print the table with its machine."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    fmt: str = "{}"  # applied to the value; "-" when the row lacks the key


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    lines = [
        "| " + " | ".join(c.header for c in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        cells = [c.fmt.format(row[c.key]) if row.get(c.key) is not None else "-" for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(title: str, table: str, notes: Sequence[str], machine: str) -> str:
    body = [f"### {title}", "", table, ""]
    body += [f"- {n}" for n in notes]
    body += [f"- Machine: {machine}", ""]
    return "\n".join(body)


def _plain(obj: Any) -> Any:
    """JSON cannot hold NumPy scalars or tuples as keys; convert them."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    return obj


def write_json(path: str, data: dict[str, Any]) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_plain(data), f, indent=2)
        f.write("\n")


def write_outputs(out_dir: str | None, name: str, data: dict[str, Any], markdown: str) -> list[str]:
    """``out_dir/name.json`` and ``out_dir/name.md``; returns the paths written."""
    if out_dir is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{name}.json")
    md_path = os.path.join(out_dir, f"{name}.md")
    write_json(json_path, data)
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(markdown)
    return [json_path, md_path]
