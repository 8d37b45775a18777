"""A value of the wrong type in any of the teacher's own config files is named with its file and
key before anything loads, as a teacher-load failure."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import train_args

from train_distillation import main


@pytest.mark.parametrize(
    ("relative", "key", "value"),
    [
        ("transformer/config.json", "num_layers", "2"),
        ("transformer_2/config.json", "patch_size", 2),
        ("vae/config.json", "z_dim", 16.5),
        ("scheduler/scheduler_config.json", "flow_shift", "3.0"),
        ("text_encoder/config.json", "num_layers", "2"),
        ("model_index.json", "boundary_ratio", "0.875"),
    ],
)
def test_a_wrongly_typed_value_is_named_with_its_file_and_key(
    tiny_teacher, tmp_path, capsys, relative, key, value
):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    config_file = teacher / relative
    config = json.loads(config_file.read_text())
    config[key] = value
    config_file.write_text(json.dumps(config))
    code = main(train_args(teacher, tmp_path / "out", tmp_path / "cache"))
    err = capsys.readouterr().err
    assert code == 5, err
    assert f'{config_file}: "{key}" must be a' in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
