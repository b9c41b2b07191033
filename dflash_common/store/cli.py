"""`dflash-store`: look into a hidden-state store and check it.

    dflash-store info STORE [--json]   format, layers, dtype, codec, shards, tokens, bytes per token
    dflash-store verify STORE          every checksum and every shard's consistency

Exit codes: 0 clean; 1 `verify` found bad shards (their names are printed, one per line, on stdout);
2 the path is not a store this dflash reads (one sentence on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from dflash_common.cli import ArgumentParser, setup_logging, user_errors_exit
from dflash_common.fsutil import human_bytes
from dflash_common.store import Store
from dflash_common.store.verify import store_info, verify_store

EXIT_BAD_SHARDS = 1


def format_info(info: dict[str, Any]) -> str:
    """Two sizes, each named: the arrays a read returns (what `dflash-precompute`'s plan projects, in
    the plan's figures) and the files on disk (incl. shard indexes, checksums and metadata)."""
    ratio = info["compression_ratio"] if info["codec"] != "none" else None
    per_token = info["bytes_per_token"]
    rows = [
        ("store", info["path"]),
        ("format version", info["format_version"]),
        ("target", info["target"]),
        ("layer ids", ", ".join(str(i) for i in info["layer_ids"])),
        ("final state", "yes" if info["final_state"] else "no"),
        ("hidden size", info["hidden_size"]),
        ("dtype", info["dtype"]),
        ("codec", info["codec"]),
        ("shards", f"{info['shards']:,}"),
        ("sequences", f"{info['sequences']:,}"),
        ("tokens", f"{info['tokens']:,}"),
        ("arrays (decoded)", (f"{human_bytes(info['decoded_bytes'])}: {info['array_bytes_per_token'] or 0:,} "
                              "array bytes/token + 8 per sequence (offsets)")),
        ("on disk", f"{human_bytes(info['bytes_on_disk'])} ({info['bytes_on_disk']:,} B"
                    + ("" if per_token is None else f", {per_token:,.1f} bytes/token") + "), incl. shard indexes, "
                    "checksums and metadata"),
    ]
    if ratio is not None:  # codec none compresses nothing: its decoded/disk measures only the metadata
        rows.append(("compression ratio", f"{ratio:.3f} (decoded bytes / bytes on disk, codec {info['codec']})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def cmd_info(args: argparse.Namespace) -> int:
    with Store.open(args.store) as store:
        info = store_info(store)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with Store.open(args.store) as store:
        report = verify_store(store)
    for name, why in sorted(report.bad.items()):
        print(name)
        print(f"  {why}", file=sys.stderr)
    if report.staging:
        print(f"note: {len(report.staging)} unpublished staging dir(s) in {args.store}/.staging "
              f"(invisible to readers; the next writer removes dead ones)", file=sys.stderr)
    verdict = "OK" if report.ok else f"{len(report.bad)} bad shard(s)"
    print(f"verified {report.shards_checked} shard(s) of {args.store}: {verdict}", file=sys.stderr)
    return 0 if report.ok else EXIT_BAD_SHARDS


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="dflash-store", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="what a store holds and how big it is")
    info.add_argument("store", help="store directory")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(fn=cmd_info)
    verify = sub.add_parser("verify", help="check every checksum and every shard's consistency")
    verify.add_argument("store", help="store directory")
    verify.set_defaults(fn=cmd_verify)
    return parser


@user_errors_exit
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
