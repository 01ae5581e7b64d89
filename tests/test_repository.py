"""The repository stays a product a newcomer can read: results/ holds only what the docs cite, the
package says why rather than when, and the wheel stays small."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import cachetune

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(cachetune.__file__).parent
WHEEL_BUDGET_BYTES = 12 * 2**20
# "issue 12", "Issue #4", "session 29", an ISO date: history, which belongs to git, not to a comment.
HISTORY = re.compile(r"\b(issue|session)s? #?\d+|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)


def history_in_comments(root: Path) -> list[str]:
    """Every comment or docstring line under `root` that cites an issue, a session or a date."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for tok in tokens:
            if tok.type in (tokenize.COMMENT, tokenize.STRING) and HISTORY.search(tok.string):
                if tok.type == tokenize.STRING and not tok.string.lstrip("rbuRBU").startswith(('"""', "'''")):
                    continue  # a plain string is data (a date format, a message), not a comment
                found.append(f"{path.relative_to(root)}:{tok.start[0]}: {HISTORY.search(tok.string).group(0)}")
    return found


def test_every_result_file_is_cited_and_every_cited_result_exists():
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "check_results.py")], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_no_comment_in_the_package_cites_an_issue_or_a_date():
    found = history_in_comments(PACKAGE)
    assert not found, "\n".join(found)


def test_the_history_check_finds_issue_numbers_and_dates(tmp_path):
    (tmp_path / "a.py").write_text('"""Ranks tokens (issue 12)."""\nx = 1  # measured 2026-12-05\n'
                                   'FORMAT = "2026-01-01"\n')
    assert history_in_comments(tmp_path) == ["a.py:1: issue 12", "a.py:2: 2026-12-05"]


def test_the_package_fits_the_wheel_budget():
    size = sum(p.stat().st_size for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert size < WHEEL_BUDGET_BYTES, f"the package directory holds {size / 2**20:.1f} MiB"
