"""Reading the run's JSON-lines records back: only a cut-off last line is forgiven."""

from __future__ import annotations

import pytest

from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.telemetry.metrics import read_jsonl


def test_a_last_line_cut_short_by_a_kill_is_left_out(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"st')
    assert read_jsonl(path) == [{"step": 0}, {"step": 1}]


def test_a_damaged_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"st\n{"step": 2}\n')
    with pytest.raises(AsyncGRPOError, match=r"metrics.jsonl, line 2, is not a JSON record"):
        read_jsonl(path)


def test_a_complete_last_line_that_is_not_json_is_damage_not_a_cut(tmp_path):
    """A line that ends in a newline was written whole: if it is not JSON the file was damaged (issue 20)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\nnot json\n')
    with pytest.raises(AsyncGRPOError, match=r"metrics.jsonl, line 2, is not a JSON record"):
        read_jsonl(path)


def test_the_line_left_out_is_named_in_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"st')
    assert read_jsonl(path) == [{"step": 0}]
    assert f"{path}, line 2, was cut short" in caplog.text


def test_a_binary_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0}\n\xff\xfe\n')
    with pytest.raises(AsyncGRPOError, match=r"metrics.jsonl is not UTF-8 text"):
        read_jsonl(path)
