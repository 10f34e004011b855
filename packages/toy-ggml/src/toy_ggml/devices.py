"""Devices ggml reports, thread defaults, and device choice.

The device is data: ``--device`` > ``TOY_DEVICE`` > ``auto``. ``auto`` picks
the first GPU ggml reports and otherwise the CPU; ``cuda`` is the first CUDA
device (``CUDA0``, from the toy-ggml-cuda plugin), an error with the plugin's
reason when there is none. Threads: ``--threads`` >
``TOY_THREADS`` > the physical cores, the last adaptive (``runtime_threads``:
fewer while other processes keep cores busy).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from toy_ggml import _core


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    description: str
    kind: str  # cpu | gpu | igpu | accel | meta
    memory_free: int  # bytes, as ggml reports (0 when unknown)
    memory_total: int
    backend: str  # the ggml backend registry that provides it


def devices() -> list[Device]:
    """Every device ggml can use in this build (the CPU is always there)."""
    return [Device(*row) for row in _core.devices_raw()]


def device_name(name: str) -> str:
    """A device name as ``Runtime`` takes it: ``"cuda"`` (any case) becomes the first CUDA device's name
    (``"CUDA0"``), and raises ValueError with the reason when there is none (the plugin is not installed,
    or found no GPU); any other name is returned as given (``Runtime`` tells an unknown one)."""
    if name.strip().lower() != "cuda":
        return name
    cuda = [d.name for d in devices() if d.backend == "CUDA"]
    if cuda:
        return cuda[0]
    from toy_ggml._dispatch import plugins

    why = "; ".join(f"{p.name}: {'loaded, ' if p.loaded else ''}{p.reason}" for p in plugins())
    raise ValueError(
        f"device {name!r}: there is no CUDA device ({why or 'no CUDA plugin'}); `toy devices` lists the devices"
    )


def resolve_device(flag: str | None = None) -> str:
    """The device to use: the flag if given, else TOY_DEVICE, else "auto" (``device_name`` of it)."""
    return device_name(flag or os.environ.get("TOY_DEVICE") or "auto")


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads counted
    once); falls back to the logical count where that cannot be told."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    try:
        cpu = None
        phys = core = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "processor":
                    cpu = int(val)
                elif key == "physical id":
                    phys = val.strip()
                elif key == "core id":
                    core = val.strip()
                elif not line.strip() and cpu is not None:
                    if cpu in allowed:
                        cores.add((phys, core) if core is not None else ("cpu", cpu))
                    cpu = phys = core = None
        if cpu is not None and cpu in allowed:
            cores.add((phys, core) if core is not None else ("cpu", cpu))
    except OSError:
        return len(allowed) or 1
    return max(1, min(len(cores), len(allowed))) if cores else max(1, len(allowed))


def default_threads() -> int:
    """TOY_THREADS if set, else the number of physical cores."""
    env = os.environ.get("TOY_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"TOY_THREADS={env!r} is not a whole number") from None
        if n < 1:
            raise ValueError(f"TOY_THREADS={n} must be >= 1")
        return n
    return physical_cores()


def runtime_threads(threads: int | None = None) -> tuple[int, bool]:
    """``(threads, adaptive)`` for a Runtime: a count given (``--threads``)
    or ``TOY_THREADS`` is used as given, every compute; otherwise the
    physical cores, of which each compute uses as many as the machine's
    load leaves room for (``Runtime(adaptive=True)``, ``toy_ggml.load``).
    Sound because no graph toy computes gives other bits with another
    thread count (inference splits rows and columns, never a sum; training
    since toy patch 0022)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads={threads} must be >= 1")
        return threads, False
    if os.environ.get("TOY_THREADS"):
        return default_threads(), False
    n = physical_cores()
    return n, n > 1
