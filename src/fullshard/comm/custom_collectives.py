"""Collectives through a user's comm object: torch FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter`` (the engine's side is :mod:`fullshard.engine.custom_comm`).

The comm is called with torch's keywords and returns None (done) or a Work. Each call is
counted in the probes, recorded in the flight recorder and checked by the watchdog as
:mod:`.collectives` does its own, with the bytes of the payload the comm was given: fullshard
cannot see what a comm really sends (compressed, or through another channel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fullshard.comm import collectives, exposed_comm
from fullshard.comm.handle import Handle, explained


def _custom_work(work: Any, comm: Any, setter: str) -> Any:
    """The Work a custom comm returned (None: it finished before returning), checked."""
    if work is not None and not callable(getattr(work, "wait", None)):
        raise TypeError(
            f"{setter}: the comm {type(comm).__name__} returned a {type(work).__name__}; it must return "
            "None (done) or a torch.distributed Work (something with wait())"
        )
    return work


@exposed_comm.blocking("all_gather", collectives._unit)
@explained
def all_gather(
    comm: Any, output: torch.Tensor, input: torch.Tensor, group: collectives.ProcessGroup, async_op: bool = False
) -> Handle | None:
    """All-gather through a user's comm object (torch FSDP2's ``set_custom_all_gather``):
    ``comm(output_tensor=output, input_tensor=input, group=group, async_op=async_op)``.

    ``output`` (N*S,) and ``input`` (S,) as in :func:`~.collectives.all_gather`; the caller has already put
    this rank's values in ``input`` (typically ``output``'s own slice). The comm returns None
    (done) or a Work, waited by the returned Handle. Counted and recorded like
    :func:`~.collectives.all_gather`, with the bytes of the payload it was given ((N-1) x S elements): a comm
    that sends something else (compressed, or through another channel) is counted at that size.
    Returns a Handle when ``async_op``, else None after completion.

    Raises:
        ValueError: sizes that do not match the group.
        TypeError: the comm returned something that is neither None nor a Work.
    """
    n = collectives.group_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, expected {n} x {input.numel()} (world size x input)"
        )
    entry = collectives._note(
        "all_gather", input.dtype, input.numel(), input.numel() * input.element_size() * (n - 1), group
    )
    work = comm(output_tensor=output, input_tensor=input, group=group, async_op=async_op)
    work = _custom_work(work, comm, "set_custom_all_gather")
    return collectives._finish(work, None, async_op, entry, sliced=_sliced(work, group))


def _sliced(work: Any, group: collectives.ProcessGroup) -> bool:
    """Whether to wait for ``work`` in slices while the watchdog runs: a torch Work on gloo."""
    return isinstance(work, dist.Work) and collectives.backend(group) == "gloo"


def reduce_op(kind: str, scale: float = 1.0) -> Any:
    """torch's ``ReduceOp`` for ``kind``: "sum", "avg", or "premul_sum" (multiply each input
    by ``scale``, then sum)."""
    if kind == "premul_sum":
        return dist.ReduceOp.PREMUL_SUM(scale)  # type: ignore[operator]  # torch's: called with the factor
    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}[kind]


def supports_premul_sum(group: collectives.ProcessGroup) -> bool:
    """Whether ``group``'s backend runs ``ReduceOp.PREMUL_SUM`` (NCCL; gloo refuses it)."""
    return collectives.backend(group) == "nccl"


@exposed_comm.blocking("reduce_scatter", collectives._unit)
@explained
def reduce_scatter(
    comm: Any,
    output: torch.Tensor,
    input: torch.Tensor,
    group: collectives.ProcessGroup,
    op: str,
    scale: float = 1.0,
    epilogue: Callable[[], Any] | None = None,
) -> Handle:
    """Reduce-scatter through a user's comm object (torch FSDP2's ``set_custom_reduce_scatter``):
    ``comm(output_tensor=output, input_tensor=input, group=group, op=<ReduceOp>)``, without
    ``async_op`` (torch does not pass it either: the comm's default applies).

    ``input`` (N*S,) and ``output`` (S,) as in :func:`~.collectives.reduce_scatter`; ``op`` / ``scale`` as in
    :func:`reduce_op` (the comm does the reduction it names, averaging included). The returned
    Handle waits for a Work the comm returned (None: it finished) and then runs ``epilogue``.
    Counted and recorded like :func:`~.collectives.reduce_scatter`, with the bytes of the payload it was given
    ((N-1) x S elements): a comm that sends something else is counted at that size.

    Raises:
        ValueError: sizes that do not match the group.
        TypeError: the comm returned something that is neither None nor a Work.
    """
    n = collectives.group_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, expected {n} x {output.numel()} (world size x output)"
        )
    entry = collectives._note(
        "reduce_scatter", input.dtype, input.numel(), output.numel() * output.element_size() * (n - 1), group
    )
    work = comm(output_tensor=output, input_tensor=input, group=group, op=reduce_op(op, scale))
    work = _custom_work(work, comm, "set_custom_reduce_scatter")
    handle = collectives._finish(work, epilogue, True, entry, sliced=_sliced(work, group))
    assert handle is not None
    return handle
