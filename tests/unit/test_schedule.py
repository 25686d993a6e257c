"""The micro-batch schedule: phases for M micro-batches, with and without overlap."""

import pytest

from lightning_moe_overlap.overlap.schedule import PAIR_STARTER, Role, build_schedule


def names(num_microbatches: int, overlap: bool) -> list[str]:
    return [phase.name for phase in build_schedule(num_microbatches, overlap=overlap)]


@pytest.mark.parametrize(
    ("m", "expected"),
    [
        (1, ["F0", "B0"]),
        (2, ["F0", "F1|B0", "B1"]),
        (3, ["F0", "F1|B0", "F2|B1", "B2"]),
        (5, ["F0", "F1|B0", "F2|B1", "F3|B2", "F4|B3", "B4"]),
    ],
)
def test_overlapped_phases(m: int, expected: list[str]) -> None:
    assert names(m, overlap=True) == expected


@pytest.mark.parametrize(
    ("m", "expected"),
    [
        (1, ["F0", "B0"]),
        (2, ["F0", "B0", "F1", "B1"]),
        (3, ["F0", "B0", "F1", "B1", "F2", "B2"]),
        (5, ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4"]),
    ],
)
def test_sequential_phases(m: int, expected: list[str]) -> None:
    assert names(m, overlap=False) == expected


@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize("overlap", [True, False])
def test_every_task_once_forward_before_backward_backwards_in_order(m: int, overlap: bool) -> None:
    tasks = [task for phase in build_schedule(m, overlap=overlap) for task in phase.tasks]
    assert sorted(task.name for task in tasks) == sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
    position = {task.name: k for k, task in enumerate(tasks)}
    assert all(position[f"F{i}"] < position[f"B{i}"] for i in range(m))
    backwards = [task.microbatch for task in tasks if task.role is Role.BACKWARD]
    assert backwards == list(range(m))


def test_pairs_start_with_the_backward_single_phases_with_their_task() -> None:
    phases = build_schedule(3, overlap=True)
    assert PAIR_STARTER is Role.BACKWARD
    assert [phase.starter for phase in phases] == [Role.FORWARD, Role.BACKWARD, Role.BACKWARD, Role.BACKWARD]
    assert phases[1].roles == (Role.FORWARD, Role.BACKWARD)


@pytest.mark.parametrize("bad", [0, -2])
def test_rejects_fewer_than_one_microbatch(bad: int) -> None:
    with pytest.raises(ValueError, match="`num_microbatches` must be >= 1"):
        build_schedule(bad, overlap=True)


@pytest.mark.parametrize("bad", [2.0, True, "2"])
def test_rejects_non_int_microbatches(bad: object) -> None:
    with pytest.raises(TypeError, match="`num_microbatches` must be an int"):
        build_schedule(bad, overlap=False)  # type: ignore[arg-type]
