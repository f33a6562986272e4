"""Hypothesis strategies shared by the op property tests."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def point_sets(draw, min_level: int = 1, max_level: int = 10, max_points: int = 80):
    level = draw(st.integers(min_level, max_level))
    coord = st.integers(0, 2**level - 1)
    points = draw(st.lists(st.tuples(coord, coord, coord), min_size=1, max_size=max_points))
    return level, points
