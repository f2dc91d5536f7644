"""A predicted step as a trace (new in 0.6): the walk's spans (`predict.Span`) as
Chrome trace-event JSON, the format `jax.profiler`'s traces, Perfetto,
chrome://tracing and TensorBoard's trace viewer read.

One process, the predicted step; a thread for each of its streams that ran
something: ``compute`` (each kernel, and the compute waiting for a collective or
a copy), ``collectives`` and ``copies`` (the DMA engines' async copies; new in
0.8). Each span
is a complete event (``"ph": "X"``) named as the compiled module names the
instruction, its class as the category and what the module says of it as its
args, its start and length in microseconds on a grid of whole nanoseconds. On
that grid a span that starts where another ends starts there exactly as a
reader rounds it: Perfetto drops a complete event that overlaps the one before
it on its thread by a nanosecond. The format:
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from spmdtree._src.step.time.predict import Span

#: The tracks, as Chrome trace-event threads of one process, in display order
#: (neither thread's id the process's: Perfetto calls that one the main thread).
STREAMS = {"compute": 2, "collectives": 3, "copies": 4}
_PID = 1
_NS_PER_S = 10**9
_NS_PER_US = 1000


def trace_events(
    spans: Sequence[Span],
    title: str,
    other: Mapping[str, Any] | None = None,
    streams: Mapping[str, int] = STREAMS,
) -> dict[str, Any]:
    """Chrome trace-event JSON of `spans`: a process named `title`, a thread per
    stream that holds a span (`streams`: each stream's thread id, in display order;
    new in 0.7), a complete event per span; `other` goes to ``otherData``.

    Example:
        >>> span = Span("compute", "fusion.1", 0.0, 2e-6, "memory", {"bytes": 64})
        >>> trace = trace_events([span], "a step")
        >>> [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
        ['fusion.1']
        >>> event = trace["traceEvents"][-1]
        >>> event["ts"], event["dur"], event["tid"], event["cat"], event["args"]["class"]
        (0.0, 2.0, 2, 'memory', 'memory')
    """
    meta: list[dict[str, Any]] = [_meta("process_name", 0, name=title)]
    held = {span.stream for span in spans}
    for order, (stream, tid) in enumerate(streams.items()):
        if stream not in held:  # a stream nothing ran on (a GPU's copies): no track
            continue
        meta += [
            _meta("thread_name", tid, name=stream),
            _meta("thread_sort_index", tid, sort_index=order),
        ]
    ordered = sorted(spans, key=lambda s: (streams[s.stream], s.start))
    events = [_event(span, streams[span.stream]) for span in ordered]
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ns",
        "otherData": dict(other or {}),
    }


def _meta(what: str, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": what, "ph": "M", "pid": _PID, "tid": tid, "args": args}


def _event(span: Span, tid: int) -> dict[str, Any]:
    start, end = _nanoseconds(span.start), _nanoseconds(span.start + span.seconds)
    return {
        "name": span.name,
        "cat": str(span.kind),
        "ph": "X",
        "pid": _PID,
        "tid": tid,
        "ts": start / _NS_PER_US,
        "dur": (end - start) / _NS_PER_US,
        "args": {"class": str(span.kind), **span.args},
    }


def _nanoseconds(seconds: float) -> int:
    """`seconds` on the trace's grid: whole nanoseconds."""
    return round(seconds * _NS_PER_S)
