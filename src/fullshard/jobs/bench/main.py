"""``fullshard bench``: timings of fullshard configurations on this machine, as ratios.

``fullshard bench optimizer [--numel 62000000]`` times one CPU AdamW step over one rank's shards
(the step that CPU offload moves to the host) for the for-loop, foreach and fused variants.

``fullshard bench gpu`` measures the GPT presets on one CUDA device (see :mod:`fullshard.jobs.bench.gpu`).

``fullshard bench estimate`` predicts each configuration's peak live tensor bytes per rank and
measures it on three real steps (see :mod:`fullshard.jobs.planning.validate`).
``fullshard bench estimate --sweep [N] [--seed S]`` does it on N (default 40) configurations
drawn at random from seed S (default: drawn from the clock, printed), across model families,
sharding, activation checkpointing, precision, world size and front end
(see :mod:`fullshard.jobs.planning.sweep_bench`); ``--families resnet`` (names separated by
commas) draws among those families instead of the default ones (the ResNet is drawn only so).

``fullshard bench estimate --sweep [N] [--seed S] --device cuda`` measures the same draws at world
size 1 on one CUDA device in this process, predicted for NCCL, with and without CPU offload
(``--device cpu``: on gloo, the same way; see :func:`~fullshard.jobs.planning.sweep_device.device_report`).

``fullshard bench plan`` measures the planner's choice against the hand configurations on fixed
workloads (see :mod:`fullshard.jobs.planning.plan_bench`); ``fullshard bench plan --sweep [N]
[--seed S] [--rounds R]`` on N model/budget pairs drawn from the estimator sweep's generator,
tight budgets included (see :mod:`fullshard.jobs.planning.plan_sweep`).

``fullshard bench recorder [--calls 2000] [--rounds 2] [--nproc 2]`` times one-element all-reduces
with nothing, the flight recorder, and the recorder with the watchdog and divergence check, taking
turns: what each adds to a collective (see :mod:`fullshard.jobs.bench.recorder`).

``fullshard bench compile [--compare compute] [--backend inductor]`` times fullshard's and torch's
fully_shard with and without per-block torch.compile (see :mod:`fullshard.jobs.bench.compiled`).

``fullshard bench save [--shapes wide memory] [--rounds 3] [--nproc 2] [--dir DIR]`` times a
checkpoint save of memory-bound GPTs and what its checksums cost (see :mod:`fullshard.jobs.bench.save`).

``fullshard bench prefetch [--nproc 2] [--steps 12]`` trains a stack of large Linear layers
(communication-heavy: many parameters, small batch) with FULL_SHARD under each prefetch setting
and prints the median step time of each, with its ratio to the no-prefetch run. Timings belong
here and in BENCHMARKS.md, never in test assertions.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from fullshard.engine.config import CommQuantization
from fullshard.jobs.bench import compare, compiled, gpu, micro, report
from fullshard.jobs.bench.workloads import COMPARE_WORKLOADS


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fullshard bench``: parse ``argv`` (default: ``sys.argv[1:]``), run the
    benchmark it names and print its section; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["gpu"]:
        return _gpu_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.workload == "compare":
        return _compare_main(args, argv)
    if args.workload == "compile":
        section = compiled.run(args.compare, args.backend, args.steps, args.warmup, args.rounds, args.nproc)
        print(f"`fullshard bench {' '.join(argv)}`\n\n{section}")
        return 0
    if args.workload == "optimizer":
        print("\n".join(micro.optimizer_report(args.numel)))
        return 0
    if args.workload == "estimate":
        return _estimate_main(args)
    if args.workload == "plan":
        return _plan_main(args)
    if args.workload == "steptime":
        from fullshard.jobs.planning import validate_time

        print("\n".join(validate_time.report()))
        return 0
    if args.workload == "save":
        from fullshard.jobs.bench import save

        lines = save.report(args.shapes, args.rounds, args.nproc, args.dir)
        print(f"`fullshard bench {' '.join(argv)}`\n\n" + "\n".join(lines))
        return 0
    if args.workload == "recorder":
        from fullshard.jobs.bench import recorder

        print("\n".join(recorder.report(args.calls, args.rounds, args.nproc)))
        return 0
    print("\n".join(micro.prefetch_report(args.d_model, args.layers, args.batch, args.steps, args.nproc)))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fullshard bench", description=__doc__)
    p.add_argument(
        "workload",
        choices=["prefetch", "optimizer", "compare", "compile", "gpu", "recorder", "estimate", "steptime", "plan"]
        + ["save"],
    )
    p.add_argument("--backend", default="inductor", help="compile: torch.compile's backend for each block")
    p.add_argument(
        "--compare", default="compute", choices=sorted(COMPARE_WORKLOADS), help="compare, compile: one workload"
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=sorted(COMPARE_WORKLOADS),
        help="compare: several workloads (overrides --compare)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="compare: turns per implementation, the order reversed every other round; plan --sweep: rounds of 10 "
        "interleaved steps per configuration",
    )
    p.add_argument("--write", metavar="MARKDOWN", help="compare: write the tables into this file's generated section")
    p.add_argument("--chart", metavar="PNG", help="compare: write a chart of step time and memory (needs matplotlib)")
    p.add_argument(
        "--comm-quant",
        default=None,
        metavar="SPEC",
        help="compare: add a row for the FSDP1 wrapper with quantized communication (SPEC as the training jobs' "
        "--comm-quant: on, int8, or params=int8,grads=bf16,...)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--numel", type=int, default=62_000_000, help="optimizer: elements per rank")
    p.add_argument("--calls", type=int, default=2000, help="recorder: collectives per setting and round")
    p.add_argument("--shapes", nargs="+", default=["wide", "memory"], choices=["wide", "memory"], help="save: GPTs")
    p.add_argument("--dir", default=None, help="save: where the checkpoints go (default: the temporary folder)")
    p.add_argument(
        "--sweep",
        type=int,
        nargs="?",
        const=40,
        default=None,
        metavar="N",
        help="estimate, plan: N configurations (plan: model/budget pairs) drawn at random instead of the fixed "
        "ones (default 40)",
    )
    p.add_argument("--seed", type=int, default=None, help="--sweep: the draw's seed (default: from the clock)")
    p.add_argument(
        "--families",
        default=None,
        help="estimate --sweep: draw among these model families, comma-separated (e.g. resnet; default: every "
        "family but resnet, as the sweeps before it drew)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="estimate --sweep: measure each configuration at world size 1 in this process on this device (cuda: "
        "predicted for NCCL, with and without CPU offload, the allocator's peak beside the live bytes) instead of "
        "at its drawn world size on gloo workers",
    )
    return p


def _sweep_seed(args: argparse.Namespace, command: str, what: str) -> int:
    """The seed of ``--sweep``: ``--seed``, else drawn from the clock (printed by the report).

    Raises:
        SystemExit: ``--sweep`` below 1.
    """
    import time

    if args.sweep < 1:
        raise SystemExit(f"fullshard bench {command}: --sweep {args.sweep}: draw at least one {what}")
    return args.seed if args.seed is not None else int(time.time()) % 1_000_000


def _families(args: argparse.Namespace) -> tuple[str, ...]:
    """``--families`` as names (default: the sweep's default families).

    Raises:
        SystemExit: a name that is not a family, naming the families.
    """
    from fullshard.jobs.planning.families import DRAWN, FAMILIES

    if args.families is None:
        return DRAWN
    names = tuple(n.strip() for n in args.families.split(",") if n.strip())
    unknown = [n for n in names if n not in FAMILIES]
    if not names or unknown:
        raise SystemExit(
            f"fullshard bench estimate: --families {args.families!r}: name families among {', '.join(FAMILIES)}, "
            "separated by commas"
        )
    return names


def _estimate_main(args: argparse.Namespace) -> int:
    """``fullshard bench estimate [--sweep [N] [--seed S] [--device D]]``: print the table as it comes."""
    if args.sweep is None:
        if args.device is not None:
            raise SystemExit("fullshard bench estimate: --device measures drawn configurations: add --sweep N")
        if args.families is not None:
            raise SystemExit("fullshard bench estimate: --families chooses what --sweep draws: add --sweep N")
        from fullshard.jobs.planning import validate

        print("\n".join(validate.report()))
        return 0
    from fullshard.jobs.planning import sweep_bench, sweep_device

    seed = _sweep_seed(args, "estimate", "configuration")
    chosen = _families(args)
    if args.device is not None:
        with sweep_device.one_rank_group(args.device) as device:
            for line in sweep_device.device_report(seed, args.sweep, device, chosen):
                print(line, flush=True)
        return 0
    for line in sweep_bench.report(seed, args.sweep, chosen):
        print(line, flush=True)
    return 0


def _plan_main(args: argparse.Namespace) -> int:
    """``fullshard bench plan [--sweep [N] [--seed S] [--rounds R]]``: print the table as it comes."""
    if args.sweep is None:
        from fullshard.jobs.planning import plan_bench

        print("\n".join(plan_bench.report()))
        return 0
    from fullshard.jobs.planning import plan_sweep

    for line in plan_sweep.report(_sweep_seed(args, "plan", "model/budget pair"), args.sweep, args.rounds):
        print(line, flush=True)
    return 0


def _compare_main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``fullshard bench compare``: run, print the section, then write the chart and markdown."""
    workloads = args.workloads or [args.compare]
    if args.comm_quant is not None:
        try:
            CommQuantization.from_spec(args.comm_quant)
        except (TypeError, ValueError) as e:
            raise SystemExit(f"fullshard bench compare: --comm-quant {args.comm_quant!r}: {e}") from None
    section, all_results = compare.run_compare(
        workloads, args.steps, args.warmup, args.rounds, args.nproc, args.comm_quant
    )
    command = "fullshard bench " + " ".join(argv)
    section = f"`{command}`\n\n{section}"
    print(section)
    if args.chart:
        report.write_chart(args.chart, all_results, compare.row_order(next(iter(all_results.values()))))
        section += f"\n![step time and peak memory per implementation]({args.chart})\n"
    if args.write:
        report.write_markdown(args.write, section, report.COMPARE_BEGIN_MARK, report.COMPARE_END_MARK)
    return 0


def _gpu_main(argv: Sequence[str]) -> int:
    """``fullshard bench gpu [--preset 124m] [--offload-presets 1.3b 7b] [--write BENCHMARKS.md]``."""
    from fullshard.jobs.models.gpt import PRESETS

    p = argparse.ArgumentParser(prog="fullshard bench gpu", description=gpu.__doc__)
    p.add_argument("--preset", default="124m", choices=list(PRESETS))
    p.add_argument("--offload-presets", nargs="*", default=["124m", "350m", "1.3b", "7b"], choices=list(PRESETS))
    p.add_argument("--batch", type=int, default=16, help="throughput: sequences per step")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--offload-batch", type=int, default=4)
    p.add_argument("--offload-steps", type=int, default=3)
    p.add_argument("--write", metavar="MARKDOWN", help="write the section into this file (between its gpu markers)")
    p.add_argument("--allow-cpu", action="store_true", help="run without CUDA (a smoke run of the code path)")
    args = p.parse_args(list(argv))
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("fullshard bench gpu: no CUDA device here (--allow-cpu runs the code path on the CPU)")
    section = gpu.run(
        args.preset,
        args.offload_presets,
        args.batch,
        args.seq,
        args.steps,
        args.warmup,
        args.rounds,
        args.offload_batch,
        args.offload_steps,
    )
    section = f"`fullshard bench gpu {' '.join(argv)}`\n\n{section}"
    print(section)
    if args.write:
        report.write_markdown(args.write, section, report.GPU_BEGIN_MARK, report.GPU_END_MARK)
    return 0
