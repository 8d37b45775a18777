"""The toy world's stream reader (assets/toy_stream_reader/, made by `python -m distill.toy.stream_reader
--retrain`): the toy VAE whose decoder was refit on the world's 33-frame streams, so that a causal
student's stream 3x longer than trained can be judged (the teacher's toy VAE reads the world's own
streams back as noise past the trained 9 frames). Its encoder is the teacher's, its record is what it
reads today, and it reads what the teacher's VAE cannot."""

from __future__ import annotations

import pytest
import torch

from distill.toy import stream_reader
from distill.toy.shipped import ASSETS as TEACHER_ASSETS
from distill.toy.t2v_students import mismatches

pytestmark = pytest.mark.usefixtures("one_thread")

SLICE = 12  # the record's first prompts read again (each of the 9 motions once or twice)
FLIPS = 2  # as for the shipped students: another CPU may read a sample on an edge otherwise


def test_the_reader_reads_the_worlds_streams_as_its_record_says_and_the_teachers_vae_cannot():
    record = stream_reader.read_record()
    today = stream_reader.floor_row(stream_reader.load_reader(), count=SLICE)
    assert mismatches(today["correct"], record["floor"]["correct"][:SLICE]) <= FLIPS, today["accuracy"]
    assert mismatches(today["held"], record["floor"]["held"][:SLICE]) <= FLIPS, today["identity"]
    # What it is for: the world's 3x streams read right in most attributes through it, at about their
    # own motion, and not through the teacher's VAE (the record's rows, on all 216 prompts).
    floor, teacher = record["floor"], record["teacher_vae"]
    assert floor["accuracy"] >= 0.7 and 0.85 <= floor["motion_ratio"] <= 1.15, floor
    assert teacher["accuracy"] < 0.2 and teacher["identity"] < 0.05, teacher


def test_the_reader_is_the_teachers_vae_with_only_its_decoder_refit():
    """Its latents are the teacher's: a student's latents mean the same to it."""
    from diffusers import AutoencoderKLWan

    reader = stream_reader.load_reader().state_dict()
    teacher = AutoencoderKLWan.from_pretrained(TEACHER_ASSETS / "vae").state_dict()
    assert reader.keys() == teacher.keys()
    refit = {name for name in reader if not torch.equal(reader[name], teacher[name])}
    assert refit and all(name.startswith(("decoder.", "post_quant_conv.")) for name in refit), refit
    record = stream_reader.read_record()
    assert record["rebuild"] == "python -m distill.toy.stream_reader --retrain"
    wanted = {"frames": stream_reader.STREAM_FRAMES, "steps": stream_reader.STEPS, "lr": stream_reader.LR}
    assert record["refit"] == wanted | {"batch": stream_reader.BATCH}
    assert record["floor"]["count"] == 216 == len(record["floor"]["held"])
    assert "_name_or_path" not in (stream_reader.READER / "config.json").read_text()  # no machine's paths
