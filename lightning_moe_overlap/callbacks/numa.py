"""Bind the process to the CPUs of the NUMA node its GPU hangs off (LoongForge's ``--bindpcie``).

Host-side buffers of the activation offload are then allocated and copied by CPUs on the GPU's PCIe root, which
raises device-to-host / host-to-device bandwidth. Linux only: the GPU's PCI address comes from
``torch.cuda.get_device_properties``, its node from ``/sys/bus/pci/devices/<address>/numa_node``, the node's CPUs
from ``/sys/devices/system/node/node<N>/cpulist``; every thread of the process gets that affinity (threads
started later inherit it). Where any of this is unavailable the binding is skipped with a warning.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> ``{0, 1, 2, 3, 8, 10, 11}`` (the sysfs ``cpulist`` format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def pci_address(device: torch.device) -> str | None:
    """The GPU's PCI address as sysfs spells it (``0000:1b:00.0``), or None when torch does not report it."""
    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    domain, dev = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def numa_cpus(address: str, sysfs: str | os.PathLike[str] = "/sys") -> set[int] | None:
    """The CPUs of the NUMA node of the PCI device at ``address``; None when the platform does not say."""
    root = Path(sysfs)
    try:
        node = int((root / "bus/pci/devices" / address / "numa_node").read_text().strip())
        if node < 0:  # single-node machines report -1
            return None
        return parse_cpulist((root / f"devices/system/node/node{node}/cpulist").read_text()) or None
    except (OSError, ValueError):
        return None


def bind_to_device_numa_node(device: torch.device, sysfs: str | os.PathLike[str] = "/sys") -> set[int] | None:
    """Restrict every thread of this process to the CPUs of ``device``'s NUMA node.

    Returns:
        The CPUs bound to, or None when the binding was skipped (a warning says why).
    """
    reason = None
    cpus = None
    if device.type != "cuda":
        reason = f"the device is {device.type!r}, not a GPU"
    elif not hasattr(os, "sched_setaffinity"):
        reason = "this platform has no `os.sched_setaffinity`"
    else:
        address = pci_address(device)
        cpus = numa_cpus(address, sysfs) if address else None
        if cpus is None:
            reason = f"the NUMA node of GPU {address or device} is not known from {sysfs}"
        else:
            cpus &= os.sched_getaffinity(0) or cpus
            if not cpus:
                reason = "none of that node's CPUs is allowed to this process"
    if reason is not None:
        warnings.warn(f"`ActivationOffload(numa_bind=True)`: binding skipped: {reason}.", UserWarning, stacklevel=3)
        return None
    _set_affinity_all_threads(cpus)
    return cpus


def _set_affinity_all_threads(cpus: set[int]) -> None:
    tasks = Path("/proc/self/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that just ended
            continue
