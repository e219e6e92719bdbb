"""A loader's position and coordinates have one owner (issue 51): `Place`
(client/position/place.py) alone assigns them, through named moves; the loader, its loop
(EpochPass) and its on-demand calls (OnDemand) only read them."""

from __future__ import annotations

import ast
from pathlib import Path

from stoker.client.position.exclusions import Excluded
from stoker.client.position.place import Place
from stoker.client.position.resume import Coordinates, Position, Saved, state_of

from conftest import TESTS

CLIENT = TESTS.parent / "client"
OWNED = {"_at", "_coords"}  # the position and the coordinates


def assigned_where(root: Path) -> dict[str, set[str]]:
    """Module (relative to `root`) -> which of OWNED it assigns (`x._at = ...`, `+=`, `: T =`,
    in tuples too)."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and leaf.attr in OWNED \
                            and isinstance(leaf.ctx, ast.Store):
                        found.setdefault(path.relative_to(root).as_posix(), set()).add(leaf.attr)
    return found


def test_position_and_coordinates_are_assigned_in_one_module() -> None:
    assert assigned_where(CLIENT) == {"position/place.py": {"_at", "_coords"}}


def test_the_check_sees_an_assignment_elsewhere(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text("def f(loader):\n    loader._at, x = 1, 2\n"
                                      "    loader._coords += 1\n")
    assert assigned_where(tmp_path) == {"loop.py": {"_at", "_coords"}}


COORDS = Coordinates("toy", 7, True, 0, 2, 4, True, None, "tokens", order=2)


def test_the_moves() -> None:
    place = Place(COORDS)
    assert (place.coords, place.at) == (COORDS, Position(0))
    place.next_batch()
    place.next_batch()
    assert place.at == Position(0, 0, 2)
    place.set_epoch(0)  # the same epoch keeps its place
    assert place.at == Position(0, 0, 2)
    place.new_epoch()
    assert place.at == Position(1)
    place.set_epoch(5)
    assert place.at == Position(5)
    place.seek(3, 40, 2)
    assert place.at == Position(3, 40, 2)
    excluded = Excluded.union(None, [9, 3])
    place.exclude(excluded)
    assert place.coords.excluded == excluded and place.at == Position(3, 40, 2)
    place.reorder(1)
    assert place.coords.order == 1


def test_load_state_dict_resumes_and_re_partitions() -> None:
    state = state_of(COORDS, Position(3, 0, 5), None)
    place = Place(COORDS)
    place.load_state_dict(Saved.read(state, COORDS), None)
    assert place.at == Position(3, 0, 5)
    # saved at world_size 2, batch_size 4, resumed at world_size 1: 5 steps of 2 ranks x 4
    one = Coordinates("toy", 7, True, 0, 1, 4, True, None, "tokens", order=2)
    place = Place(one)
    place.load_state_dict(Saved.read(state, one), None)
    assert place.at == Position(3, 40, 0)
