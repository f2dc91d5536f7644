"""A device profile, read (new in 0.7): what `jax.profiler` recorded of a step, per
instruction of the compiled module, for `StepPlan.compare` and `st.measure`.

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes a Chrome
trace-event file (``perfetto_trace.json.gz``). On an accelerator each device is
a process (``/device:TPU:0``) whose ``XLA Ops`` thread holds one event per
instruction run, named as the compiled module names it, and whose ``XLA
Modules`` thread holds one event per step of each module (``jit_step(12)``).
XLA's CPU runtime writes its instructions on the host's threads instead, each
event's args naming its ``hlo_op``, ``hlo_module``, ``device_ordinal`` and
``run_id`` (where the executable was compiled with
``xla_cpu_enable_xprof_traceme``); a run of one device is a step there. The
first device's events are read: every device runs the same program.

An event's time is its self time: what its thread spent in it, less the events
nested inside it on the same thread (a loop's own event holds its body's).
"""

from __future__ import annotations

import bisect
import dataclasses
import gzip
import json
import os
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from spmdtree._src.errors import Mistake

#: The threads of a device's process that `jax.profiler` writes on accelerators.
OPS_THREAD, MODULES_THREAD = "XLA Ops", "XLA Modules"
_US = 1e6  # a trace's times are in microseconds
_PROGRAM_ID = re.compile(r"\(\d+\)$")
_DEVICE = re.compile(r"^/device:[A-Z]+:(\d+)")


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One instruction run on the device: its name in the compiled module, its start
    from its step's start and its self time, in seconds."""

    name: str
    start: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class Profile:
    """What a profile says of one module's steps on one device (new in 0.7).

    Attributes:
        module: the compiled module's name (``jit_step``).
        device: the device read (``/device:TPU:0``, ``cpu:0``).
        steps: each step's seconds on the device, in the order run.
        ops: each instruction's self time per step, by its name, averaged over
            the steps (a read-only mapping).
        calls: how often each ran per step (averaged likewise).
        first: the first step's instruction events, for a trace.
    """

    module: str
    device: str
    steps: tuple[float, ...]
    ops: Mapping[str, float]
    calls: Mapping[str, float]
    first: tuple[OpEvent, ...] = dataclasses.field(repr=False)

    @property
    def op_seconds(self) -> float:
        """The instructions' self time per step, all of them."""
        return sum(self.ops.values())


def read_profile(source: object, module: str | None = None) -> Profile:
    """The `Profile` of `module`'s steps (None: the module whose steps took the most
    device time) in `source`: a trace-event file (``.json`` or ``.json.gz``), a
    folder `jax.profiler.trace` wrote (its newest ``perfetto_trace.json.gz``), or
    the parsed JSON itself.

    Example:
        >>> events = [
        ...     {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:TPU:0"}},
        ...     {"ph": "M", "name": "thread_name", "pid": 3, "tid": 1, "args": {"name": "XLA Modules"}},
        ...     {"ph": "M", "name": "thread_name", "pid": 3, "tid": 2, "args": {"name": "XLA Ops"}},
        ...     {"ph": "X", "pid": 3, "tid": 1, "name": "jit_step(7)", "ts": 0, "dur": 10},
        ...     {"ph": "X", "pid": 3, "tid": 2, "name": "while.1", "ts": 1, "dur": 8},
        ...     {"ph": "X", "pid": 3, "tid": 2, "name": "fusion.2", "ts": 2, "dur": 5},
        ... ]
        >>> profile = read_profile({"traceEvents": events})
        >>> profile.module, profile.steps, dict(profile.ops)  # the loop's own time, less its body
        ('jit_step', (1e-05,), {'while.1': 3e-06, 'fusion.2': 5e-06})
    """
    events = _events(source)
    found = _device_tracks(events) or _cpu_tracks(events)
    if found is None:
        raise Mistake(
            ValueError,
            "the profile holds no device's instructions: neither an 'XLA Ops' track of a "
            "device nor XLA CPU events naming their hlo_op. Pass the trace "
            "jax.profiler.trace(dir, create_perfetto_trace=True) wrote while the step ran "
            "(its perfetto_trace.json.gz), or its folder.",
        )
    device, ops, steps = found
    return _profile(device, ops, steps, module)


def _events(source: object) -> list[dict[str, Any]]:
    """The trace's events, from a dict, a list, a file or a profiler's folder."""
    data: object = source
    if isinstance(source, (str, os.PathLike)):
        try:
            data = json.loads(_text(pathlib.Path(source)))
        except json.JSONDecodeError as e:
            raise Mistake(
                ValueError,
                f"{_said(source)} is no trace: it is not JSON ({e}); pass the .json or .json.gz "
                "jax.profiler.trace(dir, create_perfetto_trace=True) wrote.",
            ) from None
    if isinstance(data, Mapping):
        data = data.get("traceEvents")
    if not isinstance(data, list) or not all(_event(e) for e in data):
        raise Mistake(
            ValueError,
            f"{_said(source)} is no trace: expected Chrome trace-event JSON (an object with "
            "'traceEvents', or a list of events), as jax.profiler.trace(dir, "
            "create_perfetto_trace=True) writes.",
        )
    return data


def _event(e: object) -> bool:
    """Whether `e` is a trace event as read here: a mapping whose complete events
    (``"ph": "X"``) have a number ``ts`` and a mapping of ``args`` where any."""
    if not isinstance(e, Mapping):
        return False
    if e.get("ph") != "X":
        return True
    return isinstance(e.get("ts"), (int, float)) and isinstance(e.get("args", {}), Mapping)


def _said(source: object) -> str:
    return repr(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else "the profile"


def _text(path: pathlib.Path) -> str:
    """A trace file's text (gzipped or not); a folder's newest Perfetto trace."""
    if path.is_dir():
        found = sorted(path.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise Mistake(
                ValueError,
                f"{str(path)!r} holds no perfetto_trace.json.gz; profile with "
                "jax.profiler.trace(dir, create_perfetto_trace=True).",
            )
        path = found[-1]
    try:
        raw = path.read_bytes()
        return (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise Mistake(
            ValueError,
            f"cannot read {str(path)!r} as a trace ({e}); pass the .json or .json.gz "
            "jax.profiler wrote.",
        ) from None


_Span = tuple[str, float, float, Any]  # name, start, end (microseconds, as written), the thread


def _device_tracks(
    events: list[dict[str, Any]],
) -> tuple[str, list[_Span], list[_Span]] | None:
    """The first device's ops and module steps, where the profile has device tracks."""
    processes = {
        e.get("pid"): e["args"].get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "args" in e
    }
    threads = {
        (e.get("pid"), e.get("tid")): e["args"].get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and "args" in e
    }
    with_ops = {p for (p, _), name in threads.items() if name == OPS_THREAD}
    devices = sorted(
        (int(m.group(1)), pid)
        for pid, name in processes.items()
        if (m := _DEVICE.match(str(name))) and pid in with_ops
    )
    if not devices:
        return None
    pid = devices[0][1]
    on = {n: tid for (p, tid), n in threads.items() if p == pid}
    ops = [_span(e, e["name"]) for e in events if _on(e, pid, on.get(OPS_THREAD))]
    steps = [_span(e, e["name"]) for e in events if _on(e, pid, on.get(MODULES_THREAD))]
    return processes[pid], ops, steps


def _on(event: Mapping[str, Any], pid: Any, tid: Any) -> bool:
    return event.get("ph") == "X" and event.get("pid") == pid and event.get("tid") == tid


def _span(event: Mapping[str, Any], name: str) -> _Span:
    start = float(event["ts"])
    return name, start, start + float(event.get("dur", 0.0)), event.get("tid")


def _cpu_tracks(
    events: list[dict[str, Any]],
) -> tuple[str, list[_Span], list[_Span]] | None:
    """XLA CPU's ops of its first device, and its runs of each module as steps."""
    ran = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    if not ran:
        return None
    first = min(str(e["args"].get("device_ordinal", "0")) for e in ran)
    mine = [e for e in ran if str(e["args"].get("device_ordinal", "0")) == first]
    ops = [_span(e, str(e["args"]["hlo_op"])) for e in mine]
    runs: dict[tuple[str, str], list[float]] = {}
    for e, (_, start, end, _tid) in zip(mine, ops, strict=True):
        key = (str(e["args"].get("hlo_module", "")), str(e["args"].get("run_id", "")))
        window = runs.setdefault(key, [start, end])
        window[0], window[1] = min(window[0], start), max(window[1], end)
    steps = [(module, start, end, None) for (module, _), (start, end) in runs.items()]
    return f"cpu:{first}", ops, steps


def _profile(device: str, ops: list[_Span], steps: list[_Span], module: str | None) -> Profile:
    """The profile of `module`'s steps: each op's self time within them, per step."""
    by_module: dict[str, list[_Span]] = {}
    for step in steps:
        by_module.setdefault(_PROGRAM_ID.sub("", step[0]), []).append(step)
    if module is None and by_module:
        module = max(by_module, key=lambda m: sum(end - start for _, start, end, _ in by_module[m]))
    windows = sorted(by_module.get(module or "", []), key=lambda s: s[1])
    if not windows:
        known = ", ".join(map(repr, by_module)) or "none"
        raise Mistake(
            ValueError,
            f"the profile holds no step of module {module!r} on its first device (its "
            f"modules: {known}); profile while the step runs, or name its module.",
        )
    selfs = _self_times(ops)
    totals: dict[str, float] = {}
    calls: dict[str, float] = {}
    first: list[OpEvent] = []
    starts = [w[1] for w in windows]
    for (name, start, _end, _tid), seconds in zip(ops, selfs, strict=True):
        index = _window(windows, starts, start)
        if index is None:
            continue
        totals[name] = totals.get(name, 0.0) + seconds
        calls[name] = calls.get(name, 0.0) + 1
        if index == 0:
            first.append(OpEvent(name, (start - windows[0][1]) / _US, seconds / _US))
    count = len(windows)
    return Profile(
        module=module or "",
        device=device,
        steps=tuple((end - start) / _US for _, start, end, _ in windows),
        ops={name: seconds / count / _US for name, seconds in totals.items()},
        calls={name: n / count for name, n in calls.items()},
        first=tuple(sorted(first, key=lambda e: e.start)),
    )


def _window(windows: Sequence[_Span], starts: Sequence[float], at: float) -> int | None:
    """The index of the step whose window holds time `at`, or None."""
    i = bisect.bisect_right(starts, at) - 1
    return i if i >= 0 and at <= windows[i][2] else None


def _self_times(spans: Iterable[_Span]) -> list[float]:
    """Each span's length less the spans nested inside it on its own thread."""
    spans = list(spans)
    selfs = [end - start for _, start, end, _ in spans]
    order = sorted(range(len(spans)), key=lambda i: (str(spans[i][3]), spans[i][1], -spans[i][2]))
    stack: list[int] = []
    for i in order:
        _, start, end, tid = spans[i]
        while stack and (spans[stack[-1]][3] != tid or spans[stack[-1]][2] <= start):
            stack.pop()
        _, outer_start, outer_end, _ = spans[stack[-1]] if stack else (None, 0.0, 0.0, None)
        # nested: inside the span before it on its thread, not the same span twice
        if stack and end <= outer_end and (start, end) != (outer_start, outer_end):
            selfs[stack[-1]] -= end - start
        stack.append(i)
    return selfs
