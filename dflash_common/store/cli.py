"""`dflash-store`: look into a hidden-state store and check it.

    dflash-store info STORE [--json]   format, layers, dtype, codec, shards, tokens, bytes per
                                       token, and whether it holds every shard its summary lists
    dflash-store verify STORE          every checksum, every shard's consistency, no shard missing

Exit codes: 0 clean (a store dflash-precompute has not finished is reported incomplete, not bad); 1
`verify` found bad or missing shards (their names are printed, one per line, on stdout); 2 the path
is not a store this dflash reads, or its root zarr.json was changed (one sentence on stderr).
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
from dflash_common.store.contents import (
    StoreContents, incomplete_sentence, missing_sentence, refill_advice, store_contents,
)
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
        ("status", _status_row(info)),
        ("shards", f"{info['shards']:,}" + _of_expected(info["shards"], info["expected_shards"])),
        ("sequences", f"{info['sequences']:,}"),
        ("tokens", f"{info['tokens']:,}" + _of_expected(info["tokens"], info["expected_tokens"])),
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


def _status_row(info: dict[str, Any]) -> str:
    missing = info["missing_shards"]
    if info["status"] == "incomplete":
        return ("incomplete: no summary yet (dflash-precompute is still writing it, or stopped "
                "before the end)")
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        shown = ", ".join(missing[:3]) + more
        return f"{len(missing):,} shard(s) missing ({shown}): {refill_advice(info['path'])}"
    return "complete: every shard its summary lists"


def _of_expected(present: int, expected: int | None) -> str:
    if expected is None or expected == present:
        return ""
    return f" of the {expected:,} its summary lists"


def cmd_info(args: argparse.Namespace) -> int:
    with Store.open(args.store) as store:
        info = store_info(store)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with Store.open(args.store) as store:
        report = verify_store(store)
        contents = store_contents(store)
    for name, why in sorted(report.bad.items()):
        print(name)
        print(f"  {why}", file=sys.stderr)
    _print_missing(args.store, contents)
    if report.staging:
        print(f"note: {len(report.staging)} unpublished staging dir(s) in {args.store}/.staging "
              f"(invisible to readers; the next writer removes dead ones)", file=sys.stderr)
    problems = [f"{len(report.bad)} bad shard(s)"] if report.bad else []
    problems += [f"{len(contents.missing)} missing shard(s)"] if contents.missing else []
    incomplete = contents.status == "incomplete"
    verdict = ", ".join(problems) or ("OK, but incomplete" if incomplete else "OK")
    print(f"verified {report.shards_checked} shard(s) of {args.store}: {verdict}", file=sys.stderr)
    return EXIT_BAD_SHARDS if problems else 0


def _print_missing(path: str, contents: StoreContents) -> None:
    """Missing shards as bad ones are printed: names on stdout, the sentence on stderr."""
    if contents.status == "incomplete":
        print(f"note: {incomplete_sentence(path)}.", file=sys.stderr)
    for name in contents.missing:
        print(name)
    if contents.missing:
        print(f"  {missing_sentence(path, contents)}.", file=sys.stderr)


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
