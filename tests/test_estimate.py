"""``fullshard estimate``: the CLI over the meta-device estimator (nothing allocated)."""

from __future__ import annotations

import pytest
from torch import nn


def make_mlp() -> nn.Module:
    """A module:factory model for the CLI: two Linear units and a root holding nothing."""
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def test_estimate_gpt_preset_prints_the_categories_and_the_peak(capsys: pytest.CaptureFixture[str]) -> None:
    from fullshard.jobs.planning import cli, validate

    assert cli.main(["--model", "gpt:tiny", "--batch-size", "16", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    expected = validate.predict(validate.Config("gpt-tiny", 2))
    assert f"| **peak** (in backward of <root>) | **{expected.total / 2**20:,.2f}** |" in out, out
    for name in ("parameter shards", "optimizer state", "gathered full parameters", "activations"):
        assert name in out
    assert "5 FSDP units; the largest (blocks.0)" in out


def test_estimate_a_user_factory(capsys: pytest.CaptureFixture[str]) -> None:
    from fullshard.jobs.planning import cli

    args = ["--model", "test_estimate:make_mlp", "--input-shape", "32,64", "--wrap-cls", "Linear", "--world-size", "4"]
    assert cli.main([*args, "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    # Shards: 64 x 256 + 256 and 256 x 64 + 64 elements in chunks of ceil(rows / 4) rows, fp32.
    shards = 4 * (64 * 64 + 64) + 4 * (16 * 256 + 16)
    assert f"| parameter shards | {shards / 2**20:,.2f} |" in out and "| optimizer state | 0.00 |" in out, out
    assert "3 FSDP units; the largest (0)" in out


def test_estimate_hf_models(capsys: pytest.CaptureFixture[str]) -> None:
    """``hf:NAME``: the HF job's configs, sharded by decoder layer as the job shards them, and a
    transformers class from its default config (GPT-2 small: 12 GPT2Blocks), traced on meta."""
    pytest.importorskip("transformers")
    from fullshard.jobs.planning import cli, validate

    assert cli.main(["--model", "hf:llama-tiny", "--batch-size", "16", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    expected = validate.predict(validate.Config("llama-tiny", 2))
    assert f"| **peak** (in {expected.moment}) | **{expected.total / 2**20:,.2f}** |" in out, out
    assert "5 FSDP units; the largest (model.model.layers.0)" in out, out
    assert cli.main(["--model", "hf:GPT2LMHeadModel", "--batch-size", "1", "--seq-len", "64", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    # 124,439,808 parameters (the tied embedding once) over 8 ranks in float32, padding aside
    shards = float(out.split("| parameter shards | ")[1].split(" |")[0].replace(",", ""))
    assert 124_439_808 * 4 / 8 / 2**20 <= shards < 124_439_808 * 4 / 8 / 2**20 + 0.01, out
    assert "13 FSDP units" in out, out


def test_estimate_cpu_offload(capsys: pytest.CaptureFixture[str]) -> None:
    """``--cpu-offload`` on nccl: model state as host memory, none of it on the device; on
    gloo it changes nothing and says so."""
    from fullshard.jobs.planning import cli

    base = ["--model", "gpt:tiny", "--batch-size", "4", "--world-size", "2"]
    assert cli.main([*base, "--backend", "nccl"]) == 0
    plain = capsys.readouterr().out
    assert cli.main([*base, "--backend", "nccl", "--cpu-offload"]) == 0
    off = capsys.readouterr().out

    def row(out: str, name: str) -> float:
        return float(out.split(f"| {name}")[1].split("|")[1].replace(",", ""))

    assert row(off, "parameter shards") == row(off, "optimizer state") == 0.0
    host = row(plain, "parameter shards") * 2 + row(plain, "optimizer state")  # gradient shards = parameter shards
    assert row(off, "host memory (CPU offload") == pytest.approx(host, abs=0.02), off
    assert cli.main([*base, "--cpu-offload"]) == 0  # gloo
    out = capsys.readouterr().out
    assert "--cpu-offload has no effect on gloo" in out and "host memory" not in out
    # NO_SHARD with offload: on gloo offload moves nothing (in the engine too), so the estimate is
    # NO_SHARD's; on nccl it is not modeled, and refused naming the options
    no_shard = [*base, "--sharding-strategy", "no_shard"]
    assert cli.main(no_shard) == 0
    kept = capsys.readouterr().out
    assert cli.main([*no_shard, "--cpu-offload"]) == 0
    out = capsys.readouterr().out
    assert "--cpu-offload has no effect on gloo" in out and out.split("\n", 1)[1] == kept
    with pytest.raises(SystemExit):
        cli.main([*no_shard, "--cpu-offload", "--backend", "nccl"])
    err = capsys.readouterr().err
    assert (
        "--cpu-offload with --sharding-strategy no_shard on nccl is not modeled" in err and "drop --cpu-offload" in err
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt:huge"], "presets are gpt:tiny"),
        (["--model", "nothing"], "give gpt:PRESET, mnist, hf:NAME, or module.path:factory"),
        (["--model", "hf:NoSuchModel"], "use one of llama-tiny, gpt2-tiny or a transformers causal-LM class"),
        (["--model", "hf:LlamaModel"], "use one of llama-tiny, gpt2-tiny or a transformers causal-LM class"),
        (["--model", "hf:gpt2-tiny", "--wrap-cls", "Foo"], "['Foo'] match no module of CausalLMLogits"),
        (["--model", "no_such_module:f", "--input-shape", "1", "--wrap-cls", "X"], "No module named 'no_such_module'"),
        (["--model", "mnist", "--world-size", "0"], "--world-size and --batch-size must be at least 1"),
        # a module:factory model's options, checked on a meta build and forward (they gave a
        # root-only estimate, int()'s error and the model's traceback)
        (
            ["--model", "test_estimate:make_mlp", "--input-shape", "32,64", "--wrap-cls", "NoSuchLayer"],
            "--wrap-cls NoSuchLayer: no module of test_estimate:make_mlp is of that class; its classes are "
            "Sequential, Linear, ReLU",
        ),
        (
            ["--model", "test_estimate:make_mlp", "--input-shape", "32,a", "--wrap-cls", "Linear"],
            "--input-shape '32,a': give positive integers separated by commas",
        ),
        (
            ["--model", "test_estimate:make_mlp", "--input-shape", "32,65", "--wrap-cls", "Linear"],
            "--input-shape 32,65: the model's forward failed on a float tensor of that shape (RuntimeError: ",
        ),
    ],
)
def test_estimate_rejects_bad_models(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from fullshard.jobs.planning import cli

    if args[1].startswith("hf:"):
        pytest.importorskip("transformers")
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err
