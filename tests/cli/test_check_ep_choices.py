"""`check` suggests only the ep values that pass every rule on ep, where it builds the model (on meta).

Oracle: `check` itself, run again with each suggested value (and with each value it leaves out)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_moe_overlap._checks import divisors
from lightning_moe_overlap.cli import check_main

ROOT = Path(__file__).resolve().parents[2]
CPU = str(ROOT / "examples" / "configs" / "cpu.yaml")
EP = "--trainer.strategy.init_args.ep"


def _check(capsys, *argv: str) -> tuple[int, str]:
    code = check_main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return code, out.out


def _suggested(out: str, phrase: str) -> list[int]:
    found = re.search(re.escape(phrase) + r" \[([0-9, ]*)\]", out)
    assert found, out
    return [int(v) for v in found.group(1).split(",") if v.strip()]


@pytest.mark.parametrize(
    "argv,phrase",
    [
        (["--trainer.devices=3"], "Valid ep values here:"),  # ep=2 on 3 processes, 8 experts: not [1, 3]
        (["--trainer.devices=3", f"{EP}=3"], "Choose ep among"),
        (["--trainer.devices=6", f"{EP}=4"], "Valid ep values here:"),  # dp*cp=6: 3 and 6 fail the 8 experts
    ],
)
def test_every_suggested_ep_passes_check_and_every_other_fails(capsys, argv, phrase):
    code, out = _check(capsys, "--config", CPU, *argv)
    assert code == 1, out
    suggested = _suggested(out, phrase)
    assert suggested, out
    world = int(argv[0].split("=")[1])
    for ep in divisors(world):
        code, again = _check(capsys, "--config", CPU, argv[0], f"{EP}={ep}")
        assert (code == 0) == (ep in suggested), f"ep={ep} suggested {suggested}:\n{again}"


def test_flex_suggestions_leave_out_the_sizes_deepep_has_no_kernels_for(capsys):
    flex = [f"{EP.rsplit('.', 1)[0]}.dispatcher=flex", "--no-machine-checks"]
    code, out = _check(capsys, "--config", CPU, "--trainer.devices=8", f"{EP}=3", *flex)
    assert code == 1, out
    suggested = _suggested(out, "Valid ep values here:")
    assert suggested == [2, 4, 8] and "DeepEP's group sizes" in out, out  # not 1: DeepEP runs on 2, 4 or 8 ranks
    for ep in suggested:
        code, again = _check(capsys, "--config", CPU, "--trainer.devices=8", f"{EP}={ep}", *flex)
        assert code == 0, again


def test_no_passing_ep_says_so(capsys):
    flex = [f"{EP.rsplit('.', 1)[0]}.dispatcher=flex", "--no-machine-checks"]
    code, out = _check(capsys, "--config", CPU, "--trainer.devices=3", *flex)
    assert code == 1 and "Valid ep values here: [] " in out and "none does: change the number of processes" in out
