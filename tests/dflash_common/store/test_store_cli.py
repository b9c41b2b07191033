"""`dflash-store info` and `verify`, run as the user runs them: a separate process, exit codes, output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_store_support import manifest, unit_name, write_units

ROOT = Path(__file__).resolve().parents[3]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "dflash_common.store.cli", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=120)


def test_info_verify_and_exit_codes(tmp_path):
    store = tmp_path / "s"
    write_units(store, manifest("fp8_e4m3", "zstd"), [0, 1, 2], 100)

    info = _cli("info", store, "--json")
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    assert (data["shards"], data["sequences"], data["tokens"]) == (3, 9, 300)
    assert data["layer_ids"] == [1, 3, 5] and data["dtype"] == "fp8_e4m3" and data["codec"] == "zstd"
    disk = sum(p.stat().st_size for p in store.rglob("*") if p.is_file() and ".staging" not in p.parts)
    assert data["bytes_on_disk"] == disk and abs(data["bytes_per_token"] - disk / 300) < 1e-9
    # decoded: 3 layers x (64 B fp8 + 4 B scale) + 4 B id + 1 B mask per token; 8 B per offset
    assert data["decoded_bytes"] == 300 * (3 * 68 + 5) + 3 * 4 * 8
    assert data["compression_ratio"] == data["decoded_bytes"] / disk

    text = _cli("info", store)
    assert text.returncode == 0
    for line in ("format version     1", "layer ids          1, 3, 5", "tokens             300"):
        assert line in text.stdout
    assert "array bytes/token" in text.stdout and "incl. shard indexes" in text.stdout
    assert "compression ratio  " in text.stdout and "codec zstd" in text.stdout  # shown for a real codec only
    assert data["array_bytes_per_token"] == 3 * 68 + 5

    ok = _cli("verify", store)
    assert ok.returncode == 0 and ok.stdout == "" and "3 shard(s)" in ok.stderr and "OK" in ok.stderr

    chunk = store / "shards" / unit_name(2) / "layer_3/c/0/0"
    data = bytearray(chunk.read_bytes())
    data[3] ^= 1
    chunk.write_bytes(bytes(data))
    bad = _cli("verify", store)
    assert bad.returncode == 1
    assert bad.stdout.split() == [unit_name(2)] and "crc32c" in bad.stderr


def test_info_and_verify_of_a_q4_store(tmp_path):
    store = tmp_path / "s"
    write_units(store, manifest("q4_hadamard"), [0, 1], 100)
    data = json.loads(_cli("info", store, "--json").stdout)
    assert data["dtype"] == "q4_hadamard" and data["format_version"] == 2
    # 3 layers x (36 B: 32 of 4-bit codes + 4 group scale bytes, + a 4 B token scale) + 5 B id and mask
    assert data["array_bytes_per_token"] == 3 * (36 + 4) + 5
    rows = dict(line.split(None, 1) if not line.startswith("format") else ("format", line.split()[-1])
                for line in _cli("info", store).stdout.splitlines())
    assert rows["format"] == "2" and rows["dtype"].strip() == "q4_hadamard"
    ok = _cli("verify", store)
    assert ok.returncode == 0 and "2 shard(s)" in ok.stderr and "OK" in ok.stderr
    scale = store / "shards" / unit_name(1) / "layer_5_scale/c/0"  # a flipped bit in a token scale
    raw = bytearray(scale.read_bytes())
    raw[8] ^= 1
    scale.write_bytes(bytes(raw))
    bad = _cli("verify", store)
    assert bad.returncode == 1 and bad.stdout.split() == [unit_name(1)] and "crc32c" in bad.stderr


def test_a_path_that_is_not_a_store_is_one_line_and_exit_2(tmp_path):
    for cmd in ("info", "verify"):
        r = _cli(cmd, tmp_path)
        assert r.returncode == 2
        assert r.stderr.strip().count("\n") == 0 and "not a dflash store" in r.stderr
        assert "Traceback" not in r.stderr


def test_a_store_that_does_not_exist_says_so(tmp_path):
    r = _cli("info", tmp_path / "nowhere")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"error: store {tmp_path / 'nowhere'} does not exist; check the path, or run "
                                f"dflash-precompute to write it.")


def test_info_json_into_a_closed_pipe_ends_quietly(tmp_path):
    store = tmp_path / "s"
    write_units(store, manifest("bf16", "none"), [0, 1, 2], 100)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_common.store.cli", "info", "--json", str(store)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc.stdout.close()  # the reader went away before the first line, as `| head` does after its lines
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == "", err  # 128 + SIGPIPE; no BrokenPipeError traceback
