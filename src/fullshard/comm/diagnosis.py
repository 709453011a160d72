"""The watchdog's sentences: this rank's heartbeat, and what the other ranks' heartbeats say about
a collective that timed out or failed in the backend."""

from __future__ import annotations

import functools
import itertools
import os
import re
import socket
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from fullshard.comm import peers
from fullshard.comm.flight_recorder import RECORDER, Entry

_RECENT = 64  # entries a heartbeat carries, to find where two ranks' collectives stopped matching


# Where library code lives: frames there are not the user's (the stack names the user's line).
_TORCH = str(Path(torch.__file__).resolve().parent) + os.sep
_FULLSHARD = str(Path(__file__).resolve().parents[1]) + os.sep
_STDLIB = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep
_SITE = tuple(str(Path(sysconfig.get_paths()[k]).resolve()) + os.sep for k in ("purelib", "platlib"))
_TORCH_DISTRIBUTED = _TORCH + "distributed" + os.sep
# Functions of torch.distributed that issue or wait for a collective (c10d, functional collectives).
_COLLECTIVE_NAME = re.compile(r"(all_|reduce|broadcast|barrier|wait|gather|scatter|send|recv|redistribute)")
_SHOWN = 4  # user frames shown
_WRAPPERS = {"wrapper", "inner", "decorate_context", "wrapped"}  # decorators' frames: not the function called


def stack() -> str:
    """Where the main thread is, for a rank in no fullshard collective: ``not in a collective, at
    <stack>``, the stack being its innermost frames outside torch, fullshard and the standard
    library (the user's code), ``file:line func`` joined by " < "; then the library function the
    innermost of them called, and, when the stack is inside torch.distributed, the collective it
    is in (``not in a fullshard collective``: one of torch's own may be what waits)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return "not in a collective, at an unknown place"
    return describe_stack(traceback.extract_stack(frame))


def describe_stack(frames: list[traceback.FrameSummary]) -> str:
    """:func:`stack`'s sentence for ``frames`` (outermost first)."""
    paths = [_resolved(f.filename) for f in frames]
    user = [i for i, p in enumerate(paths) if not _is_library(p)]
    shown = [frames[i] for i in user[-_SHOWN:]] or frames[-_SHOWN:]
    text = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(shown))
    inner = user[-1] + 1 if user else 0
    library = [i for i in range(inner, len(frames)) if paths[i].startswith((_TORCH, _FULLSHARD))]
    public = [i for i in library if not frames[i].name.startswith("_") and frames[i].name not in _WRAPPERS]
    called = (public or library or [-1])[0]
    if user and called >= 0:
        text += f", in {_qualified(paths[called], frames[called].name)}"
    in_dist = [i for i in library if paths[i].startswith(_TORCH_DISTRIBUTED)]
    if not in_dist:
        return f"not in a collective, at {text}"
    named = [i for i in in_dist if _COLLECTIVE_NAME.match(frames[i].name.lstrip("_"))]
    i = (named or in_dist)[-1]
    if i != called:
        text += f" (inside {_qualified(paths[i], frames[i].name)})"
    return f"not in a fullshard collective, at {text}"


@functools.lru_cache(maxsize=4096)
def _resolved(filename: str) -> str:
    return filename if filename.startswith("<") else str(Path(filename).resolve())


def _is_library(path: str) -> bool:
    """Whether ``path`` is torch's, fullshard's or the standard library's (not what a user wrote)."""
    if path.startswith((_TORCH, _FULLSHARD)):
        return True
    return path.startswith(_STDLIB) and not path.startswith(_SITE)


def _qualified(path: str, name: str) -> str:
    """``torch.nn.utils.clip_grad.clip_grad_norm_`` for function ``name`` of the file at ``path``."""
    for root in (_TORCH, _FULLSHARD):
        if path.startswith(root):
            module = Path(path[len(root) :]).with_suffix("").parts
            package = Path(root).name
            parts = [package, *module] if module[-1:] != ("__init__",) else [package, *module[:-1]]
            return ".".join([*parts, name])
    return name


def heartbeat(final: bool = False) -> dict[str, Any]:
    """This rank's heartbeat: wall time, host and pid, last issued sequence number per group, the
    collective it waits in, its last completed one, its main thread's stack when in none, and its
    recent collectives; ``final`` when its watchdog stops (the process exits or leaves the group)."""
    pending, done = RECORDER.oldest_pending(), RECORDER.last_completed
    return {
        "t": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "final": final,
        "seq": dict(RECORDER.seq),
        "pending": pending.describe() if pending else None,
        "completed": done.describe() if done else None,
        "stack": None if pending or final else stack(),
        "recent": [[e.group, e.seq, e.op, e.unit, e.phase] for e in _recent(_RECENT)],
    }


def _recent(n: int) -> list[Entry]:
    """The newest ``n`` entries, oldest first (one C-level copy: safe against the main thread)."""
    return list(itertools.islice(reversed(RECORDER.entries), n))[::-1]


def where(rank: int) -> str:
    """``rank 1 waits in <collective>`` or ``rank 1 is not in a collective, at <stack>`` (:func:`stack`)."""
    pending = RECORDER.oldest_pending()
    return f"rank {rank} " + (f"waits in {pending.describe()}" if pending else f"is {stack()}")


def timed_out(channel: peers.Channel, e: Entry, timeout: float, stale: float) -> str:
    """The line for an entry that waited longer than ``timeout`` s: where this rank waits, which
    ranks of the group have not joined and where each is, and where their collectives stopped
    matching this rank's (``stale``: seconds of silence after which a rank counts as exited)."""
    me = channel.rank
    head = f"rank {me} waited {time.time() - e.issued_at:.0f} s (timeout {timeout:g} s) in {e.describe()}"
    others = [r for r in (int(x) for x in e.group.split(",")) if r != me]
    missing = [m for r in others if (m := _not_joined(channel, r, e, stale))]
    diverged = [d for r in others if (d := _divergence(channel, r))]
    if missing:
        return f"{head}; not joined: " + "; ".join(missing + diverged)
    if diverged:  # every rank issued #N, but not the same collective: the pairing is wrong, not the backend
        return f"{head}; " + "; ".join(diverged)
    return f"{head}; every rank of the group has joined it: the backend itself is stuck"


def _not_joined(channel: peers.Channel, rank: int, e: Entry, stale: float) -> str | None:
    """Where ``rank`` is, if it has not issued ``e``."""
    hb = channel.heartbeat(rank)
    if hb is None:
        return f"rank {rank} never reported (not started, or the store is unreachable)"
    if hb.get("final") or time.time() - hb["t"] > stale:
        return f"rank {rank} exited ({peers.last_completed(hb)})"
    if hb["seq"].get(e.group, 0) >= e.seq:
        return None
    if hb["pending"]:
        return f"rank {rank} waits in {hb['pending']}"
    return f"rank {rank} is alive, {hb['stack']} (last completed: {hb['completed']})"


def _divergence(channel: peers.Channel, rank: int) -> str | None:
    """Where ``rank``'s recent collectives first differ from this rank's (same group and
    sequence number, another op or unit): the two were paired wrongly from there on."""
    hb = channel.heartbeat(rank)
    if hb is None:
        return None
    mine = {(e.group, e.seq): (e.op, e.unit, e.phase) for e in _recent(4 * _RECENT)}
    for group, seq, op, unit, phase in hb.get("recent", []):
        here = mine.get((group, seq))
        if here is not None and here[:2] != (op, unit):
            return (
                f"ranks diverged at #{seq} of group [{group}]: rank {rank} issued {op} for unit {unit!r} "
                f"({phase}) where rank {channel.rank} issued {here[0]} for unit {here[1]!r} ({here[2]}): "
                "rank-dependent control flow around an FSDP unit?"
            )
    return None


def failed(channel: peers.Channel | None, rank: int, entry: Entry, error: BaseException) -> str:
    """The message for a collective the backend failed (a peer's connection closed): which
    collective, and which ranks of its group have exited, with their last completed collective."""
    text = f"rank {rank}: {entry.describe()} failed ({str(error).splitlines()[0][:160]})"
    if channel is None:
        return text
    others = [int(x) for x in entry.group.split(",") if int(x) != rank]
    # A killed peer's sockets close before its process is a zombie: look again for up to 2 s.
    deadline = time.monotonic() + 2.0
    while not (gone := _gone(channel, others)) and time.monotonic() < deadline:
        if peers.STOPPED.wait(0.05):
            break
    return text + ("; " + "; ".join(gone) if gone else "")


def _gone(channel: peers.Channel, ranks: list[int]) -> list[str]:
    """A phrase for each of ``ranks`` whose process has exited, by its heartbeat."""
    gone = []
    for r in ranks:
        hb = channel.heartbeat(r)
        if hb is not None and peers.exited(hb):
            gone.append(f"rank {r} exited ({peers.last_completed(hb)})")
    return gone
