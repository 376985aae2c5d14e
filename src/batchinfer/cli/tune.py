"""`batchinfer tune`: search the batching knobs for the highest request rate whose latency
percentiles stay within the SLO (see `batchinfer.bench.tune`)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from batchinfer.cli.options import add_engine_flags, collect_flags
from batchinfer.core.config import EngineConfig

SEARCHED = ("batching", "max_num_seqs", "max_num_batched_tokens", "max_batch_size",
            "max_batch_delay_ms", "preset")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "tune", help="find the serving configuration that sustains the most load within an SLO",
        description="Start `batchinfer serve` per configuration (a coarse grid of batching "
        "knobs, then a hill climb from the best), run `bench serve` at rising request rates "
        "with warm-up, each point at least twice, and keep the configuration that sustains the "
        "highest rate with every SLO percentile held. Writes a table, plots and a config file "
        "for `batchinfer serve --config`.")
    parser.add_argument("--slo", required=True,
                        help="latency budget, METRIC_pN=MS comma-separated, METRIC one of ttft, "
                        "tpot, itl, e2el (e.g. ttft_p99=2000,tpot_p99=150)")
    parser.add_argument("--workload", default="input=64:512,output=32:256",
                        help="prompt and output lengths in tokens, MIN:MAX (default: "
                        "input=64:512,output=32:256)")
    rates = parser.add_mutually_exclusive_group()
    rates.add_argument("--rate", default=None,
                       help="request rates to try, comma-separated, ascending")
    rates.add_argument("--find-max-rate", action="store_true",
                       help="rates as 30-100 %% of the capacity a burst reaches on the first "
                       "configuration (the default without --rate)")
    parser.add_argument("--time-budget", default="20m",
                        help="stop before this much time has passed (90s, 20m, 1h; default 20m)")
    parser.add_argument("--result-dir", required=True,
                        help="where runs, table, plots and best-config.yaml go; rerunning "
                        "with the same directory skips the runs already measured")
    parser.add_argument("--num-prompts", type=int, default=40, help="requests per run (40)")
    parser.add_argument("--num-warmups", type=int, default=4,
                        help="requests sent and discarded before a configuration's first run (4)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per (configuration, rate); one more when they disagree (2)")
    parser.add_argument("--margin", type=float, default=0.25,
                        help="relative spread of an SLO metric over a point's runs beyond which "
                        "the point is measured again (0.25)")
    parser.add_argument("--max-configs", type=int, default=None,
                        help="most configurations to try (default: until the budget ends)")
    # The knobs tune searches are its own to set; every other engine flag goes to each server.
    add_engine_flags(parser, exclude=SEARCHED)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from batchinfer.bench.tune import (
        TuneConfig,
        parse_duration,
        parse_slo,
        parse_workload,
        tune,
    )

    input_len, output_len = parse_workload(args.workload)
    rates: tuple[float, ...] = ()
    if args.rate is not None:
        try:
            rates = tuple(sorted(float(r) for r in args.rate.split(",") if r.strip()))
        except ValueError:
            raise ValueError(f"--rate {args.rate!r}: expected numbers such as 0.5,1,2") from None
        if not rates or any(math.isinf(r) for r in rates):
            raise ValueError("--rate needs finite rates; for a burst use --find-max-rate")
    engine = collect_flags(args, EngineConfig)
    EngineConfig.from_kwargs(**engine)  # a bad engine flag fails here, not in every server
    config = TuneConfig(
        slo=parse_slo(args.slo), result_dir=args.result_dir, input_len=input_len,
        output_len=output_len, rates=rates, time_budget_s=parse_duration(args.time_budget),
        num_prompts=args.num_prompts, num_warmups=args.num_warmups, repeats=args.repeats,
        margin=args.margin, max_configs=args.max_configs,
        seed=args.seed if args.seed is not None else 0,  # the workload's, and the engines'

        engine=engine)
    return tune(config)
