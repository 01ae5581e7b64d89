"""Every file under results/ is cited by a document, and every results/ path a document cites exists.

Documents: docs/*.md, README.md, experiments/*/README.md, examples/*/README.md. A citation is a path
that starts with `results/` (not inside a longer path), with `{a,b}` alternatives, `<name>` or `*`
placeholders (any name within one folder), and a trailing `/` or no extension naming a folder (which
cites everything under it). results/README.md, the index, must list every kept file or a folder
above it. In README.md and examples/, a path that a usage example writes (after --json, --out,
--plots, --output_path, or ignored by git) and the bare `results/` are no citations. Exit status 1 on
any failure.

    .venv/bin/python scripts/check_results.py
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"(?<![\w./-])results/[\w./{},<>*-]*")
OUTPUT_FLAG = re.compile(r"(--json|--out|--plots|--output_path)\s+$")
INDEX = "results/README.md"


def documents() -> list[Path]:
    found = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    found += sorted((ROOT / "experiments").glob("*/README.md")) + sorted((ROOT / "examples").glob("*/README.md"))
    return [p for p in found if p.is_file()]


def expand(path: str) -> list[str]:
    """`a/{x,y}.md` -> `a/x.md`, `a/y.md` (nested and repeated braces too)."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [q for alt in match.group(1).split(",") for q in expand(path[:match.start()] + alt + path[match.end():])]


def pattern(path: str) -> str:
    """A citation as an fnmatch pattern over repository paths ("*" never crosses a folder: checked apart)."""
    return re.sub(r"<[^<>/]*>", "*", path)


def matches(pat: str, file: str) -> bool:
    return fnmatch.fnmatchcase(file, pat) and pat.count("/") == file.count("/")


def citations() -> list[tuple[Path, str]]:
    """(document, cited path): the paths a document cites as committed results."""
    out = []
    for doc in documents():
        # docs/ and experiments/ cite results; README.md and examples/ also show commands' outputs.
        strict = doc.parent == ROOT / "docs" or doc.parent.parent == ROOT / "experiments"
        for line in doc.read_text().splitlines():
            for m in CITATION.finditer(line):
                raw = m.group(0).rstrip(".,:;")
                written = bool(OUTPUT_FLAG.search(line[:m.start()]))
                for path in expand(raw):
                    # Not a citation: the whole folder, or what a usage example writes.
                    if path.rstrip("/") == "results" or (not strict and (written or ignored(path))):
                        continue
                    out.append((doc, path))
    return out


def files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "results"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return sorted(f for f in listed if (ROOT / f).is_file())


def ignored(path: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


def covers(cited: str, file: str) -> bool:
    pat = pattern(cited).rstrip("/")
    if matches(pat, file):
        return True
    # A folder (or a pattern of folders) cites everything under it.
    parts = file.split("/")
    return any(matches(pat, "/".join(parts[:i])) for i in range(1, len(parts)))


def main() -> int:
    cited = citations()
    present = files()
    failures = []
    for doc, path in cited:
        if not any(covers(path, f) for f in present):
            failures.append(f"{doc.relative_to(ROOT)} cites {path}, which does not exist")
    index = (ROOT / INDEX).read_text() if (ROOT / INDEX).is_file() else ""
    indexed = [p for p in (m.group(0).rstrip(".,:;") for m in CITATION.finditer(index)) for p in expand(p)]
    for f in present:
        if f == INDEX:
            continue
        if not any(covers(path, f) for _, path in cited):
            failures.append(f"{f} is cited by no document")
        if not any(covers(path, f) for path in indexed):
            failures.append(f"{f} is not in {INDEX}")
    for f in failures:
        print(f)
    print(f"{len(present)} files under results/, {len(cited)} citations in {len(documents())} documents: "
          f"{len(failures)} problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
