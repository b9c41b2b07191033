"""`dflash-generate`: the target answers the training conversations again (the DFlash recipe trains
on the target's own responses), writing JSONL shards that dflash-precompute reads.

    dflash-generate --config configs/tiny.toml --out demo/generated
    dflash-generate --config FILE --dry-run      # checks target, inputs and output; prints the plan
    dflash-generate --config FILE --sampling.temperature=0.7 --sampling.max_new_tokens=4096
    torchrun --nproc_per_node=8 -m precompute.generate.cli --config FILE      # one process per GPU

`--dry-run` reads the target's tokenizer and settings, the inputs and an existing output's
manifest, checks that the output directory can be written, prints the plan (prompts, skips, tokens
in, the most tokens out) and stops: it writes nothing and loads no weights.
Rerunning the same command resumes: published shards are kept, the rest is generated.
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
from precompute.generate.config import GenerateConfig

_SWITCHES = {"dry-run": ("run.dry_run", "print the plan and stop; writes nothing, loads no model")}


def parse(argv: Sequence[str] | None = None) -> GenerateConfig:
    """`--config FILE`, `--out DIR`, `--dry-run` and `--section.field=value` -> the config."""
    argv = sys.argv[1:] if argv is None else argv
    intro, examples = __doc__.split("\n\n")[:2]
    cfg, _ = parse_args(
        GenerateConfig,
        argv,
        prog="dflash-generate",
        description=intro,
        shortcuts={"out": "output.dir"},
        switches=_SWITCHES,
        examples=examples,
    )
    return cfg


@user_errors_exit
def main(argv: Sequence[str] | None = None) -> None:
    """Returns None: console scripts pass main()'s result
    to sys.exit, which would print anything else."""
    cfg = parse(argv)
    setup_logging()
    with interrupt_says(lambda: shards_kept(cfg.output.dir)):
        from precompute.generate.job import run  # after argument parsing: --help stays fast

        run(cfg)


if __name__ == "__main__":
    main()
