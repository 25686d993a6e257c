"""Every ```python block of the README and docs/ runs (unless marked `<!-- fragment ... -->` just before it; one
marked `<!-- long ... -->` runs with the `long` tests), and the README's first command, the main job, runs as pasted
(after its install step)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, code, long)`` of each runnable block."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            before = lines[i - 1] if i > 0 else ""
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            if not before.startswith("<!-- fragment"):
                blocks.append((i + 1, "\n".join(lines[i + 1 : end]), before.startswith("<!-- long")))
            i = end
        i += 1
    return blocks


RUNNABLE = [
    pytest.param(p, line, code, id=f"{p.name}:{line}", marks=[pytest.mark.long] if long else [])
    for p in DOCS
    for line, code, long in _python_blocks(p)
]


@pytest.mark.parametrize("path,line,code", RUNNABLE)
def test_docs_python_block_runs(path, line, code, tmp_path):
    script = tmp_path / "block.py"  # a file, so Lightning can re-run it for the other ranks
    script.write_text(f"import torch\ntorch.set_num_threads(1)\n{code}\n")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{path.name}:{line}\n{out.stderr[-3000:]}"


def test_readme_main_job_runs_as_pasted():
    readme = (ROOT / "README.md").read_text()
    first = readme.split("```bash", 1)[1].split("```", 1)[0].strip()
    install, _, command = first.rpartition(" && ")
    assert install.startswith("pip install") and command.startswith("python ")
    out = subprocess.run(command.split(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "final train_loss=" in out.stdout
    ours = [line for line in out.stderr.splitlines() if "lightning_moe_overlap" in line or "MoEOverlapStrategy" in line]
    assert ours == [], ours  # no warning of this package's on the first command
