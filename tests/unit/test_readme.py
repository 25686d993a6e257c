"""The README's test command is the one CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bash_blocks(text: str) -> list[str]:
    blocks, inside, current = [], False, []
    for line in text.splitlines():
        if line.strip() == "```bash":
            inside, current = True, []
        elif line.strip() == "```" and inside:
            inside = False
            blocks.append("\n".join(current).strip())
        elif inside:
            current.append(line)
    return blocks


def test_readme_opens_with_main_job_then_test_command_that_ci_runs():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 2
    main_job, tests = blocks[0], blocks[1]
    assert "examples/" in main_job or "lightning-moe-overlap" in main_job
    assert "pytest" in tests
    ci_lines = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines, "the README's test command must appear verbatim in .ci/run"
