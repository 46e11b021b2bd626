"""The real texts calibration and measurement use by default: present on every install, and disjoint."""

import pytest
from pydoc_data.topics import topics

from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.convert import texts


def test_calibration_and_evaluation_texts_are_disjoint_halves_of_the_reference():
    calibration, evaluation = texts.calibration_text(), texts.evaluation_text()
    assert len(calibration) > 100_000 and len(evaluation) > 100_000
    # each topic in exactly one half (those the reference repeats inside another topic aside)
    alone = [t for t in topics.values() if len(t) > 200 and sum(t in u for u in topics.values()) == 1]
    assert len(alone) > 50 and all((t in calibration) != (t in evaluation) for t in alone)


def test_a_text_file_that_cannot_be_used_is_refused_in_one_line(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bytes.txt").write_bytes(b"\xff\xfe\x00")
    for name, line in (("missing.txt", "cannot read --calibration file"), ("empty.txt", "--calibration file .* is empty"),
                       ("bytes.txt", "cannot read --calibration file")):
        with pytest.raises(InvalidOptionError, match=line):
            texts.read_text(tmp_path / name, "--calibration")
