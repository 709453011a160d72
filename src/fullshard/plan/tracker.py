"""Live tensor bytes of a process, measured: the peak of the storages alive at once.

:class:`LiveTensorBytes` is a TorchDispatchMode. Every storage an op creates on the tracked
device type is registered (weakly: a finalizer forgets it when its last user, Python or C++,
lets go), and whenever a new storage appears the bytes of all registered storages are summed,
counting each distinct memory address once (views share a storage; fullshard's buffer pool
swaps memory between storages, which moves bytes without changing the sum). Tensors that
existed before the mode was entered are not seen unless passed to :meth:`adopt`.

It measures what torch allocates through ops (parameters, gradients, optimizer state,
activations, communication buffers, temporaries that reach Python or autograd). Workspaces
that kernels allocate and free inside one op (a convolution's im2col buffer) and the backend's
own buffers (gloo's) are invisible to it, as they are to ``torch.cuda.max_memory_allocated``'s
Python-level peers. On the meta device (``device_type="meta"``) it measures a step that
allocates nothing: storages there have sizes but no addresses, so each counts by identity.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from fullshard.compat import TorchDispatchMode, tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Tracks the bytes of live storages on ``device_type`` while entered (``with``).

    Attributes:
        current: bytes alive at the last allocation (int).
        peak: the largest ``current`` since construction or :meth:`reset_peak` (bytes).
        peak_label: what :attr:`label` returned at the peak (e.g. the unit and phase).

    ``observe``, if given, is called with ``current`` after every measurement (the bytes alive
    at each allocation, e.g. to find the peak under several gradient scales from one run).
    """

    def __init__(self, device_type: str = "cpu", label: Any = None, observe: Any = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.label = label or (lambda: None)
        self.observe = observe
        self._storages: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self.peak_label: Any = None

    def adopt(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Register tensors created before the mode was entered (parameters, optimizer state)."""
        for t in tensors:
            if t is not None:
                self._register(t)
        self._measure()

    def measure(self) -> int:
        """Bytes alive now (``current`` is otherwise as of the last allocation)."""
        self._measure()
        return self.current

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self._measure()
        self.peak, self.peak_label = self.current, self.label()

    def _register(self, t: torch.Tensor) -> bool:
        if hasattr(t, "to_local"):  # DTensor: its local tensor holds the memory
            t = t.to_local()
        if t.device.type != self.device_type:
            return False
        st = t.untyped_storage()
        key = id(st)
        if key in self._storages:
            return False
        self._storages[key] = weakref.ref(st)
        weakref.finalize(st, self._storages.pop, key, None)
        return True

    def _measure(self) -> None:
        sizes: dict[int, int] = {}
        for ref in list(self._storages.values()):
            st = ref()
            if st is not None and (n := st.nbytes()) > 0:
                ptr = st.data_ptr() if self.device_type != "meta" else id(st)  # meta storages have no address
                sizes[ptr] = max(sizes.get(ptr, 0), n)
        self.current = sum(sizes.values())
        if self.observe is not None:
            self.observe(self.current)
        if self.current > self.peak:
            self.peak, self.peak_label = self.current, self.label()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        new = False
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                new |= self._register(t)
        if new:
            self._measure()
        return out
