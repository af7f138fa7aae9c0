"""The one schema of a run's rows: the committed H200 files read back and written again byte for byte, and
the builder's refusal of a column results.csv does not have."""

from pathlib import Path

import pytest

from fused_vision.bench.measure import Peak, Times
from fused_vision.bench.rows import COLUMNS, LOW_MEMORY_COLUMNS, read_csv, timing_row, write_csv

H200 = Path(__file__).parents[2] / "bench" / "results" / "h200"


H200_MISSING = {"attention"}  # the columns added after the H200's committed run, the schema otherwise the same


@pytest.mark.parametrize("name, columns", [("results.csv", COLUMNS), ("low_memory.csv", LOW_MEMORY_COLUMNS)])
def test_the_committed_gpu_files_read_back_and_write_unchanged(tmp_path, name, columns):
    rows = read_csv(H200 / name)
    write_csv(tmp_path / name, tuple(column for column in columns if column not in H200_MISSING), rows)
    assert (tmp_path / name).read_text() == (H200 / name).read_text()


def test_the_cells_read_back_as_numbers_none_and_text():
    copy = read_csv(H200 / "results.csv")[0]  # the copy ceiling's row: no case of its own
    assert (copy["op"], copy["reps"], copy["D"], copy["triton"]) == ("copy", 62, None, "3.6.0")
    assert isinstance(copy["ms_p50"], float) and isinstance(copy["model_bytes"], int)


def test_a_timing_row_holds_its_times_and_peak_and_refuses_unknown_columns():
    times = Times(p50=2.0, p20=1.5, p80=2.5, reps=7)
    row = timing_row("patch_embed", "fused", "image_8x280", "bfloat16", times, peak=Peak(4096, 4000), D=1152)
    assert row == dict(
        op="patch_embed", provider="fused", case="image_8x280", dtype="bfloat16", timing="speed",
        ms_p50=2.0, ms_p20=1.5, ms_p80=2.5, reps=7, peak_bytes=4096, peak_requested_bytes=4000, D=1152,
    )  # fmt: skip
    assert set(row) <= set(COLUMNS)
    with pytest.raises(TypeError, match="not a results.csv column: hidden"):
        timing_row("patch_embed", "fused", "image_8x280", "bfloat16", times, hidden=1152)
