"""Work units and who computes them.

The input record stream (every line or row of every input, in input order, bad ones included) is cut
into units of `run.samples_per_unit` consecutive records: unit u holds records [u*S, (u+1)*S). Units
depend on the input alone, never on the number of ranks. Consecutive units form sort windows of
`batching.sort_window_units` (sort window w = units [w*W, (w+1)*W)), whose samples are sorted by
length and batched together; rank r computes the sort windows with w % world_size == r. As a sort
window is batched the same way whatever the number of ranks, every sequence runs in the same batch
and its states are the same bits with 1 rank or 100. Each unit becomes one shard (precompute/plan.py
names it).
"""

from __future__ import annotations

from typing import Iterator

from precompute.inputs import RawRecord


def owner(unit: int, world_size: int, units_per_sort_window: int = 1) -> int:
    """The rank that computes `unit`: the owner of its sort window (they go round-robin)."""
    return (unit // units_per_sort_window) % world_size


def num_units(num_records: int, samples_per_unit: int) -> int:
    return -(-num_records // samples_per_unit)


def iter_unit_records(records: Iterator[RawRecord], samples_per_unit: int, rank: int = 0,
                      world_size: int = 1,
                      units_per_sort_window: int = 1) -> Iterator[tuple[int, list[RawRecord]]]:
    """Group the record stream into (unit index, records) for the units this rank owns. Records of
    other ranks' units are passed over without being kept or parsed."""
    current, batch = -1, []
    for record in records:
        unit = record.index // samples_per_unit
        if unit != current:
            if batch:
                yield current, batch
            current, batch = unit, []
        if owner(unit, world_size, units_per_sort_window) == rank:
            batch.append(record)
    if batch:
        yield current, batch
