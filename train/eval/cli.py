"""`dflash-eval`: a drafter's acceptance length tau by real speculative decoding on the user's target
(train/eval/run.py), or estimated from a store without the target (`--offline`, train/eval/offline.py).

    dflash-eval --config configs/eval-qwen3-8b.toml --drafter runs/x/export [--report eval.json]
    dflash-eval --offline --store PATH --drafter DIR --target.path=DIR
"""

from __future__ import annotations

from typing import Sequence

from dflash_common.cli import exit_with_error, parse_args, setup_logging, user_errors_exit
from dflash_common.fsutil import check_writable
from train.eval.config import EvalConfig
from train.eval.run import LosslessError, run


DESCRIPTION = """Acceptance length (tau) of a DFlash drafter by real speculative decoding on its target, with
the lossless check, tokens/s with and without the drafter and the speedup.
  dflash-eval --config FILE --drafter DIR [--report FILE.json]
  dflash-eval --offline --store PATH --drafter DIR --target.path=DIR
      (estimate from the store's held-out sequences: only the target's embedding and lm_head are read)"""


def check_eval_outputs(cfg: EvalConfig) -> None:
    """What the evaluation writes must be writable before it starts, not found out at its end."""
    if cfg.report.path:
        check_writable(cfg.report.path, "report.path",
                       "pass --report a file path on a writable filesystem", directory=False)
    if cfg.check.baseline and cfg.check.baseline_cache:
        check_writable(cfg.check.baseline_cache, "check.baseline_cache",
                       "pass a directory on a writable filesystem, or leave it empty")


@user_errors_exit
def main(argv: Sequence[str] | None = None) -> None:
    import sys

    cfg, args = parse_args(EvalConfig, sys.argv[1:] if argv is None else argv, prog="dflash-eval",
                           description=DESCRIPTION,
                           shortcuts={"drafter": "drafter.path", "report": "report.path", "store": "offline.store",
                                      "engine": "target.engine"},
                           switches={"offline": (None, ("estimate tau from a store's held-out sequences (--store); "
                                                        "the target does not run"))})
    setup_logging()
    check_eval_outputs(cfg)
    if args.offline:
        # the store reader and the trainer's data path are imported for --offline only
        from train.eval.offline import run_offline

        run_offline(cfg)
        return
    try:
        run(cfg)
    except LosslessError as e:
        exit_with_error(str(e), code=1)


if __name__ == "__main__":
    main()
