#!/usr/bin/env python3
"""Check that training runs follow a reference run's loss curve within a relative tolerance.

    python tools/compare_losses.py runs/stock runs/litespark runs/litespark-fp8 --tolerance 0.01 --smooth 5 \
        --start-step 50 --plot runs/losses.png

The first run is the reference (or --reference names one). Each argument is a litespark-train metrics.jsonl or the
run directory holding it. Prints a Markdown table; exit status 0 when every run stays within --tolerance of the
reference at every compared step, 1 when one does not, 2 on bad input. Definitions:
litespark_megatron/apps/loss_curves.py.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

try:
    import litespark_megatron  # noqa: F401
except ImportError:  # run from a source checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from litespark_megatron.apps import cli  # noqa: E402
from litespark_megatron.apps import loss_curves  # noqa: E402


def build_parser() -> cli.OneLineParser:
    p = cli.OneLineParser(prog="compare_losses", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="metrics.jsonl files or run directories")
    p.add_argument("--reference", default=None, help="the run to compare against (default: the first)")
    p.add_argument("--tolerance", type=cli.fraction, default=0.01, help="largest relative deviation allowed")
    p.add_argument("--smooth", type=cli.positive_int, default=1,
                   help="trailing mean over this many logged points before comparing")
    p.add_argument("--start-step", type=cli.non_negative_int, default=0, help="compare steps from this one on")
    p.add_argument("--plot", default=None, help="write the curves to this PNG (needs matplotlib)")
    return p


def body(args) -> int:
    paths = list(args.runs)
    if args.reference is not None and args.reference not in paths:
        paths.insert(0, args.reference)
    repeated = sorted({p for p in paths if paths.count(p) > 1})
    if repeated:
        raise cli.UsageError(f"run {repeated[0]} is given twice")
    if len(paths) < 2:
        raise cli.UsageError("give at least two runs: a reference and a run to compare with it")
    reference = args.reference if args.reference is not None else paths[0]
    names = dict(zip(paths, loss_curves.run_names(paths)))
    try:
        curves = {p: loss_curves.read_losses(p) for p in paths}
        comparisons = [loss_curves.compare(curves[reference], curves[p], names[p], args.tolerance, args.smooth,
                                           args.start_step) for p in paths if p != reference]
    except loss_curves.CurveError as e:
        raise cli.UsageError(str(e)) from None
    print(loss_curves.render(names[reference], comparisons, args.smooth, args.start_step), end="")
    if args.plot:
        loss_curves.plot(names[reference], curves[reference],
                         {names[p]: curves[p] for p in paths if p != reference}, args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(c.within for c in comparisons) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli.run_main(body, argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
