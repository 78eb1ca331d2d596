"""The Trace Event Format as its documentation gives it (Google's "Trace Event Format" document,
which Perfetto's JSON importer and chrome://tracing follow), checked event by event: what
tests/test_timeline.py holds ``rtrace timeline``'s files to.

The JSON Object Format: an object with a ``traceEvents`` array; ``displayTimeUnit`` ``"ms"`` or
``"ns"``; ``otherData`` an object. Every event has a ``ph`` (phase) and a ``pid``; by phase:

* ``X`` (complete): ``name``, ``ts`` (microseconds), ``dur`` (>= 0), ``pid``, ``tid``; optional
  ``cat`` (a string), ``args`` (an object);
* ``C`` (counter): ``name``, ``ts``, ``pid``, ``args`` an object of numbers (each a series);
* ``i`` / ``I`` (instant): ``name``, ``ts``, ``s`` (scope: ``g`` global, ``p`` process, ``t``
  thread, the default), a ``tid`` for a thread-scoped one;
* ``M`` (metadata): ``name`` one of ``process_name``, ``process_labels``, ``process_sort_index``,
  ``thread_name``, ``thread_sort_index``, ``args`` with ``name`` (a string) or ``sort_index`` (an
  int); the thread ones with a ``tid``.

Beyond the format, what viewers need to draw ``X`` slices on a thread as a flame: on one
``(pid, tid)``, two slices either nest or do not overlap (Perfetto drops an improperly nested
slice). :func:`problems` checks that too, and that every process and thread with a slice is named.
"""

from __future__ import annotations

from typing import Any

_NUMBER = (int, float)
_METADATA = {"process_name": "name", "process_labels": "labels", "process_sort_index": "sort_index",
             "thread_name": "name", "thread_sort_index": "sort_index"}


def _num(v: Any) -> bool:
    return isinstance(v, _NUMBER) and not isinstance(v, bool)


def problems(doc: Any) -> list[str]:
    """Everything in ``doc`` (a parsed file) that the format or a flame view refuses; [] when none."""
    out: list[str] = []
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["not the JSON Object Format: no traceEvents array"]
    if doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        out.append(f"displayTimeUnit {doc['displayTimeUnit']!r}")
    if not isinstance(doc.get("otherData", {}), dict):
        out.append("otherData is not an object")
    named_p, named_t, used = set(), set(), set()
    for n, ev in enumerate(doc["traceEvents"]):
        where = f"event {n} {ev!r:.120}"
        if not isinstance(ev, dict) or not isinstance(ev.get("ph"), str):
            out.append(f"{where}: no ph")
            continue
        ph = ev["ph"]
        if type(ev.get("pid")) is not int:
            out.append(f"{where}: pid is not an int")
        if not isinstance(ev.get("name"), str):
            out.append(f"{where}: name is not a string")
        if "args" in ev and not isinstance(ev["args"], dict):
            out.append(f"{where}: args is not an object")
        if ph != "M" and not _num(ev.get("ts")):
            out.append(f"{where}: ts is not a number")
        if ph == "X":
            if not _num(ev.get("dur")) or ev["dur"] < 0:
                out.append(f"{where}: dur is not a number >= 0")
            if type(ev.get("tid")) is not int:
                out.append(f"{where}: tid is not an int")
            if "cat" in ev and not isinstance(ev["cat"], str):
                out.append(f"{where}: cat is not a string")
            used.add((ev.get("pid"), ev.get("tid")))
        elif ph == "C":
            args = ev.get("args")
            if not isinstance(args, dict) or not args or not all(_num(v) for v in args.values()):
                out.append(f"{where}: a counter's args are not an object of numbers")
        elif ph in ("i", "I"):
            scope = ev.get("s", "t")
            if scope not in ("g", "p", "t"):
                out.append(f"{where}: s is not g, p or t")
            if scope == "t" and type(ev.get("tid")) is not int:
                out.append(f"{where}: a thread-scoped instant without a tid")
        elif ph == "M":
            key = _METADATA.get(ev.get("name"))
            args = ev.get("args")
            if key is None or not isinstance(args, dict) or key not in args:
                out.append(f"{where}: not a metadata event of the format")
                continue
            if key == "name" and not isinstance(args["name"], str):
                out.append(f"{where}: a name that is not a string")
            if key == "sort_index" and type(args["sort_index"]) is not int:
                out.append(f"{where}: a sort_index that is not an int")
            if ev["name"].startswith("thread_") and type(ev.get("tid")) is not int:
                out.append(f"{where}: thread metadata without a tid")
            if ev["name"] == "process_name":
                named_p.add(ev["pid"])
            elif ev["name"] == "thread_name":
                named_t.add((ev["pid"], ev.get("tid")))
        else:
            out.append(f"{where}: a phase rtrace does not write")
    for pid, tid in sorted(used):
        if pid not in named_p:
            out.append(f"process {pid} has slices and no process_name")
        if (pid, tid) not in named_t:
            out.append(f"thread {pid}/{tid} has slices and no thread_name")
    out += nesting_problems(doc)
    return out


def slices(doc: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """The ``X`` events of each ``(pid, tid)``, by start (then the longer first)."""
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for ev in doc["traceEvents"]:
        if ev.get("ph") == "X":
            out.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for evs in out.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    return out


def nesting_problems(doc: dict[str, Any], tol: float = 1e-3) -> list[str]:
    """Slices of one thread that overlap without nesting (``tol``: microseconds of float rounding)."""
    out = []
    for key, evs in slices(doc).items():
        open_ends: list[float] = []
        for ev in evs:
            start, end = ev["ts"], ev["ts"] + ev["dur"]
            while open_ends and open_ends[-1] <= start + tol:
                open_ends.pop()
            if open_ends and end > open_ends[-1] + tol:
                out.append(f"thread {key}: {ev['name']} [{start}, {end}] overlaps the slice it starts in "
                           f"without nesting (that one ends at {open_ends[-1]})")
            open_ends.append(end)
    return out
