"""``fullshard.memory_report`` on real wrapped models: every byte checked against the shapes."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from dist import run_ranks
from torch import nn

SHAPES = {"0": [(7, 10), (7,)], "2": [(3, 7), (3,)]}  # the two Linear units' weight and bias


def _local_rows(rows: int, world: int, rank: int) -> int:
    per = math.ceil(rows / world)
    return max(0, min(per, rows - rank * per))


def _padded(shape: tuple[int, ...], world: int) -> int:
    """A rank's padded shard (elements): its share of the rows, at one rank rounded up to 64 bytes
    (16 float32: each parameter of a one-rank unit starts on a 64-byte line)."""
    n = math.ceil(shape[0] / world) * math.prod(shape[1:])
    return -(-n // 16) * 16 if world == 1 else n


def _expected(world: int, rank: int) -> dict[str, dict[str, int]]:
    out = {}
    for name, shapes in SHAPES.items():
        numel = sum(math.prod(s) for s in shapes)
        padded = sum(_padded(s, world) for s in shapes)  # each rank's shard
        local = sum(_local_rows(s[0], world, rank) * math.prod(s[1:]) for s in shapes)
        out[name] = {
            "numel": numel,
            "shard_bytes": 4 * padded,
            "full_bytes": 0 if world == 1 else 4 * world * padded,
            "optim_bytes": 4 * (2 * local + len(shapes)),  # exp_avg, exp_avg_sq; a 0-dim step per parameter
            "full_state_bytes": 4 * (4 * numel + len(shapes)),  # params, grads, both moments, the steps
        }
    return out


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3))


def report_body(rank: int, world: int, api: str, optimizer: str = "adamw") -> dict:
    from fullshard import FullyShardedDataParallel, fully_shard, memory_report
    from fullshard.plan.estimate import estimate_model_state
    from fullshard.wrap import ModuleWrapPolicy

    with torch.device("meta"):
        plain = _net()
    predicted = estimate_model_state(
        plain, lambda m: isinstance(m, nn.Linear), world, rank=rank, optimizer=optimizer, momentum=0.9
    )
    torch.manual_seed(0)
    net = _net()
    if api == "fsdp1":
        model = FullyShardedDataParallel(net, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    else:
        for layer in (net[0], net[2]):
            fully_shard(layer)
        model = fully_shard(net)
    opt = OPTIMIZERS[optimizer](model.parameters())
    with pytest.raises(ValueError, match="no fullshard FSDP unit"):
        memory_report(nn.Linear(2, 2))
    before = memory_report(model, opt)
    model(torch.randn(4, 10)).sum().backward()
    opt.step()
    after = memory_report(model, opt)
    return {
        "before": [(u.name, u.grad_bytes, u.optim_bytes) for u in before.units],
        "after": {u.name: dict(vars(u)) for u in after.units},
        "text": str(after),
        "reduction": after.reduction,
        "world": after.world_size,
        "predicted": {u.name: dict(vars(u)) for u in predicted},
    }


@pytest.mark.timeout(200)
@pytest.mark.parametrize("api", ["fsdp1", "fully_shard"])
@pytest.mark.parametrize("world", [1, 3])
def test_memory_report_counts_every_byte(world: int, api: str) -> None:
    for rank, got in enumerate(run_ranks(report_body, world, api, timeout=180)):
        assert got["world"] == world
        assert all(grads == 0 and optim == 0 for _, grads, optim in got["before"]), got["before"]
        units = got["after"]
        assert set(units) == {"<root>", "0", "2"}, units
        assert units["<root>"]["numel"] == 0
        for name, want in _expected(world, rank).items():
            unit = units[name]
            for key, value in want.items():
                assert unit[key] == value, (rank, name, key, unit[key], value)
            assert unit["grad_bytes"] == want["shard_bytes"]  # the sharded gradients fill the shards' size
        state = sum(u["shard_bytes"] + u["grad_bytes"] + u["optim_bytes"] for u in units.values())
        full = sum(u["full_state_bytes"] for u in units.values())
        assert got["reduction"] == pytest.approx(full / state)
        assert "| total | 101 |" in got["text"] and f"({world} ranks)" in got["text"], got["text"]
        _matches_prediction(got)


def _matches_prediction(got: dict) -> None:
    """The estimator's bytes (from shapes, on the meta device) equal the measured ones exactly."""
    for name, unit in got["after"].items():
        predicted = got["predicted"][name]
        for key in ("numel", "shard_bytes", "grad_bytes", "optim_bytes", "full_bytes"):
            assert predicted[key] == unit[key], (name, key, predicted[key], unit[key])


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("world", "api", "optimizer"), [(2, "fsdp1", "adadelta"), (3, "fully_shard", "sgd")])
def test_estimated_model_state_equals_the_measured_one(world: int, api: str, optimizer: str) -> None:
    for got in run_ranks(report_body, world, api, optimizer, timeout=180):
        _matches_prediction(got)


def test_live_tensor_bytes_counts_each_storage_once_and_forgets_freed_ones() -> None:
    from fullshard.plan.tracker import LiveTensorBytes

    x = torch.ones(1000, requires_grad=True)  # made before: seen only when adopted
    with LiveTensorBytes(label=lambda: "step") as live:
        live.adopt([x])
        assert live.current == 4000
        a = torch.empty(1000)
        view = a[:10]  # a view: no new memory
        assert live.current == 8000
        del a, view
        y = (x * 2).exp()  # x * 2 is a temporary; exp saves its output for backward
        assert live.peak == 12000  # x, the temporary x * 2 and exp's output at once
        loss = y.sum()
        del y  # still alive: the graph saved it
        live.reset_peak()
        loss.backward()
        assert x.grad is not None
        del loss
        b = torch.empty(10)
    assert live.peak >= 4000 + 4000 + 4000  # x, exp's saved output and the gradient, during backward
    assert live.current == 4000 + 4000 + 40, live.current  # x, x.grad, b: everything else freed
    assert live.peak_label == "step"
    del b


def test_live_tensor_bytes_on_the_meta_device_measures_without_allocating() -> None:
    from fullshard.plan.tracker import LiveTensorBytes

    with LiveTensorBytes("meta") as live:
        with torch.device("meta"):
            layer = nn.Linear(2**16, 2**16)  # 16 GiB of weights: sizes only
        assert live.current == 4 * (2**32 + 2**16)
        layer(torch.zeros(8, 2**16, device="meta")).sum().backward()
    assert live.peak >= 2 * 4 * 2**32  # the weight and its gradient at once
    assert live.measure() == 2 * 4 * (2**32 + 2**16)  # parameters and gradients remain


@pytest.mark.timeout(200)
def test_predicted_step_peak_is_within_5_percent_of_the_measured_one() -> None:
    """Bytes, not seconds: the estimate from a meta-device trace against LiveTensorBytes on three
    real steps (the third step's peak on rank 0). The full table is `fullshard bench estimate`."""
    from fullshard.jobs.planning import validate

    configs = (validate.Config("gpt-tiny", 2, ac=True), validate.Config("mnist", 1, batch=64))
    # the memory-bound GPT: resident gradient shards and the reduce-scatter's receive buffer
    for config in (*configs, validate.Config("gpt-wide", 2, batch=2)):
        estimate, peak, _ = validate.compare(config)
        parts = (estimate.shards, estimate.optimizer, estimate.gathered, estimate.activations)
        assert all(p >= 0 for p in parts) and estimate.activations > 0
        assert abs(estimate.total - peak) <= 0.05 * peak, (config, estimate, peak)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_trace_of_attention_equals_the_cpu_step(dtype: torch.dtype) -> None:
    """On meta, SDPA would take its math path (float32 attention weights saved); the trace runs
    CPU's flash kernel instead, so its activation bytes are the real CPU step's, to the byte."""
    from fullshard.jobs.models.gpt import GPT, PRESETS
    from fullshard.plan.peak import trace_activations

    def example() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(2, 64, dtype=torch.long), torch.zeros(2, 64, dtype=torch.long)

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(batch[0]).float().flatten(0, 1), batch[1].flatten())

    traced = trace_activations(lambda: GPT(PRESETS["tiny"]), example, loss, dtype)[0]
    measured = _real_step_activations(GPT(PRESETS["tiny"]).to(dtype), example, loss)
    assert traced == measured, (traced, measured)


def _real_step_activations(model: nn.Module, example: Any, loss: Any) -> int:
    """Bytes of a real CPU step's peak beyond the parameters and the gradients made by then."""
    from fullshard.plan.tracker import LiveTensorBytes

    params = list(model.parameters())
    with LiveTensorBytes(label=lambda: sum(p.grad.nbytes for p in params if p.grad is not None)) as live:
        live.adopt(params)
        batch = example()
        live.reset_peak()
        loss(model, batch).backward()
    return live.peak - sum(p.nbytes for p in params) - live.peak_label


@pytest.mark.parametrize(("config", "slack"), [("gpt2-tiny", 0), ("llama-tiny", 128)])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_meta_trace_of_hf_models_equals_the_cpu_step(config: str, slack: int, checkpoint: bool) -> None:
    """transformers' mask code asks whether the position ids pack several sequences (a value
    read, impossible on meta); the trace answers as transformers does for the ids it makes, and
    the traced activations are the real CPU step's: GPT-2's to the byte, Llama's within 128 bytes
    of 5.9 MB (measured)."""
    pytest.importorskip("transformers")
    from fullshard.frontend.activation_checkpointing import apply_activation_checkpointing
    from fullshard.jobs.train.hf import hf_model
    from fullshard.jobs.train.plan_options import lm_parts
    from fullshard.plan.peak import trace_activations

    make, layers = hf_model(config)
    example, loss = lm_parts(2, 64)

    def is_layer(m: nn.Module) -> bool:
        return type(m).__name__ in layers

    traced = trace_activations(make, example, loss, None, is_layer if checkpoint else None)[0]
    model = make()
    if checkpoint:
        apply_activation_checkpointing(model, check_fn=is_layer)
    measured = _real_step_activations(model, example, loss)
    assert abs(traced - measured) <= slack, (traced, measured)


def test_meta_trace_of_cuda_attention_saves_no_attention_weights() -> None:
    """On nccl the trace runs CUDA's flash kernel (bf16) or memory-efficient kernel (float32),
    as SDPA does there: no batch x heads x T x T weights saved, unlike SDPA's math path that
    plain meta tensors take; in bf16 it saves what CPU's flash kernel saves (and the 96 bytes of
    the dropout generator's seed and offset)."""
    from fullshard.jobs.models.gpt import GPT, PRESETS
    from fullshard.jobs.train.plan_options import lm_parts
    from fullshard.plan.peak import trace_activations

    cfg = PRESETS["tiny"]
    example, loss = lm_parts(2, 512)
    for dtype in (torch.bfloat16, torch.float32):
        traced = {
            device: trace_activations(lambda: GPT(cfg), example, loss, dtype, device_type=device).activations
            for device in ("cpu", "cuda", "meta")  # "meta": nothing patched, SDPA's math path
        }
        weights = cfg.n_layers * 2 * cfg.n_heads * 512 * 512 * dtype.itemsize
        assert traced["meta"] - traced["cuda"] >= weights, (dtype, traced)
        if dtype == torch.bfloat16:
            assert 0 <= traced["cuda"] - traced["cpu"] <= 96, traced


@pytest.mark.parametrize(
    ("device", "dtype", "head", "dropout", "kv_heads", "kernel", "padded"),
    [
        ("cuda", torch.bfloat16, 24, 0.0, 3, "_scaled_dot_product_flash_attention", False),
        ("cuda", torch.bfloat16, 20, 0.0, 3, "_scaled_dot_product_flash_attention", True),
        ("cuda", torch.float32, 12, 0.0, 3, "_scaled_dot_product_efficient_attention", False),
        ("cuda", torch.float32, 14, 0.0, 3, "_safe_softmax", False),
        ("cuda", torch.float32, 12, 0.1, 3, "_scaled_dot_product_efficient_attention", False),
        ("cuda", torch.bfloat16, 24, 0.1, 3, "_scaled_dot_product_flash_attention", False),
        ("cuda", torch.bfloat16, 20, 0.0, 1, "_scaled_dot_product_flash_attention", True),
        ("cuda", torch.float32, 12, 0.0, 1, "_safe_softmax", False),
        ("cpu", torch.float32, 12, 0.0, 3, "_scaled_dot_product_flash_attention_for_cpu", False),
        ("cpu", torch.float32, 12, 0.0, 1, "_scaled_dot_product_flash_attention_for_cpu", False),
        ("cpu", torch.float32, 12, 0.1, 3, "_safe_softmax", False),
    ],
)
def test_meta_trace_of_device_attention_follows_the_kernel_sdpa_picks(
    device: str, dtype: torch.dtype, head: int, dropout: float, kv_heads: int, kernel: str, padded: bool
) -> None:
    """As SDPA chose on an H100 (torch 2.11, ``docs/estimate_cuda_sweep.md``): half precision runs
    flash, padding a head size that is no multiple of 8 (the padded copies are what it saves),
    grouped key/value heads (``enable_gqa``) as they are; float32 runs the memory-efficient
    kernel where the head size is a multiple of 16 bytes and the heads are not grouped, else the
    math path (its softmax weights saved); both CUDA kernels take dropout (GPT-2's). On CPU the
    flash kernel, grouped heads too, and the math path with dropout. The output keeps the
    caller's head size."""
    from fullshard.compat import TorchDispatchMode
    from fullshard.plan.meta_trace import device_attention

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v = (
        torch.empty(2, heads, 40, head, device="meta", dtype=dtype, requires_grad=True)
        for heads in (3, kv_heads, kv_heads)
    )
    with Ops() as ops:
        out = device_attention(device)(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=kv_heads != 3)
    assert out.shape == (2, 3, 40, head) and kernel in ops.names, ops.names
    assert ("constant_pad_nd" in ops.names) == padded, ops.names


class _Block(nn.Sequential):
    """A unit for the moment-of-the-peak test."""


class _PairBlock(nn.Module):
    """A unit returning a tuple (its output and a detached copy), as many transformers layers do."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        self.inner = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.inner(x)
        return y, y.detach()


class _Pairs(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self:
            x = m(x)[0] if isinstance(m, _PairBlock) else m(x)
        return x


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_peak_names_its_phase_and_unit(checkpoint: bool) -> None:
    """Three units, the middle one 256x wider inside: the step's peak comes when that unit's
    backward starts (its activations all alive, its input gradient being made), also when it is
    recomputed first; before any unit, the root's own layer."""
    from fullshard.plan.peak import trace_activations

    def make() -> nn.Module:
        wide = _Block(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 16))
        return nn.Sequential(nn.Linear(16, 16), _Block(nn.Linear(16, 16)), wide, _Block(nn.Linear(16, 16)))

    def is_block(m: nn.Module) -> bool:
        return isinstance(m, _Block)

    trace = trace_activations(
        make,
        lambda: torch.zeros(64, 16),
        lambda m, x: m(x).sum(),
        None,
        is_block if checkpoint else None,
        is_unit=is_block,
    )
    assert (trace.phase, trace.unit) == ("backward", "2"), trace

    def huge_root() -> nn.Module:  # the root's own first layer dwarfs every unit
        return nn.Sequential(nn.Linear(16, 8192), nn.ReLU(), nn.Linear(8192, 16), _Block(nn.Linear(16, 16)))

    trace = trace_activations(huge_root, lambda: torch.zeros(64, 16), lambda m, x: m(x).sum(), is_unit=is_block)
    assert (trace.phase, trace.unit) == ("backward", "<root>"), trace

    def pairs() -> nn.Module:  # the same with units that return tuples
        wide = _PairBlock(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 16))
        return _Pairs(nn.Linear(16, 16), _PairBlock(nn.Linear(16, 16)), wide, _PairBlock(nn.Linear(16, 16)))

    def is_pair(m: nn.Module) -> bool:
        return isinstance(m, _PairBlock)

    trace = trace_activations(pairs, lambda: torch.zeros(64, 16), lambda m, x: m(x).sum(), is_unit=is_pair)
    assert (trace.phase, trace.unit) == ("backward", "2"), trace


def test_the_trace_patches_keyword_attention_and_answers_only_meta_position_ids() -> None:
    """SDPA called by keyword still gets the device's kernel; transformers' packed-sequence
    check is answered for meta ids only, real ids get transformers' own answer."""
    from fullshard.plan.meta_trace import traced

    q = torch.zeros(2, 4, 16, 8, device="meta")
    with traced("cpu"):
        out = torch.nn.functional.scaled_dot_product_attention(query=q, key=q, value=q, is_causal=True)
    assert out.shape == q.shape and out.is_meta
    masking = pytest.importorskip("transformers.masking_utils")
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with traced("cpu"):
        assert masking.find_packed_sequence_indices(packed.to("meta")) is None
        assert masking.find_packed_sequence_indices(packed).tolist() == [[0, 0, 0, 1, 1, 1]]


def test_a_value_read_in_the_meta_trace_names_the_problem() -> None:
    from fullshard.plan.meta_trace import MetaValueRead
    from fullshard.plan.peak import trace_activations

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if x.sum() > 0 else -self.fc(x)

    with pytest.raises(MetaValueRead, match="the model reads a tensor's value in forward or backward"):
        trace_activations(Branchy, lambda: torch.zeros(2, 4), lambda m, x: m(x).sum())


def test_peak_counts_resident_gradient_shards_and_the_receive_buffer() -> None:
    """On gloo each unit keeps its gradient shard between steps, and a reduce-scatter in flight
    holds its receive buffer above 2 ranks (the whole input; at 2 ranks it receives straight
    into the gradient shard, issue 33) once there are two units; on NCCL neither: gradients
    count as far as the trace had produced them."""
    from fullshard.plan.estimate import UnitEstimate
    from fullshard.plan.peak import Trace, combine, grad_scale

    def units(n: int, world: int) -> list[UnitEstimate]:
        full = 4000
        return [UnitEstimate("<root>", 10, 40 // world, 40 // world, 0, 40)] + [
            UnitEstimate(f"b{i}", 1000, full // world, full // world, 0, full) for i in range(n)
        ]

    traced = Trace(500, 0.25, "backward")
    two = combine(units(2, 2), traced, 2, backend="gloo")
    # at 2 ranks the reduce-scatter receives straight into the gradient shards: no receive buffer
    assert two.gradients == 20 + 2 * 2000 and two.gradient_buffer == 4000
    assert combine(units(2, 4), traced, 4, backend="gloo").gradient_buffer == 4000 + 4000
    assert combine(units(1, 2), traced, 2, backend="gloo").gradient_buffer == 4000  # one unit: no overlap
    nccl = combine(units(2, 2), traced, 2, backend="nccl")
    assert nccl.gradients == round(0.25 * (20 + 2 * 2000)) and nccl.gradient_buffer == 4000
    assert combine(units(2, 2), traced, 2, no_shard=True).gradient_buffer == 0
    assert grad_scale(2, False, "gloo") == 0.0 and grad_scale(4, False, "nccl") == 0.25
    assert grad_scale(2, True, "gloo") == 1.0 and grad_scale(1, False, "gloo") == 1.0


def test_cpu_offload_moves_model_state_to_the_host_on_cuda_only() -> None:
    """Under CPU offload on NCCL the device holds no shards, gradients or optimizer state (they
    are host bytes, outside the device's peak) but one shard staged each way: the upload before
    a gather and the gradient shard before its download. On gloo offload changes nothing."""
    from fullshard.plan.estimate import UnitEstimate
    from fullshard.plan.peak import Trace, combine, grad_scale

    # 1000 float32 parameters per block, gathered in bf16 (2000 bytes in full, 2000 per shard)
    units = [UnitEstimate("<root>", 10, 20, 20, 40, 20)] + [
        UnitEstimate(f"b{i}", 1000, 2000, 2000, 4008, 2000) for i in range(2)
    ]
    traced = Trace(500, 0.0, "backward")
    plain = combine(units, traced, 2, backend="nccl")
    off = combine(units, traced, 2, backend="nccl", offload=True)
    assert (off.shards, off.gradients, off.optimizer) == (0, 0, 0)
    assert off.host == (20 + 2 * 2000) + (20 + 2 * 2000) + (40 + 2 * 4008)
    # the float32 shard is uploaded before its cast, the gradient cast back before its download
    assert off.gathered == plain.gathered + 2000 and off.gradient_buffer == plain.gradient_buffer + 2000
    assert off.total == plain.total - plain.shards - plain.gradients - plain.optimizer + 2 * 2000
    assert combine(units, traced, 2, backend="gloo", offload=True) == combine(units, traced, 2, backend="gloo")
    assert grad_scale(4, False, "nccl", offload=True) == 0.0 and grad_scale(4, False, "gloo", offload=True) == 0.0


def test_cpu_offload_at_one_rank_still_gathers_a_full_copy() -> None:
    """One rank normally computes on its shard itself (nothing gathered); under offload the shard
    is on the host, so the device holds an uploaded full copy and the packed gradient."""
    from fullshard.plan.estimate import estimate_model_state
    from fullshard.plan.peak import Trace, combine

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    linear = lambda m: isinstance(m, nn.Linear)  # noqa: E731
    assert [u.full_bytes for u in estimate_model_state(model, linear, 1)] == [0, 0, 0]
    units = estimate_model_state(model, linear, 1, offload=True)
    # 20 float32 per unit, the weight's 16 and the bias's 4 each padded to 64 bytes at one rank
    assert [u.full_bytes for u in units] == [0, 128, 128]  # the root owns no parameters
    off = combine(units, Trace(500, 0.0, "backward"), 1, backend="nccl", offload=True)
    assert off.gathered == 128 + 128 + 128 and off.gradient_buffer == 128 + 128
    # per unit: shard 128, gradient 128, AdamW's two moments 2 x 80 and a 4-byte step per tensor
    assert off.host == 2 * (128 + 128 + 2 * 80 + 2 * 4)


class _GroupedAttention(nn.Module):
    """Causal self-attention with 6 query heads over 2 key/value heads, as transformers calls
    SDPA for grouped heads without a mask (``enable_gqa=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(24, 6 * 12), nn.Linear(24, 2 * 2 * 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 6, 12).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, 2, 12).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, t, 72)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_trace_of_grouped_query_attention_equals_the_cpu_step(dtype: torch.dtype) -> None:
    """CPU runs grouped heads through its flash kernel (saving q, the 2-head k and v, the output
    and the log-sum-exp, no B x H x T x T weights): the trace's bytes are the real step's to the
    byte, and SDPA's math path on meta would save at least the 2 x 6 x 40 x 40 weights more."""
    from fullshard.plan.peak import trace_activations

    def example() -> torch.Tensor:
        return torch.zeros(2, 40, 24)

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).float().sum()

    traced = trace_activations(_GroupedAttention, example, loss, dtype).activations
    held: list[torch.Tensor] = []  # the caller's float32 batch, alive beside its cast copy

    def cast_example() -> torch.Tensor:
        held.append(example())
        return held[-1].to(dtype)

    measured = _real_step_activations(_GroupedAttention().to(dtype), cast_example, loss)
    assert traced == measured, (traced, measured)
    math_path = trace_activations(_GroupedAttention, example, loss, dtype, device_type="meta").activations
    assert math_path - traced >= 2 * 6 * 40 * 40 * dtype.itemsize, (math_path, traced)
