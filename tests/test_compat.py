"""fullshard.compat: every private torch name it uses resolves in this torch (a test per name,
failing with the name), version choices follow what torch has, and tools/check_layers.py flags a
private torch access outside compat without flagging public names."""

from __future__ import annotations

import ast
import datetime
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fullshard import compat
from fullshard.comm import collectives

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.mark.parametrize("path", sorted(p for p, when in compat.PRIVATE_NAMES.items() if when != "optional"))
def test_every_private_name_resolves(path: str) -> None:
    try:
        compat.resolve(path)
    except compat.MissingTorchName as e:
        pytest.fail(f"torch {torch.__version__} lacks {path}, which fullshard.compat uses: {e}")


def test_missing_names_are_named_with_the_torch_version() -> None:
    with pytest.raises(compat.MissingTorchName, match=r"torch\.nn\._no_such_name, absent in torch 2"):
        compat.resolve("torch:nn._no_such_name")
    with pytest.raises(compat.MissingTorchName, match=r"torch\._no_such_module, absent in torch"):
        compat.resolve("torch._no_such_module")
    # raised at import for the engine's names, at first use for a feature's: both kinds catch it
    assert issubclass(compat.MissingTorchName, ImportError) and issubclass(compat.MissingTorchName, RuntimeError)


def test_first_present_picks_the_newest_name_torch_has() -> None:
    both = types.SimpleNamespace(all_gather_single=1, all_gather_into_tensor=2)
    old = types.SimpleNamespace(all_gather_into_tensor=2)
    assert compat.first_present(both, "all_gather_single", "all_gather_into_tensor") == "all_gather_single"
    assert compat.first_present(old, "all_gather_single", "all_gather_into_tensor") == "all_gather_into_tensor"
    with pytest.raises(compat.MissingTorchName, match="all_gather_single, all_gather_into_tensor"):
        compat.first_present(types.SimpleNamespace(), "all_gather_single", "all_gather_into_tensor")


def test_collectives_use_the_names_chosen_for_this_torch() -> None:
    expected = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    assert compat.ALL_GATHER_NAME == expected
    assert collectives._all_gather_fn is getattr(dist, compat.ALL_GATHER_NAME)
    expected = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    assert compat.REDUCE_SCATTER_NAME == expected
    assert collectives._reduce_scatter_fn is getattr(dist, compat.REDUCE_SCATTER_NAME)
    public = hasattr(dist.ProcessGroup, "get_group_store")
    assert compat.STORE_ACCESSOR == ("get_group_store" if public else "_get_default_store")


def test_store_and_timeout_of_a_group() -> None:
    """Both store accessors reach the default group's store; the timeout read back is the one given."""
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=77)
    )
    try:
        group = dist.group.WORLD
        compat.group_store(group).set("compat-key", "1")
        private = compat.resolve("torch.distributed.distributed_c10d:_get_default_store")()
        assert private.get("compat-key") == b"1"
        assert compat.backend_timeout(group, torch.device("cpu")) == 77.0
        assert collectives.process_group_timeout(group) == 77.0
    finally:
        dist.destroy_process_group()


def test_storage_swap_is_chosen_by_presence() -> None:
    assert compat.STORAGE_SWAP == hasattr(torch.UntypedStorage, "_swap_data_ptr_")
    if not compat.STORAGE_SWAP:
        with pytest.raises(compat.MissingTorchName, match="_swap_data_ptr_"):
            compat.swap_storage_memory(torch.empty(1).untyped_storage(), torch.empty(1).untyped_storage())


@pytest.mark.parametrize("swap", [True, False])
def test_acquire_and_release_storage_with_and_without_the_swap(swap: bool) -> None:
    """The pool's way (swap, CPU on a torch that has it) and the resize way (CUDA, torch 2.11)
    both give a storage that keeps its views the memory, and take it away again."""
    from dist import patched

    from fullshard.comm import buffers

    if swap and not compat.STORAGE_SWAP:
        pytest.skip(f"torch {torch.__version__} has no storage swap")
    flat = torch.empty(0)
    storage = flat.untyped_storage()
    with patched(compat, STORAGE_SWAP=swap):
        pooled = buffers.acquire_storage(storage, 6, torch.float32, torch.device("cpu"))
        assert (pooled is not None) == swap and storage.nbytes() == 6 * 4
        full = torch.empty(0).set_(storage, 0, (6,))
        full.copy_(torch.arange(6.0))
        view = full[2:4]
        assert view.tolist() == [2.0, 3.0]
        buffers.release_storage(storage, pooled)
        assert storage.nbytes() == 0
    buffers.POOL.clear()


def test_storage_swap_and_use_count() -> None:
    if not compat.STORAGE_SWAP:
        pytest.skip(f"torch {torch.__version__} has no storage swap")
    a, b = torch.arange(4.0), torch.zeros(4)
    view = a[1:]
    before = compat.storage_use_count(a)
    compat.swap_storage_memory(a.untyped_storage(), b.untyped_storage())
    assert a.tolist() == [0.0] * 4 and b.tolist() == [0.0, 1.0, 2.0, 3.0] and view.tolist() == [0.0] * 3
    del view
    assert compat.storage_use_count(a) == before - 1
    assert compat.is_view(a[1:]) and not compat.is_view(a)


def test_version_counters_and_backward_state() -> None:
    t = torch.zeros(3)
    compat.set_version_counters((t,), (compat.version_counter(t) + 5,))
    assert compat.version_counter(t) == 5
    seen: list[object] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(compat.in_backward())
        compat.queue_backward_callback(lambda: seen.append("end of backward"))
        return grad

    x = torch.ones(2, requires_grad=True)
    x.register_hook(hook)
    (x * 2).sum().backward()
    assert seen == [True, "end of backward"] and not compat.in_backward()


def _flagged(source: str) -> list[str]:
    sys.path.insert(0, str(TOOLS))
    try:
        import check_layers
    finally:
        sys.path.remove(str(TOOLS))
    path = check_layers.ROOT / "fullshard" / "_probe_for_test.py"  # only its name is used
    return [line.split(": ", 1)[1] for line in check_layers.private_torch_uses(path, ast.parse(source))]


def test_check_layers_flags_private_torch_uses() -> None:
    source = """
import torch
import torch.distributed as dist
import torch.utils._pytree
from torch.autograd import Variable
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard
aten = torch.ops.aten
a = torch._C._current_graph_task_id()
b = dist.distributed_c10d._get_default_store()
c = Variable._execution_engine
d = param._local_tensor
module._parameters["w"] = None
e = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
f = aten._scaled_dot_product_efficient_attention
"""
    found = _flagged(source)
    for name in (
        "torch.utils._pytree",
        "_dtensor_spec.DTensorSpec",
        "_StridedShard",
        "private _current_graph_task_id",
        "private _C ",
        "_get_default_store",
        "_execution_engine",
        "_local_tensor",
        "_parameters",
        "_swap_data_ptr_",
        "_scaled_dot_product_efficient_attention",
    ):
        assert any(name in line for line in found), (name, found)


def test_check_layers_passes_public_and_own_names() -> None:
    source = """
import torch
import torch.distributed as dist
from torch import nn
x = torch.nn.functional.relu(torch.ones(1)).__class__.__name__
dist.all_reduce(x)
self._pending = None
p._fullshard_param = sp
y = getattr(p, "_fullshard_param", None)
z = obj._private_of_ours
nn.Module.register_load_state_dict_pre_hook
"""
    assert _flagged(source) == []
