"""The shipped causal streaming student of the toy clip teacher (assets/toy_student_causal/, made by
`python -m distill.toy.causal_ship --retrain`; `make proofs` trains it again from scratch): streamed
again on the first SLICE of its record's 216 scored clip prompts it draws what the record says, the
record meets the trained length's bars against the shipped bidirectional student, and the record's
commands are today's recipe. That the causal methods move the toy score is proven by a short run
(tests/test_toy_causal_method.py)."""

from __future__ import annotations

import json

import pytest

from distill.sample.run_settings import read_run_settings
from distill.toy import causal_ship
from distill.toy import causal_students as recipe
from distill.toy.t2v_students import mismatches

pytestmark = pytest.mark.usefixtures("one_thread")

SLICE = 48  # prompts streamed again (each of the 9 motions 5 or 6 times)
FLIPS = 2  # as for the other shipped students: another CPU may read a sample on an edge otherwise


def record() -> dict:
    return json.loads((causal_ship.ASSET / causal_ship.RECORD_FILE).read_text())


def test_the_shipped_causal_student_streams_today_what_its_record_says(toy_teacher):
    was = record()["evaluation"]["row"]
    today = causal_ship.streamed_row(toy_teacher, causal_ship.ASSET, count=SLICE)
    assert today["count"] == SLICE
    assert mismatches(today["correct"], was["correct"][:SLICE]) <= FLIPS, (today["accuracy"], was["accuracy"])
    assert today["first_frame_share"] < 0.5  # the first chunk's frames arrive before half the clip is made


def test_the_record_meets_the_trained_lengths_bars():
    """accuracy >= 0.9 x the bidirectional 4-step student's (its record) and motion ratio 0.85-1.15, on
    all 216 prompts; the record's bars are what today's code finds in its row."""
    evaluation = record()["evaluation"]
    assert evaluation["count"] == 216 == len(evaluation["row"]["correct"])
    found = causal_ship.bars(evaluation["row"], causal_ship.bidirectional_row())
    assert causal_ship.unmet(found) == []
    assert found == evaluation["bars"]


def test_the_shipped_causal_student_is_what_its_recorded_commands_make():
    shipped = record()
    assert shipped["commands"] == causal_ship.commands()
    assert shipped["rebuild"] == "python -m distill.toy.causal_ship --retrain"
    settings = read_run_settings(causal_ship.ASSET / "run_settings.json")
    assert settings.method == "self_forcing" and settings.trained_steps == recipe.SELF_FORCING_STEPS
    assert settings.chunk_frames == recipe.CHUNK and settings.teacher_path == causal_ship.TEACHER_REF
    assert json.loads((causal_ship.ASSET / "causal_config.json").read_text())["chunk_frames"] == recipe.CHUNK
    files = [p for p in causal_ship.ASSET.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 3 * 2**20
