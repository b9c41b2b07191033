"""benchmarks/store_codecs.py on the tiny target and on synthetic states: every table, in the order
of error the formats promise (bf16 < fp8_e4m3 < q4_hadamard), at the bytes quant.py states."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import store_codecs  # noqa: E402


def _tables(out: str) -> list[dict[str, list[str]]]:
    """Each printed table as {first cell: the other cells}."""
    tables = []
    for block in out.split("\n\n"):
        lines = [line for line in block.splitlines() if line.startswith("| ")]
        if lines:
            tables.append(
                {
                    cells[0]: cells[1:]
                    for line in lines
                    for cells in [[c.strip() for c in line.strip("|").split("|")]]
                }
            )
    return tables


def test_the_tiny_targets_states_through_every_store_dtype(tiny_target, capsys):
    store_codecs.main(
        [
            "--target",
            str(tiny_target),
            "--tokens",
            "300",
            "--repeats",
            "1",
            "--speed-tokens",
            "64",
            "--variants",
            "q4 g16 e4m3 (no rotation)",
        ]
    )
    errors, sizes, speed = _tables(capsys.readouterr().out)
    bf16, fp8, q4 = errors["bf16"], errors["fp8_e4m3"], errors["q4_hadamard"]
    assert [bf16[0], fp8[0], q4[0]] == ["1.000", "0.531", "0.312"]  # H=64: (36 + 4) / 128
    assert len(q4) == 1 + 8 + 1  # bytes ratio, L0..L6 + final, mean
    for a, b, c in zip(bf16[1:], fp8[1:], q4[1:]):
        assert float(a) < float(b) < float(c) < 0.1
    assert "q4 g16 e4m3 (no rotation)" in errors
    # DFlash's 5 layers and all 8 of the tiny target: 5 x (36 + 4) + 5 and 8 x 40 + 5
    assert sizes["q4_hadamard"] == ["5", "205", "8", "325"] and sizes["bf16"] == [
        "5",
        "645",
        "8",
        "1,029",
    ]
    assert set(speed) >= {"bf16", "fp8_e4m3", "q4_hadamard", "hadamard_by_matmul (decode)"}


def test_synthetic_states_of_a_large_hidden_size(capsys):
    store_codecs.main(
        [
            "--synthetic",
            "256",
            "--tokens",
            "200",
            "--repeats",
            "1",
            "--speed-tokens",
            "32",
            "--variants",
            "nf4 g16 e4m3 rot,e2m1 g32 e8m0 (MXFP4-like)",
        ]
    )
    rows, speed = _tables(capsys.readouterr().out)
    assert rows["q4_hadamard"][0] == "0.289" and rows["e2m1 g32 e8m0 (MXFP4-like)"][0] == "0.266"
    q4, nf4 = float(rows["q4_hadamard"][-1]), float(rows["nf4 g16 e4m3 rot"][-1])
    assert 0.05 < q4 < nf4 < 0.1  # the chosen levels and scale search beat NF4's levels
    assert "hadamard_by_matmul (decode)" in speed
