"""`dflash-train`: train a DFlash drafter from one or more hidden-state stores.

    dflash-train --config configs/train-qwen3-8b.toml --store /nvme/stores/qwen3-8b --out runs/exp1
    dflash-train --config configs/tiny.toml --drafter.block_size=8 --optim.lr=3e-4
    torchrun --nproc-per-node 8 -m train.cli --config ...      # one process per GPU

Rerunning the same command resumes from the newest complete checkpoint in the run directory.
SIGTERM or Ctrl-C saves a checkpoint at the end of the current step and exits with code 0.
"""

from __future__ import annotations

from typing import Sequence

from dflash_common.cli import interrupt_says, parse_args, setup_logging, user_errors_exit
from train.config import TrainConfig


def parse(argv: Sequence[str] | None = None) -> TrainConfig:
    """`--config FILE`, `--store PATH` (repeatable), `--out DIR` and `--section.field=value` -> the config."""
    cfg, _ = parse_args(
        TrainConfig, argv, prog="dflash-train", description=__doc__.split("\n\n")[0],
        shortcuts={"store": "data.stores", "out": "run.out_dir"}, repeatable=["store"],
        examples=__doc__.split("\n\n")[1],
    )
    return cfg


@user_errors_exit
def main(argv: Sequence[str] | None = None) -> None:
    cfg = parse(argv)
    setup_logging()
    with interrupt_says(lambda: f"the checkpoints already saved in {cfg.run.out_dir} are kept (a save "
                        f"being written is not visible); rerun the same command to resume from the newest."):
        from train.loop import run  # after argument parsing: --help stays fast

        run(cfg)  # once the loop runs, Ctrl-C saves a checkpoint at the end of the step and exits 0


if __name__ == "__main__":
    main()
