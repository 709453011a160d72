"""torch.distributed.fsdp's own option objects work in fullshard's front ends as fullshard's do.

A program that switched only its wrapper import still passes torch's enums and dataclasses (HF
Accelerate's FSDP plugin does): each is translated to fullshard's own (same settings, same
training bit for bit), a value of another type gets a TypeError, and a model that torch's FSDP
or fullshard's other front end already sharded is refused with the fix named, on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as tf
from dist import run_ranks
from models import Block, batch, local, make_stack
from torch import nn

import fullshard as fs
from fullshard import FSDP, fully_shard
from fullshard.engine.hooks import fsdp_state
from fullshard.frontend.wrap import ModuleWrapPolicy

BF16 = torch.bfloat16
F32 = torch.float32
NO_COUNTERPART = "has no counterpart in fullshard"


# ---------------------------------------------------------------------- helpers
def _train(model: nn.Module, rank: int, world: int, steps: int = 3, adam: bool = False) -> tuple[list, list, Any]:
    """Train on this rank's share of a fixed global batch; (losses and output dtypes, parameter shards, optimizer)."""
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-2)
        if adam
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    trace = []
    for step in range(steps):
        x, y = batch(step, 8)
        opt.zero_grad()
        out = model(local(x, rank, world))
        loss = torch.nn.functional.mse_loss(out.float(), local(y, rank, world))
        loss.backward()
        opt.step()
        trace.append((loss.detach(), out.dtype))
    return trace, [_local(p).detach().clone() for p in model.parameters()], opt


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _leaves(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    """(path, value) for every leaf of nested dicts and lists; tensors as their local part."""
    if isinstance(obj, dict):
        return [leaf for k in sorted(obj, key=str) for leaf in _leaves(obj[k], f"{path}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [leaf for i, v in enumerate(obj) for leaf in _leaves(v, f"{path}/{i}")]
    return [(path, _local(obj))]


def _assert_same(a: Any, b: Any, what: str) -> None:
    """Bitwise equality of two nested structures of tensors and plain values."""
    la, lb = _leaves(a), _leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb], f"{what}: different keys"
    for (path, x), (_, y) in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f"{what}: {path} differs"
        else:
            assert type(x) is type(y) and x == y, f"{what}: {path}: {x!r} != {y!r}"


def _settings(model: nn.Module) -> list[tuple]:
    """What every unit of a FullyShardedDataParallel tree was built with (enums compare by type too)."""
    return [
        (
            m.sharding_strategy,
            m.mixed_precision,
            m.cpu_offload,
            fsdp_state(m).backward_prefetch,
            fsdp_state(m).mixed_precision,
        )
        for m in FSDP.fsdp_modules(model)
    ]


def _build(kwargs: dict) -> tuple[nn.Module, list[str]]:
    """The test Stack under fullshard's wrapper (one unit per Block) and the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = FSDP(make_stack(0), auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)
    return model, [str(w.message) for w in caught]


def _raises(fn: Any, exc: type[Exception], text: str) -> str:
    try:
        fn()
    except exc as e:
        assert text in str(e), f"{text!r} not in {e}"
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"no {exc.__name__} for {text!r}")


# ---------------------------------------------------------------------- the wrapper's options
# (name, torch's options, fullshard's options that mean the same)
WRAPPER_CASES = [
    (
        "SHARD_GRAD_OP",
        dict(sharding_strategy=tf.ShardingStrategy.SHARD_GRAD_OP),
        dict(sharding_strategy=fs.ShardingStrategy.SHARD_GRAD_OP),
    ),
    (
        "NO_SHARD",
        dict(sharding_strategy=tf.ShardingStrategy.NO_SHARD),
        dict(sharding_strategy=fs.ShardingStrategy.NO_SHARD),
    ),
    (
        "HYBRID_SHARD",
        dict(sharding_strategy=tf.ShardingStrategy.HYBRID_SHARD),
        dict(sharding_strategy=fs.ShardingStrategy.HYBRID_SHARD),
    ),
    (
        "BACKWARD_POST",
        dict(backward_prefetch=tf.BackwardPrefetch.BACKWARD_POST),
        dict(backward_prefetch=fs.BackwardPrefetch.BACKWARD_POST),
    ),
    (
        "bf16 params, fp32 reduce",
        dict(
            sharding_strategy=tf.ShardingStrategy.FULL_SHARD,
            backward_prefetch=tf.BackwardPrefetch.BACKWARD_PRE,
            mixed_precision=tf.MixedPrecision(BF16, F32, BF16, cast_forward_inputs=True),
        ),
        dict(
            sharding_strategy=fs.ShardingStrategy.FULL_SHARD,
            backward_prefetch=fs.BackwardPrefetch.BACKWARD_PRE,
            mixed_precision=fs.MixedPrecision(BF16, F32, BF16, cast_forward_inputs=True),
        ),
    ),
    (
        "bf16 reduce, low-precision grads",
        dict(mixed_precision=tf.MixedPrecision(BF16, BF16, None, True, True, False)),
        dict(mixed_precision=fs.MixedPrecision(BF16, BF16, None, True, True, False)),
    ),
    (
        "CPUOffload",
        dict(cpu_offload=tf.CPUOffload(offload_params=True)),
        dict(cpu_offload=fs.CPUOffload(offload_params=True)),
    ),
]

# (torch's state_dict_type arguments, fullshard's)
STATE_DICT_CASES = [
    (
        (
            tf.StateDictType.FULL_STATE_DICT,
            tf.FullStateDictConfig(True, True),
            tf.FullOptimStateDictConfig(False, True),
        ),
        (
            fs.StateDictType.FULL_STATE_DICT,
            fs.FullStateDictConfig(True, True),
            fs.FullOptimStateDictConfig(False, True),
        ),
    ),
    (
        (
            tf.StateDictType.SHARDED_STATE_DICT,
            tf.ShardedStateDictConfig(True, _use_dtensor=True),
            tf.ShardedOptimStateDictConfig(False, _use_dtensor=True),
        ),
        (fs.StateDictType.SHARDED_STATE_DICT, fs.ShardedStateDictConfig(True), fs.ShardedOptimStateDictConfig(False)),
    ),
    (
        (tf.StateDictType.LOCAL_STATE_DICT, tf.LocalStateDictConfig(True), tf.LocalOptimStateDictConfig(True)),
        (fs.StateDictType.LOCAL_STATE_DICT, fs.LocalStateDictConfig(True), fs.LocalOptimStateDictConfig(True)),
    ),
    ((tf.StateDictType.SHARDED_STATE_DICT, None, None), (fs.StateDictType.SHARDED_STATE_DICT, None, None)),
]


def wrapper_cases(rank: int, world: int) -> list[str]:
    baseline, _ = _build({})
    _, base_params, base_opt = _train(baseline, rank, world)
    done = []
    for name, theirs, ours in WRAPPER_CASES:
        a, warned = _build(theirs)
        b, _ = _build(ours)
        assert not [w for w in warned if NO_COUNTERPART in w], (name, warned)
        assert _settings(a) == _settings(b), f"{name}: {_settings(a)} != {_settings(b)}"
        run_a, run_b = _train(a, rank, world), _train(b, rank, world)
        _assert_same(run_a[:2], run_b[:2], name)
        if "bf16" in name:  # the dtypes were in force: training differs from full precision
            assert not all(torch.equal(x, y) for x, y in zip(run_a[1], base_params)), name
        done.append(name)
    # torch's state-dict type and configs select what fullshard's select.
    for theirs, ours in STATE_DICT_CASES:
        name = theirs[0].name
        out = []
        for args in (theirs, ours):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with FSDP.state_dict_type(baseline, *args):
                    out.append((baseline._settings(), baseline.state_dict(), FSDP.optim_state_dict(baseline, base_opt)))
            if args[1] is not None:
                assert not [w for w in caught if NO_COUNTERPART in str(w.message)], (name, caught)
        assert out[0][0] == out[1][0], f"{name}: {out[0][0]} != {out[1][0]}"
        _assert_same(out[0][1:], out[1][1:], name)
        assert baseline._settings().state_dict_type is fs.StateDictType.FULL_STATE_DICT  # restored on exit
        done.append(f"{name}{'' if theirs[1] else ' (default configs)'}")
    old = FSDP.set_state_dict_type(baseline, tf.StateDictType.LOCAL_STATE_DICT, tf.LocalStateDictConfig())
    assert old.state_dict_type is fs.StateDictType.FULL_STATE_DICT
    restored = FSDP.set_state_dict_type(
        baseline, old.state_dict_type, old.state_dict_config, old.optim_state_dict_config
    )
    assert (
        restored.state_dict_type is fs.StateDictType.LOCAL_STATE_DICT
        and restored.state_dict_config == fs.LocalStateDictConfig()
    )
    assert _train(baseline, rank, world, steps=1)[0]  # still trains
    return done


# ---------------------------------------------------------------------- fully_shard's options
def _stack_for_fully_shard() -> nn.Module:
    """The test Stack with its 0-dim ``scale`` made shape (1,): fully_shard, as torch's, may refuse 0-dim parameters."""
    model = make_stack(0)
    model.scale = nn.Parameter(model.scale.detach().reshape(1))
    return model


def _fully_sharded(blocks: dict, root: dict) -> nn.Module:
    """The test Stack with fully_shard on each Block (``blocks`` options) and then the root."""
    model = _stack_for_fully_shard()
    for block in model.blocks:
        fully_shard(block, **blocks)
    return fully_shard(model, **root)


def _twice(kwargs: dict) -> tuple[dict, dict]:
    return kwargs, kwargs


# (name, torch's options for the blocks and the root, fullshard's). The blocks keep their bf16
# outputs (the root's head takes them); the root's output_dtype gives float32 outputs.
FULLY_SHARD_CASES = [
    (
        "MixedPrecisionPolicy",
        (
            dict(mp_policy=tf.MixedPrecisionPolicy(BF16, F32, None, True)),
            dict(mp_policy=tf.MixedPrecisionPolicy(BF16, F32, F32, True)),
        ),
        (
            dict(mp_policy=fs.MixedPrecisionPolicy(BF16, F32, None, True)),
            dict(mp_policy=fs.MixedPrecisionPolicy(BF16, F32, F32, True)),
        ),
    ),
    (
        "CPUOffloadPolicy",
        _twice(dict(offload_policy=tf.CPUOffloadPolicy(pin_memory=False))),
        _twice(dict(offload_policy=fs.CPUOffloadPolicy(pin_memory=False))),
    ),
    ("OffloadPolicy", _twice(dict(offload_policy=tf.OffloadPolicy())), _twice(dict(offload_policy=fs.OffloadPolicy()))),
]


def fully_shard_cases(rank: int, world: int) -> list[str]:
    from fullshard.engine import build

    done = []
    for name, theirs, ours in FULLY_SHARD_CASES:
        runs, warned = [], []
        for kwargs in (theirs, ours):
            # On a CPU run offloading only shows as this once-per-process warning: re-arm it.
            build._warned_offload_on_cpu = False
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = _fully_sharded(*kwargs)
            warned.append(any("cpu_offload has no effect" in str(w.message) for w in caught))
            mps = [fsdp_state(m).mixed_precision for m in model.modules() if fsdp_state(m) is not None]
            runs.append((mps, _train(model, rank, world, adam=True)[:2]))
        assert runs[0][0] == runs[1][0], f"{name}: {runs[0][0]} != {runs[1][0]}"
        _assert_same(runs[0][1], runs[1][1], name)
        assert warned[0] == warned[1] == (name == "CPUOffloadPolicy"), (name, warned)
        if name == "MixedPrecisionPolicy":
            assert runs[0][0][0] is not None and {dt for _, dt in runs[0][1][0]} == {F32}  # the root's output_dtype
        done.append(name)
    return done


# ---------------------------------------------------------------------- misuse
def misuse_cases(rank: int, world: int) -> list[str]:
    seen = []
    lin = functools.partial(nn.Linear, 4, 4)

    def by_torch_fully_shard() -> nn.Module:
        model = nn.Sequential(lin(), lin())
        tf.fully_shard(model[1])
        return model

    def by_torch_fsdp1() -> nn.Module:
        return nn.Sequential(lin(), tf.FullyShardedDataParallel(lin(), device_id=torch.device("cpu")))

    torch_root = by_torch_fully_shard()
    tf.fully_shard(torch_root)
    for front_end in (FSDP, fully_shard):
        seen.append(
            _raises(
                lambda: front_end(by_torch_fully_shard()),
                ValueError,
                "submodule '1' (FSDPLinear) was already sharded by torch.distributed.fsdp.fully_shard",
            )
        )
        seen.append(
            _raises(
                lambda: front_end(torch_root),
                ValueError,
                "module (FSDPSequential) was already sharded by torch.distributed.fsdp.fully_shard",
            )
        )
        seen.append(
            _raises(
                lambda: front_end(by_torch_fsdp1()),
                ValueError,
                "submodule '1' (FullyShardedDataParallel) is already wrapped by "
                "torch.distributed.fsdp.FullyShardedDataParallel",
            )
        )
    seen.append(
        _raises(
            lambda: FSDP(tf.FullyShardedDataParallel(lin(), device_id=torch.device("cpu"))),
            ValueError,
            "import FullyShardedDataParallel from fullshard instead",
        )
    )
    seen.append(
        _raises(lambda: fully_shard(by_torch_fully_shard()), ValueError, "import fully_shard from fullshard instead")
    )
    # fullshard's two front ends in one model, either way round.
    mixed = "FullyShardedDataParallel and fully_shard cannot be mixed in one model"
    seen.append(
        _raises(
            lambda: fully_shard(nn.Sequential(FSDP(lin()), lin())),
            ValueError,
            "submodule '0' (FullyShardedDataParallel) is a fullshard FullyShardedDataParallel; " + mixed,
        )
    )
    seen.append(
        _raises(
            lambda: fully_shard(FSDP(lin())),
            ValueError,
            "module (FullyShardedDataParallel) is a fullshard FullyShardedDataParallel",
        )
    )
    seen.append(
        _raises(
            lambda: FSDP(nn.Sequential(fully_shard(lin()), lin())),
            ValueError,
            "submodule '0' (FSDPLinear) is sharded by fullshard's fully_shard; " + mixed,
        )
    )
    seen.append(
        _raises(
            lambda: FSDP(fully_shard(lin())), ValueError, "module (FSDPLinear) is sharded by fullshard's fully_shard"
        )
    )
    # Objects of other types: a TypeError naming the argument and what it takes.
    seen.append(
        _raises(
            lambda: FSDP(lin(), sharding_strategy=1),
            TypeError,
            "sharding_strategy must be a ShardingStrategy (fullshard's or torch.distributed.fsdp's)",
        )
    )
    seen.append(
        _raises(
            lambda: FSDP(lin(), backward_prefetch=1),
            TypeError,
            "backward_prefetch must be a BackwardPrefetch (fullshard's or torch.distributed.fsdp's) or None",
        )
    )
    seen.append(
        _raises(
            lambda: FSDP(lin(), mixed_precision=tf.MixedPrecisionPolicy()),
            TypeError,
            "mixed_precision must be a MixedPrecision (fullshard's or torch.distributed.fsdp's)",
        )
    )
    seen.append(
        _raises(
            lambda: FSDP(lin(), cpu_offload=tf.CPUOffloadPolicy()),
            TypeError,
            "cpu_offload must be a CPUOffload (fullshard's or torch.distributed.fsdp's)",
        )
    )
    seen.append(
        _raises(
            lambda: fully_shard(lin(), mp_policy=tf.MixedPrecision()),
            TypeError,
            "mp_policy must be a MixedPrecisionPolicy (fullshard's or torch.distributed.fsdp's) or None, "
            "got MixedPrecision",
        )
    )
    seen.append(
        _raises(
            lambda: fully_shard(lin(), offload_policy=tf.CPUOffload()),
            TypeError,
            "offload_policy must be an OffloadPolicy",
        )
    )
    model = FSDP(lin())
    seen.append(
        _raises(
            lambda: FSDP.set_state_dict_type(model, "FULL_STATE_DICT"),
            TypeError,
            "state_dict_type must be a StateDictType (fullshard's or torch.distributed.fsdp's)",
        )
    )
    seen.append(
        _raises(
            lambda: FSDP.set_state_dict_type(model, tf.StateDictType.FULL_STATE_DICT, tf.FullOptimStateDictConfig()),
            TypeError,
            "state_dict_config must be a StateDictConfig",
        )
    )
    seen.append(
        _raises(
            lambda: FSDP.set_state_dict_type(model, tf.StateDictType.FULL_STATE_DICT, None, tf.FullStateDictConfig()),
            TypeError,
            "optim_state_dict_config must be an OptimStateDictConfig",
        )
    )
    return seen


def grid_body(rank: int, world: int) -> dict[str, list[str]]:
    return {
        "wrapper": wrapper_cases(rank, world),
        "fully_shard": fully_shard_cases(rank, world),
        "misuse": misuse_cases(rank, world),
    }


@pytest.mark.timeout(180)
def test_torch_options_translate_and_misuse_is_refused() -> None:
    results = run_ranks(grid_body, 2, timeout=160)
    assert results[0] == results[1]  # every rank did the same and raised the same errors
    got = results[0]
    assert got["wrapper"] == [c[0] for c in WRAPPER_CASES] + [
        "FULL_STATE_DICT",
        "SHARDED_STATE_DICT",
        "LOCAL_STATE_DICT",
        "SHARDED_STATE_DICT (default configs)",
    ]
    assert got["fully_shard"] == [c[0] for c in FULLY_SHARD_CASES]
    assert len(got["misuse"]) == 21


# ---------------------------------------------------------------------- field by field, one process
def test_every_torch_field_is_carried_over_or_warned() -> None:
    """Each torch option object, every field away from its default, becomes fullshard's with the
    same values; the fields fullshard has no counterpart for warn (and only when they ask for
    something fullshard does not do)."""
    from fullshard import api
    from fullshard.frontend import options

    mp = dict(
        param_dtype=BF16,
        reduce_dtype=torch.float16,
        buffer_dtype=F32,
        keep_low_precision_grads=True,
        cast_forward_inputs=True,
        cast_root_forward_inputs=False,
        _module_classes_to_ignore=(nn.LayerNorm, nn.BatchNorm1d),
    )
    pairs = [
        (options.as_mixed_precision, tf.MixedPrecision(**mp), fs.MixedPrecision(**mp)),
        (options.as_cpu_offload, tf.CPUOffload(offload_params=True), fs.CPUOffload(offload_params=True)),
        (
            options.as_state_dict_config,
            tf.StateDictConfig(offload_to_cpu=True),
            api.StateDictConfig(offload_to_cpu=True),
        ),
        (
            options.as_state_dict_config,
            tf.FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
            fs.FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        ),
        (
            options.as_state_dict_config,
            tf.ShardedStateDictConfig(offload_to_cpu=True, _use_dtensor=True),
            fs.ShardedStateDictConfig(offload_to_cpu=True),
        ),
        (
            options.as_state_dict_config,
            tf.LocalStateDictConfig(offload_to_cpu=True),
            fs.LocalStateDictConfig(offload_to_cpu=True),
        ),
        (
            options.as_optim_state_dict_config,
            tf.OptimStateDictConfig(offload_to_cpu=False),
            api.OptimStateDictConfig(offload_to_cpu=False),
        ),
        (
            options.as_optim_state_dict_config,
            tf.FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
            fs.FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        ),
        (
            options.as_optim_state_dict_config,
            tf.ShardedOptimStateDictConfig(offload_to_cpu=False, _use_dtensor=True),
            fs.ShardedOptimStateDictConfig(offload_to_cpu=False),
        ),
        (
            options.as_optim_state_dict_config,
            tf.LocalOptimStateDictConfig(offload_to_cpu=True),
            fs.LocalOptimStateDictConfig(offload_to_cpu=True),
        ),
        (
            functools.partial(options.as_mp_policy, policy=fs.MixedPrecisionPolicy),
            tf.MixedPrecisionPolicy(BF16, torch.float16, F32, False),
            fs.MixedPrecisionPolicy(BF16, torch.float16, F32, False),
        ),
        (
            functools.partial(options.as_offload_policy, no_offload=fs.OffloadPolicy, cpu_offload=fs.CPUOffloadPolicy),
            tf.CPUOffloadPolicy(pin_memory=False),
            fs.CPUOffloadPolicy(pin_memory=False),
        ),
    ]
    for normalize, theirs, ours in pairs:
        for field in dataclasses.fields(theirs):  # a field added in a later torch must be looked at here
            assert hasattr(ours, field.name) or field.name in options._NO_COUNTERPART, (
                f"{type(theirs).__name__}.{field.name}"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = normalize(theirs)
        assert type(got) is type(ours) and got == ours, f"{theirs} -> {got}, want {ours}"
    no_offload = options.as_offload_policy(tf.OffloadPolicy(), fs.OffloadPolicy, fs.CPUOffloadPolicy)
    assert type(no_offload) is fs.OffloadPolicy
    for theirs_enum, ours_enum, normalize in [
        (tf.ShardingStrategy, fs.ShardingStrategy, options.parse_sharding_strategy),
        (tf.BackwardPrefetch, fs.BackwardPrefetch, options.as_backward_prefetch),
        (tf.StateDictType, fs.StateDictType, options.as_state_dict_type),
    ]:
        assert [normalize(m) for m in theirs_enum] == list(ours_enum)
    # Torch's defaults that fullshard does not follow warn, naming the field and why.
    for normalize, theirs in [
        (options.as_state_dict_config, tf.ShardedStateDictConfig()),
        (options.as_optim_state_dict_config, tf.ShardedOptimStateDictConfig()),
    ]:
        with pytest.warns(UserWarning, match=NO_COUNTERPART) as record:
            normalize(theirs)
        assert len(record) == 1 and "_use_dtensor=False" in str(record[0].message)
    # torch's MixedPrecision default (BatchNorm kept in full precision) is fullshard's: carried
    # over silently, and the dtype shortcut takes it too.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = options.as_mixed_precision(tf.MixedPrecision(param_dtype=BF16))
    torch_default = tf.MixedPrecision()._module_classes_to_ignore
    assert got == fs.MixedPrecision(param_dtype=BF16) and tuple(got._module_classes_to_ignore) == tuple(torch_default)
    assert options.as_mixed_precision(BF16) == fs.MixedPrecision(BF16, BF16, BF16)


# ---------------------------------------------------------------------- HF Accelerate
def accelerate_body(rank: int, world: int) -> list[Any]:
    """Accelerate's FSDP1 path (accelerator.py, prepare_model) with fullshard's wrapper: the
    plugin's torch objects reach the constructor and state_dict_type exactly as Accelerate passes
    them; training matches fullshard's own options bit for bit. Then its FSDP2 path with fully_shard."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import ensure_weights_retied

    device = torch.device("cpu")
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1,
        reshard_after_forward="FULL_SHARD",
        backward_prefetch="BACKWARD_PRE",
        mixed_precision_policy="bf16",
        cpu_offload=False,
        auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        transformer_cls_names_to_wrap=["Block"],
        state_dict_type="FULL_STATE_DICT",
        use_orig_params=True,
        sync_module_states=False,
        forward_prefetch=False,
    )
    model = make_stack(0)
    plugin.set_auto_wrap_policy(model)
    plugin.param_init_fn = ensure_weights_retied(plugin.param_init_fn, model, device)
    kwargs = {
        "sharding_strategy": plugin.sharding_strategy or plugin.reshard_after_forward,
        "cpu_offload": plugin.cpu_offload,
        "auto_wrap_policy": plugin.auto_wrap_policy,
        "mixed_precision": plugin.mixed_precision_policy,
        "sync_module_states": plugin.sync_module_states,
        "backward_prefetch": plugin.backward_prefetch,
        "forward_prefetch": plugin.forward_prefetch,
        "use_orig_params": plugin.use_orig_params,
        "param_init_fn": plugin.param_init_fn,
        "ignored_modules": plugin.ignored_modules,
        "limit_all_gathers": plugin.limit_all_gathers,
        "device_id": device,
    }
    assert isinstance(kwargs["sharding_strategy"], tf.ShardingStrategy) and isinstance(
        kwargs["mixed_precision"], tf.MixedPrecision
    )
    with warnings.catch_warnings(record=True) as caught:  # torch's default _module_classes_to_ignore is carried over
        warnings.simplefilter("always")
        wrapped = FSDP(model, **kwargs)
    assert not [w for w in caught if NO_COUNTERPART in str(w.message)], [str(w.message) for w in caught]
    ours = FSDP(
        make_stack(0),
        sharding_strategy=fs.ShardingStrategy.FULL_SHARD,
        cpu_offload=fs.CPUOffload(False),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=fs.MixedPrecision(BF16, BF16, BF16),
        backward_prefetch=fs.BackwardPrefetch.BACKWARD_PRE,
        use_orig_params=True,
        device_id=device,
    )
    assert len(FSDP.fsdp_modules(wrapped)) == 5 and _settings(wrapped) == _settings(ours)
    run_a, run_b = _train(wrapped, rank, world, adam=True), _train(ours, rank, world, adam=True)
    _assert_same(run_a[:2], run_b[:2], "accelerate FSDP1")
    # Saving the way accelerate.utils.fsdp_utils.save_fsdp_model does for FULL_STATE_DICT.
    with FSDP.state_dict_type(
        wrapped, plugin.state_dict_type, plugin.state_dict_config, plugin.optim_state_dict_config
    ):
        state = wrapped.state_dict()
        optim_state = FSDP.optim_state_dict(wrapped, run_a[2])
    assert (len(state) == len(make_stack().state_dict())) == (rank == 0)  # rank0_only=True carried over
    assert bool(optim_state.get("state")) == (rank == 0) and (rank == 0 or optim_state == {})  # torch's: {} off rank 0

    # FSDP2 (fsdp_version=2): accelerate.utils.fsdp_utils.fsdp2_prepare_model's fully_shard arguments.
    plugin2 = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy="bf16", cpu_offload=False)
    fsdp2_kwargs = {
        "reshard_after_forward": plugin2.reshard_after_forward,
        "offload_policy": plugin2.cpu_offload,
        "mp_policy": plugin2.mixed_precision_policy or tf.MixedPrecisionPolicy(),
        "mesh": None,
    }
    assert isinstance(fsdp2_kwargs["mp_policy"], tf.MixedPrecisionPolicy) and isinstance(
        fsdp2_kwargs["offload_policy"], tf.OffloadPolicy
    )
    sharded = _stack_for_fully_shard()
    for block in sharded.blocks:
        fully_shard(block, **fsdp2_kwargs)
    fully_shard(sharded, **{k: v for k, v in fsdp2_kwargs.items() if k != "reshard_after_forward"})
    trace, params, _ = _train(sharded, rank, world, adam=True)
    assert {dt for _, dt in trace} == {BF16} and all(torch.isfinite(loss) for loss, _ in trace)
    return [loss.item() for loss, _ in run_a[0]] + [loss.item() for loss, _ in trace]


@pytest.mark.timeout(120)
def test_accelerate_fsdp_plugin_fields_construct_and_train() -> None:
    pytest.importorskip("accelerate")
    results = run_ranks(accelerate_body, 2, timeout=100)
    assert len(results[0]) == 6 and all(x > 0 for x in results[0])
