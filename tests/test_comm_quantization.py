"""Quantized collectives (issue 33): the quantizer's error bounds, the bytes counted, both front
ends at world sizes 1-4, and quantization off taking exactly the old path."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from dist import patched, run_ranks
from models import Block, batch, local, make_stack

from fullshard import CommQuantization, probes
from fullshard.comm import quantize

# ---------------------------------------------------------------- the quantizer (one process)


def _row(numel: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values spanning six orders of magnitude, with a run of zeros (whole blocks of 256 from
    1000 elements on) after the first third."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 10 ** (torch.rand(numel, generator=g) * 6 - 3)
    x[numel // 3 : numel // 3 + (520 if numel >= 1000 else 40)] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("block_size", [16, 100, 256])
def test_round_trip_error_at_most_half_a_scale(block_size: int) -> None:
    for numel in (1, 5, 255, 256, 257, 1000, quantize.CHUNK + 77):
        for dtype in (torch.float32, torch.bfloat16):
            x = _row(numel, numel + block_size, dtype)
            row = torch.full((quantize.packed_bytes(numel, block_size),), 255, dtype=torch.uint8)
            quantize.quantize_into(x, row, block_size)
            nb = quantize.blocks(numel, block_size)
            assert row.numel() == 4 * nb + -(-numel // 4) * 4
            assert (row[4 * nb + numel :] == 0).all()  # the padding goes out as zeros
            out = torch.empty(1, numel)
            quantize.dequantize_into(row.view(1, -1), out, block_size)
            scales = row[: 4 * nb].view(torch.float32)
            padded = torch.zeros(nb * block_size)
            padded[:numel] = x.float()
            amax = padded.view(nb, block_size).abs().amax(dim=1)
            assert torch.equal(scales, amax / 127)
            err = (out[0] - x.float()).abs()
            bound = scales.repeat_interleave(block_size)[:numel] / 2
            slack = x.float().abs() * 2**-22  # float32 rounding of q * scale itself
            assert (err <= bound + slack).all(), (numel, dtype, (err - bound).max())
            zero = amax == 0  # a block of zeros: scale 0, dequantized exactly
            assert zero.any() or numel < 300
            assert (out[0][zero.repeat_interleave(block_size)[:numel]] == 0).all()
            bf16 = torch.empty(1, numel, dtype=torch.bfloat16)  # dequantized straight into param_dtype
            quantize.dequantize_into(row.view(1, -1), bf16, block_size)
            assert torch.equal(bf16, out.to(torch.bfloat16))


def test_blocks_never_span_segments() -> None:
    segments, block = [3, 300, 1, 257], 128  # a layer norm's weights between weight matrices
    x = torch.cat([torch.full((3,), 1.0), _row(300, 1) * 1e-3, torch.full((1,), -50.0), _row(257, 2) * 1e-2])
    row = torch.empty(quantize.packed_bytes(x.numel(), block, segments), dtype=torch.uint8)
    assert row.numel() == 4 * (1 + 3 + 1 + 3) + 564
    quantize.quantize_into(x, row, block, segments=segments)
    out = torch.empty(1, x.numel())
    quantize.dequantize_into(row.view(1, -1), out, block, segments)
    start = 0
    for n in segments:  # each segment within half of its own blocks' scales
        part, got = x[start : start + n], out[0, start : start + n]
        assert ((got - part).abs() <= part.abs().max() / 254 * (1 + 1e-6)).all(), n
        start += n
    assert torch.equal(out[0, :3], x[:3]) and out[0, 303] == -50.0  # alone in their blocks: exact
    total = torch.empty(x.numel())
    quantize.dequantize_sum_into(torch.stack([row, row]), x, total, block, divide_by=3.0, segments=segments)
    assert torch.allclose(total, (x + 2 * out[0]) / 3, rtol=1e-6, atol=1e-9)


def test_stochastic_rounding_is_unbiased_and_within_one_scale() -> None:
    x, block, draws = _row(600, 3), 64, 400
    g = torch.Generator().manual_seed(0)
    default_rng = torch.get_rng_state()
    row = torch.empty(quantize.packed_bytes(x.numel(), block), dtype=torch.uint8)
    out, total = torch.empty(1, x.numel()), torch.zeros(x.numel(), dtype=torch.float64)
    for _ in range(draws):
        quantize.quantize_into(x, row, block, generator=g)
        quantize.dequantize_into(row.view(1, -1), out, block)
        scale = row[: 4 * quantize.blocks(x.numel(), block)].view(torch.float32).repeat_interleave(block)[: x.numel()]
        assert ((out[0] - x).abs() < scale * (1 + 1e-6) + 1e-30).all()
        total += out[0]
    assert torch.equal(torch.get_rng_state(), default_rng)  # torch's default generator untouched
    bias = (total / draws - x).abs()
    # the mean of 400 draws: standard error <= scale / 40; the 8-bit dither adds <= scale / 512
    assert (bias <= scale * (4 / 40 + 1 / 512) + 1e-30).all(), (bias / scale.clamp_min(1e-30)).max()
    nearest = torch.empty_like(row)
    quantize.quantize_into(x, nearest, block)
    assert not torch.equal(nearest, row)  # it did round stochastically


@pytest.mark.parametrize("stochastic", [False, True])
def test_blocks_at_the_ends_of_float32s_range(stochastic: bool) -> None:
    """Blocks whose largest magnitude is tiny (127 / amax overflows; the scale is subnormal or
    0) or within an ulp of float32's largest value (amax / 127 rounded up would make 127 * scale
    infinite) keep the error bound and dequantize finite; a block holding inf stays non-finite."""
    top = torch.finfo(torch.float32).max
    cases = {
        "tiny": [1e-37, -5e-38, 0.0, 2e-38],
        "subnormal": [1e-40, -1e-40, 0.0, 5e-41],
        "below any scale": [1e-44, -1e-45, 0.0, 0.0],
        "top": [top, 1.0, -3e38, 2.0],
        "normal": [0.3, -0.1, 0.0, 0.05],
    }
    g = torch.Generator().manual_seed(0) if stochastic else None
    for name, values in cases.items():
        x = torch.tensor(values)
        row = torch.empty(quantize.packed_bytes(4, 16), dtype=torch.uint8)
        quantize.quantize_into(x, row, 16, generator=g)
        out = torch.empty(1, 4)
        quantize.dequantize_into(row.view(1, -1), out, 16)
        scale = row[:4].view(torch.float32)
        assert torch.isfinite(out).all(), (name, out)
        bound = scale * (1.0 if stochastic else 0.5) * (1 + 1e-6) + (1e-44 if name == "below any scale" else 0.0)
        assert ((out[0].double() - x.double()).abs() <= bound.double()).all(), (name, out, scale)
        assert (row[4:8].view(torch.int8).abs() <= 127).all()
    x = torch.tensor([float("inf"), 1.0])
    row = torch.empty(quantize.packed_bytes(2, 16), dtype=torch.uint8)
    quantize.quantize_into(x, row, 16, generator=g)
    out = torch.empty(1, 2)
    quantize.dequantize_into(row.view(1, -1), out, 16)
    assert not torch.isfinite(out).any()  # an overflow stays visible


def test_local_sums() -> None:
    c, block = 1001, 256  # not a multiple of the block size
    own = _row(c, 7)
    others = [_row(c, 8 + r) for r in range(3)]
    rows = torch.empty(3, quantize.packed_bytes(c, block), dtype=torch.uint8)
    bound = torch.zeros(c)
    for r, o in enumerate(others):
        quantize.quantize_into(o, rows[r], block)
        bound += rows[r, : 4 * quantize.blocks(c, block)].view(torch.float32).repeat_interleave(block)[:c] / 2
    out = torch.empty(c)
    quantize.dequantize_sum_into(rows, own, out, block, divide_by=4.0)
    exact = (own + sum(others)) / 4
    assert ((out - exact).abs() <= bound / 4 * (1 + 1e-5) + 1e-6).all()
    bf = torch.stack(others).to(torch.bfloat16)
    quantize.sum_into(bf, own, out, divide_by=4.0)
    assert torch.allclose(out, (own + bf.float().sum(0)) / 4, rtol=1e-6, atol=1e-7)


def test_bad_arguments_rejected() -> None:
    from fullshard.jobs.train.gpt import GPTJobConfig

    for kwargs, error, words in [
        ({"params": "int4"}, ValueError, "params='int4'"),
        ({"grads": "fp8"}, ValueError, "grads='fp8'"),
        ({"params": None, "grads": None}, ValueError, "comm_quantization=None"),
        ({"block_size": 8}, ValueError, "block_size=8"),
        ({"block_size": 256.0}, TypeError, "block_size=256.0"),
        ({"block_size": True}, TypeError, "block_size=True"),
    ]:
        with pytest.raises(error, match=words.replace("(", r"\(")):
            CommQuantization(**kwargs)
    assert CommQuantization.from_spec("on") == CommQuantization()
    assert CommQuantization.from_spec("INT8") == CommQuantization(params="int8", grads="int8")
    assert CommQuantization.from_spec("params=none, grads=int8,block_size=64") == CommQuantization(None, "int8", 64)
    for spec, words in [
        ("int4", "not key=value"),
        ("params=int8,size=3", "'size=3'"),
        ("block_size=x", "x"),
        ("block_size=\u00b2", "is not a whole number"),
        ("params=int8,params=none", "params is given twice"),
    ]:
        with pytest.raises(ValueError, match=words):
            CommQuantization.from_spec(spec)
    with pytest.raises(ValueError, match="--comm-quant 'grads=fp4'"):
        GPTJobConfig(comm_quant="grads=fp4")
    with pytest.raises(ValueError, match="--plan auto with --comm-quant"):
        GPTJobConfig(comm_quant="on", plan="auto", memory_budget="1GiB")
    assert GPTJobConfig(comm_quant="params=int8").comm_quant == "params=int8"


# ---------------------------------------------------------------- on ranks


def _wrap(ref, api: str, quant, **kw):
    from fullshard import FSDP, fully_shard
    from fullshard.frontend.wrap import ModuleWrapPolicy

    model = copy.deepcopy(ref)
    extra = {} if quant == "absent" else {"comm_quantization": quant}
    if api == "fsdp1":
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **extra, **kw)
    for b in model.blocks:
        fully_shard(b, **extra, **kw)
    return fully_shard(model, **extra, **kw)


def _units(model):
    from fullshard.engine.hooks import fsdp_state

    return list({id(s.unit): s.unit for m in model.modules() if (s := fsdp_state(m)) is not None}.values())


def _train(model, rank: int, world: int, steps: int = 2, lr: float = 0.05):
    """SGD with momentum on this rank's share of the global batch; the full parameters each
    Block's Linear saw in its forwards, and the probes of the run."""
    seen: list[torch.Tensor] = []
    hooks = [b.lin.register_forward_hook(lambda m, i, o: seen.append(m.weight.detach().clone())) for b in model.blocks]
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    with probes.enabled(collective_log=True) as p:
        for step in range(steps):
            x, y = batch(step, 12)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(local(x, rank, world)).float(), local(y, rank, world)).backward()
            opt.step()
    for h in hooks:
        h.remove()
    return seen, p


def _full(model) -> dict[str, torch.Tensor]:
    from fullshard import FSDP

    if isinstance(model, FSDP):
        return {k: v.clone() for k, v in model.state_dict().items()}
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _check_bytes(model, p, quant: CommQuantization, world: int) -> None:
    """Every quantized collective counted with its real int8 + scale (or bf16) bytes."""
    block = quant.block_size
    units = [u for u in _units(model) if u.shard_numel]
    log = p.collectives.log or []
    gathers = [(dt, n) for op, dt, n in log if op == "all_gather"]
    exchanges = [(dt, n) for op, dt, n in log if op == "all_to_all"]
    assert not [op for op, _, _ in log if op == "reduce_scatter"] or quant.grads is None
    if quant.params == "int8":
        pieces = {
            quantize.packed_bytes(length, block, u._run_sizes[k])
            for u in units
            for k, (_, _, length) in enumerate(u._pieces)
        }
        assert gathers and all(dt == torch.uint8 and n in pieces for dt, n in gathers), (gathers, pieces)
    want = sum(n * (world - 1) * (1 if dt == torch.uint8 else 4) for dt, n in gathers)
    assert p.collectives.bytes_sent["all_gather"] == want
    if quant.grads is not None:
        if quant.grads == "int8":
            segments = [[sp.spec.padded_shard_numel for sp in u.trainable] for u in units]
            sizes = {(world - 1) * quantize.packed_bytes(u.grad_numel, block, seg) for u, seg in zip(units, segments)}
            assert all(dt == torch.uint8 for dt, _ in exchanges)
        else:
            sizes = {(world - 1) * u.grad_numel for u in units}
            assert all(dt == torch.bfloat16 for dt, _ in exchanges)
        assert exchanges and all(n in sizes for _, n in exchanges), (exchanges, sizes)
        item = 1 if quant.grads == "int8" else 2
        assert p.collectives.bytes_sent["all_to_all"] == sum(n * item for _, n in exchanges)


# What each world size runs (the whole grid at 2 ranks; one case each elsewhere, to stay fast).
_CONFIGS = [CommQuantization("int8", None, 16), CommQuantization(None, "bf16"), CommQuantization("int8", "int8", 16)]
_GRID = {
    1: {"fsdp1": _CONFIGS[2:]},
    2: {"fsdp1": _CONFIGS, "fsdp2": _CONFIGS},
    3: {"fsdp2": _CONFIGS[2:]},
    4: {"fsdp1": _CONFIGS[2:]},
}


def quantized_body(rank: int, world: int) -> list[str]:
    from fullshard import MixedPrecision, distributed
    from fullshard.engine.unit import TrainingState

    ref = make_stack(scale_shape=(1,))
    checked = []
    for api, quants in _GRID[world].items():
        exact = _wrap(ref, api, None)
        exact_seen, _ = _train(exact, rank, world)
        exact_full = _full(exact)
        for quant in quants:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = _wrap(ref, api, quant)
            warned = any("comm_quantization has no effect" in str(w.message) for w in caught)
            assert warned == (world == 1)
            seen, p = _train(model, rank, world)
            assert all(u.training_state is TrainingState.IDLE for u in _units(model))
            full = _full(model)
            if world == 1:  # nothing is communicated: exactly the unquantized run
                assert all(torch.equal(full[k], exact_full[k]) for k in full)
                continue
            _check_bytes(model, p, quant, world)
            # every rank computes with the same full parameters, bit for bit
            theirs = distributed.all_gather_object(seen, distributed.default_group())
            assert all(torch.equal(a, b) for other in theirs for a, b in zip(seen, other))
            if quant.params == "int8":  # first step: within half a block scale of the exact weights
                for got, want in zip(seen[:4], exact_seen[:4]):
                    # blocks never span parameters: the weight's own largest magnitude bounds its scales
                    bound = want.abs().max() / 254 * (1 + 1e-6)
                    err = (got - want).abs().max()
                    assert 0 < err <= bound, (api, quant, err, bound)
            else:
                assert all(torch.equal(a, b) for a, b in zip(seen[:4], exact_seen[:4]))
            # after 2 steps: off the exact run by a small part of how far training moved (measured
            # 1-6% with int8 parameters in blocks of 16, under 0.4% with bf16 gradients)
            start = ref.state_dict()
            drift = max(((full[k] - exact_full[k]).norm() / (exact_full[k] - start[k]).norm()).item() for k in full)
            assert drift < 0.1, (api, quant, drift)
            checked.append(f"{api} {quant.params}/{quant.grads}")
    if world != 2:
        return checked
    # mixed precision composes: dequantized into param_dtype; the shards stay float32 masters
    model = _wrap(ref, "fsdp1", _CONFIGS[2], mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    before = [p.detach().clone() for p in model.parameters()]
    seen, _ = _train(model, rank, world, steps=1, lr=0.0)
    assert all(s.dtype == torch.bfloat16 for s in seen)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return checked


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_quantized_training(world: int) -> None:
    checked = run_ranks(quantized_body, world, timeout=280)[0]
    assert len(checked) == (0 if world == 1 else sum(len(q) for q in _GRID[world].values()))


def _no_quantized(*args, **kwargs):
    raise AssertionError("a quantized collective ran with comm_quantization=None")


def off_body(rank: int, world: int) -> list[str]:
    from fullshard import FSDP, distributed
    from fullshard.comm import collectives, quantized

    ref = make_stack(scale_shape=(1,))
    done = []
    with patched(quantized, all_gather_int8=_no_quantized, reduce_scatter_quantized=_no_quantized):
        for api in ("fsdp1", "fsdp2"):
            default, none = _wrap(ref, api, "absent"), _wrap(ref, api, None)
            _, p_default = _train(default, rank, world)
            _, p_none = _train(none, rank, world)
            assert p_default.collectives.log == p_none.collectives.log
            moved = [(op, dt) for op, dt, _ in p_none.collectives.log or [] if op != "all_gather_object"]
            # fully_shard's: one all-reduce of a flag per parameter too (reduce_order.settle_unused)
            settle = {"all_reduce"} if api == "fsdp2" else set()
            assert {op for op, _ in moved} == {"all_gather", "reduce_scatter"} | settle
            assert all(dt == torch.float32 for _, dt in moved)
            a, b = _full(default), _full(none)
            assert all(torch.equal(a[k], b[k]) for k in a)
            if api == "fsdp1":
                assert none.comm_quantization is None
            done.append(api)
    for bad, front in [("int8", "FullyShardedDataParallel"), ({"params": "int8"}, "fully_shard")]:
        with pytest.raises(TypeError, match=f"{front}: comm_quantization="):
            if front == "fully_shard":
                _wrap(ref, "fsdp2", bad)
            else:
                FSDP(copy.deepcopy(ref), comm_quantization=bad)
    # the all-to-all the int8 reduce-scatter uses: the own part stays home
    send = torch.arange((world - 1) * 3, dtype=torch.float32) + 100 * rank
    got = torch.empty_like(send)
    collectives.all_to_all(got, send, distributed.default_group())
    parts = []
    for s in (r for r in range(world) if r != rank):
        i = rank if rank < s else rank - 1  # our part's place in sender s's list (s skips itself)
        parts.append(torch.arange(3 * i, 3 * i + 3, dtype=torch.float32) + 100 * s)
    expect = torch.cat(parts)
    assert torch.equal(got, expect)
    return done


@pytest.mark.timeout(200)
def test_quantization_off_takes_the_exact_path() -> None:
    assert run_ranks(off_body, 2, timeout=180)[0] == ["fsdp1", "fsdp2"]


def mismatch_body(rank: int, world: int) -> list[str]:
    """Ranks that pass different settings fail on every rank at the first forward, naming the
    setting, before any collective pairs a quantized buffer with an exact one."""
    ref = make_stack(scale_shape=(1,))
    messages = []
    for api, mine in [
        ("fsdp1", CommQuantization() if rank == 0 else None),
        ("fsdp2", CommQuantization(block_size=16 if rank == 0 else 32)),
    ]:
        model = _wrap(ref, api, mine)
        with pytest.raises(RuntimeError, match="set up differently across ranks") as caught:
            model(batch(0, 4)[0])
        messages.append(str(caught.value))
    return messages


@pytest.mark.timeout(120)
def test_ranks_with_different_quantization_fail_at_the_first_forward() -> None:
    for messages in run_ranks(mismatch_body, 2, timeout=100):
        on = "CommQuantization(params='int8', grads='bf16', block_size=256)"
        assert f"rank 0: comm_quantization={on}; " in messages[0]
        assert "rank 1: comm_quantization=None)" in messages[0]
        assert "block_size=16); rank 1: comm_quantization=CommQuantization(" in messages[1]
        assert all("param_dtype" not in m and "every rank must pass the same" in m for m in messages)


def test_bench_compare_quantized_row_and_targets() -> None:
    from fullshard.jobs.bench.compare import compare_table, row_order, target_lines
    from fullshard.jobs.bench.workloads import FLOOR, FULLY_SHARD, QUANTIZED

    def figures(step: float, sent: int) -> dict:
        return {
            "step_s": step,
            "cpu_s": step,
            "items_per_s": 16 / step,
            "peak_rss": 2**30,
            "state_bytes": 2**28,
            "gathered_bytes": 0,
            "bytes_sent": sent,
            "params": 10**6,
            "world": 2,
            "device": "cpu",
            "largest_unit_bytes": 2**20,
        }

    results = {
        "fullshard": figures(1.4, 1000),
        FULLY_SHARD: figures(1.4, 1000),
        "torch FSDP2": figures(2.7, 1500),
        "DDP": figures(2.0, 800),
        FLOOR: figures(1.1, 0),
        QUANTIZED: {**figures(1.1, 300), "comm_quant": "on"},
    }
    assert row_order(results) == ["fullshard", QUANTIZED, FULLY_SHARD, "torch FSDP2", "DDP", FLOOR]
    table = compare_table("memory", results)
    assert "| fullshard quantized | 1.100" in table and "`--comm-quant on`" in table
    lines = target_lines("memory", results)
    assert "- issue 33: quantized bytes sent vs fullshard's: 0.30x (target at most 0.35x): met" in lines
    assert "- issue 33: quantized step vs DDP: 0.55x (target at most 0.6x): met" in lines
    del results[QUANTIZED]
    assert not any("issue 33" in line for line in target_lines("memory", results))
