"""Work units: cut by input order, owned by ranks
window by window, never dependent on the world size."""

from __future__ import annotations

from precompute import units as U

from precompute_helpers import make_config, tokenize


def test_units_are_cut_by_input_order_and_never_depend_on_world_size(
    tiny_target_2layer, mixed_inputs, tmp_path
):
    cfg = make_config(tiny_target_2layer, mixed_inputs, tmp_path / "store")
    (one, records), _ = tokenize(cfg)
    assert records == 24 and [s.index for s in one] == list(range(6))
    assert [s.records for s in one] == [4] * 6
    for world in (2, 3):
        parts = []
        for rank in range(world):
            (mine, n), _ = tokenize(cfg, rank, world)
            assert n == 24 and all(
                U.owner(s.index, world, cfg.batching.sort_window_units) == rank for s in mine
            )
            parts += mine
        assert sorted(parts, key=lambda s: s.index) == one


def test_ranks_own_whole_windows_round_robin():
    assert [U.owner(u, 2, 3) for u in range(10)] == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1]
    assert [U.owner(u, 3) for u in range(4)] == [0, 1, 2, 0]
    assert all(U.owner(u, 1, 4) == 0 for u in range(9))
