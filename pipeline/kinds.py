"""Reads the kinds file (KINDS_FILE, TOML) into the kinds a worker serves: the three built-in ones
on their TOPIC_* topics, plus the file's. Every problem is reported at start, naming the file and
the entry (`schemas.kinds` has the shapes)."""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas.kinds import KindSpec, default_topic


def read_kinds(
    path: Path | None, built_in: dict[str, KindSpec], reserved: Iterable[str]
) -> dict[str, KindSpec]:
    """The built-in kinds and those of the file at `path` (none when None). `reserved`: topics no
    kind may read (the answer topics). Raises ValueError saying what is wrong and where."""
    kinds = dict(built_in)
    if path is None:
        return kinds
    where = f"KINDS_FILE={path}"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{where} cannot be read: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} is not valid TOML: {exc}") from None
    if set(data) - {"kinds"}:
        raise ValueError(
            f"{where}: only a [kinds] table is read, found {', '.join(sorted(set(data) - {'kinds'}))}"
        )
    entries: Any = data.get("kinds", {})
    if not isinstance(entries, dict) or not all(isinstance(e, dict) for e in entries.values()):
        raise ValueError(f"{where}: [kinds] must hold one table per kind, e.g. [kinds.support_ticket]")
    problems = []
    for name, entry in entries.items():
        if name in built_in:
            problems.append(
                f"kinds.{name}: built in (its topic is set by TOPIC_*, its prompts are the project's)"
            )
            continue
        try:
            kinds[name] = KindSpec.model_validate({"topic": default_topic(name), **entry, "name": name})
        except ValidationError as exc:
            problems += [
                f"kinds.{name}.{'.'.join(str(p) for p in err['loc']) or '(entry)'}: {err['msg']}"
                for err in exc.errors()
            ]
    readers: dict[str, str] = {}
    for spec in kinds.values():
        if spec.topic in readers:
            problems.append(f"kinds.{spec.name}: topic {spec.topic} is also {readers[spec.topic]}'s")
        if spec.topic in set(reserved):
            problems.append(f"kinds.{spec.name}: topic {spec.topic} is where answers are written")
        readers[spec.topic] = spec.name
    if problems:
        raise ValueError(f"{where}:\n    " + "\n    ".join(problems))
    return kinds
