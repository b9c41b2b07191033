"""`dflash-generate`: the target answers the training conversations again (the DFlash recipe trains on
the target's own responses), writing JSONL shards that dflash-precompute reads.

    dflash-generate --config configs/tiny.toml --out demo/generated
    dflash-generate --config FILE --dry-run                                   # the plan, nothing else
    torchrun --nproc_per_node=8 -m precompute.generate.cli --config FILE      # one process per GPU

Rerunning the same command resumes: published shards are kept, the rest is generated.
"""

from __future__ import annotations

import sys
from typing import Sequence

from dflash_common.cli import interrupt_says, parse_args, setup_logging, user_errors_exit
from precompute.generate.config import GenerateConfig

_FLAGS = {"--dry-run": "--run.dry_run=true"}


def parse(argv: Sequence[str] | None = None) -> GenerateConfig:
    """`--config FILE`, `--out DIR`, `--dry-run` and `--section.field=value` -> the config."""
    args = [_FLAGS.get(a, a) for a in (sys.argv[1:] if argv is None else argv)]
    cfg, _ = parse_args(GenerateConfig, args, prog="dflash-generate", description=__doc__.split("\n\n")[0]
                        + " Flags: --dry-run (print the plan and stop).", shortcuts={"out": "output.dir"})
    return cfg


@user_errors_exit
def main(argv: Sequence[str] | None = None) -> None:
    """Returns None: console scripts pass main()'s result to sys.exit, which would print anything else."""
    cfg = parse(argv)
    setup_logging()
    with interrupt_says(lambda: f"the shards already published in {cfg.output.dir} are kept (a shard being "
                        f"written is not visible); rerun the same command to resume."):
        from precompute.generate.job import run  # after argument parsing: --help stays fast

        run(cfg)


if __name__ == "__main__":
    main()
