"""The documents a newcomer reads first: BENCHMARKS.md opens with the headline and stays one
screen of tables long, every raw result kept under benchmarks/results is cited by a page, and the
pages' links resolve inside the repository."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def documents() -> list[Path]:
    """The repository's markdown pages, the raw results' own tables excepted."""
    skip = {".venv", "results", ".git", "node_modules"}
    return [p for p in ROOT.rglob("*.md") if not skip.intersection(p.relative_to(ROOT).parts)]


def _expand(token: str) -> list[str]:
    """Shell-style braces, as the record writes groups of runs: a_{before,after}_{1..5}.json."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    body = m.group(1)
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    alts = [str(i) for i in range(int(span[1]), int(span[2]) + 1)] if span else body.split(",")
    return [x for a in alts for x in _expand(token[:m.start()] + a + token[m.end():])]


def cited_patterns(text: str) -> set[str]:
    """File names and globs a page names: `x.json`, `x_{a,b}.json`, `tpu_v5e_*`, `*_final*.json`,
    and "x.txt and .json"."""
    out = set()
    for token in re.findall(r"[A-Za-z0-9_.{},*\-]+", text):
        for x in _expand(token):
            x = x.strip(".,")
            if re.search(r"[A-Za-z0-9]\.[A-Za-z]{2,5}$", x) or (
                    "*" in x and "**" not in x and re.search(r"[A-Za-z0-9_]{3,}", x)):
                out.add(x)
    for stem, ext in re.findall(r"([A-Za-z0-9_.\-]+)\.\w+ and (\.\w+)", text):
        out.add(stem + ext)
    return out


def test_every_result_is_cited_by_a_document():
    patterns = set().union(*(cited_patterns(p.read_text()) for p in documents()))
    uncited = [f.name for f in sorted(RESULTS.iterdir())
               if not any(fnmatch.fnmatchcase(f.name, pat) for pat in patterns)]
    assert not uncited, f"benchmarks/results files no page cites (cite them or git rm them): {uncited}"


def test_benchmarks_opens_with_the_headline():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text) < 40_000, "BENCHMARKS.md is the front door: the record goes in benchmarks/log/"
    first = "\n".join(text.splitlines()[:60])
    assert "vLLM" in first and "sglang-jax" in first


def test_the_record_is_indexed():
    """Every page of the dated record is linked from BENCHMARKS.md."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    missing = [p.name for p in sorted((ROOT / "benchmarks" / "log").glob("*.md"))
               if f"benchmarks/log/{p.name}" not in text]
    assert not missing


def test_links_resolve_inside_the_repository():
    """Every relative markdown link of every page names a file of the repository (anchors aside),
    and nothing points outside it (a clone has no ../shared)."""
    broken = []
    for page in documents():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists() or ROOT not in path.parents:
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken


def test_nothing_cites_files_outside_the_repository():
    hits = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if p.suffix in {".py", ".md", ".toml", ".cc", ".h"} and ".venv" not in p.parts
            and p != Path(__file__) and "../shared" in p.read_text(errors="replace")]
    assert not hits
