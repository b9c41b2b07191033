"""`dflash-precompute`: run the target over conversations and write its hidden states into a store.

    dflash-precompute --config configs/precompute-qwen3-8b.toml --out /nvme/stores/qwen3-8b
    dflash-precompute --config configs/precompute-qwen3-8b.toml --dry-run  # the plan only
    torchrun --nproc_per_node=8 -m precompute.cli --config ...             # one process per GPU

`--dry-run` prints the plan (samples, tokens after templating, bytes, free space) and stops; it
writes nothing (no store, no token cache, no run record).
Rerunning the same command resumes: published shards are kept, the rest is computed.
"""

from __future__ import annotations

import sys
from typing import Sequence

from dflash_common.cli import (
    interrupt_says,
    parse_args,
    setup_logging,
    shards_kept,
    user_errors_exit,
)
from precompute.config import PrecomputeConfig

# Flags without a value, mapped onto config fields.
_SWITCHES = {
    "dry-run": ("run.dry_run", "print the plan and stop; writes nothing"),
    "force": ("run.force", "start on a disk the plan says is too small"),
}


def parse(argv: Sequence[str] | None = None) -> PrecomputeConfig:
    """`--config FILE`, `--out STORE`, `--dry-run`,
    `--force` and `--section.field=value` -> the config."""
    cfg, _ = parse_args(
        PrecomputeConfig,
        sys.argv[1:] if argv is None else argv,
        prog="dflash-precompute",
        description=__doc__.split("\n\n")[0],
        shortcuts={"out": "store.path"},
        switches=_SWITCHES,
        examples=__doc__.split("\n\n")[1],
    )
    return cfg


@user_errors_exit
def main(argv: Sequence[str] | None = None) -> None:
    """Returns None: console scripts pass main()'s result
    to sys.exit, which would print anything else."""
    cfg = parse(argv)
    setup_logging()
    with interrupt_says(lambda: shards_kept(cfg.store.path)):
        from precompute.job import run  # after argument parsing: --help stays fast

        run(cfg)


if __name__ == "__main__":
    main()
