"""The config reference, generated from the typed config in gspo_megatron/config.py.

Every key with its type, default and meaning — the meaning is the comment written above the field
in config.py, so the dataclasses stay the single source. `docs/config.md` is this module's output
(tests/test_config.py fails when it is out of date, or when a field has no comment);
`python -m gspo_megatron.train --help` prints the same keys.

    python -m gspo_megatron.config_reference > docs/config.md
"""
from __future__ import annotations

import inspect
import re
import sys
from dataclasses import MISSING, fields, is_dataclass
from typing import get_type_hints

from gspo_megatron import config as config_module

_FIELD = re.compile(r"^\s+(\w+)\s*:\s*[^=]+")


def field_comments(cls) -> dict[str, str]:
    """{field name: the comment block above it} for a dataclass's source; one block serves the
    run of fields right below it (e.g. adam_beta1 and adam_beta2)."""
    out: dict[str, str] = {}
    block: list[str] = []
    in_comment = False
    for line in inspect.getsource(cls).splitlines():
        s = line.strip()
        if s.startswith("#"):
            block = (block if in_comment else []) + [s.lstrip("#").strip()]
            in_comment = True
            continue
        in_comment = False
        m = _FIELD.match(line)
        if m and not s.startswith(("def ", "return ", "@")) and block:
            out[m.group(1)] = " ".join(block)
        elif not m:
            block = []
    return out


def entries(cls=None, prefix: str = "") -> list[dict]:
    """Every leaf key of the config: {"key", "type", "default", "meaning", "section"}."""
    cls = cls or config_module.Config
    notes = field_comments(cls)
    hints = get_type_hints(cls)
    out = []
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            out += entries(hints[f.name], f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)
        out.append({"key": prefix + f.name, "type": str(f.type).replace("typing.", ""),
                    "default": "(required)" if default is MISSING else repr(default),
                    "meaning": notes.get(f.name, ""), "section": prefix.rstrip(".") or "top level"})
    return out


def render_markdown() -> str:
    lines = ["# Configuration reference", "",
             "Generated from `gspo_megatron/config.py` by `python -m gspo_megatron.config_reference`",
             "(do not edit by hand; `tests/test_config.py` checks it is current). Set keys in a YAML file",
             "(`--config`) or as dotted overrides on the command line: `train.max_steps=20 parallel.tp=2`.", ""]
    section = None
    for e in entries():
        if e["section"] != section:
            section = e["section"]
            lines += ["", f"## {section}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        meaning = e["meaning"].replace("|", "\\|")
        lines.append(f"| `{e['key']}` | `{e['type']}` | `{e['default']}` | {meaning} |")
    return "\n".join(lines) + "\n"


def render_help() -> str:
    """Compact list for `train --help`."""
    lines = ["config keys (YAML or dotted overrides; docs/config.md has the meanings):"]
    for e in entries():
        lines.append(f"  {e['key']} = {e['default']}    [{e['type']}]")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
