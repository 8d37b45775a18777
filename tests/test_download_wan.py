"""download_wan.py: downloads (the Hub mocked), offline banners, --verify and --tiny."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

import download_wan

REPO = Path(__file__).resolve().parents[1]


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = download_wan.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_banner(err: str) -> None:
    assert "Traceback" not in err
    assert err.count("ERROR (teacher load)") == 1, err


def fake_snapshot(monkeypatch: pytest.MonkeyPatch, source: Path | None, drop: tuple[str, ...] = ()) -> dict:
    """Replace the Hub download by a copy of `source` (minus `drop`); return the call's kwargs."""
    seen: dict = {}

    def snapshot_download(**kwargs):
        seen.update(kwargs)
        if source is not None:
            shutil.copytree(source, kwargs["local_dir"], dirs_exist_ok=True)
            for name in drop:
                shutil.rmtree(Path(kwargs["local_dir"]) / name)
        return str(kwargs["local_dir"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return seen


def raise_from_snapshot(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    def snapshot_download(**kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)


def http_error(cls: type, status: int, message: str) -> Exception:
    response = types.SimpleNamespace(
        status_code=status, headers={}, request=None, url="https://huggingface.co"
    )
    return cls(message, response=response)


# --- no network ---------------------------------------------------------------------------------


def test_help_does_not_import_torch() -> None:
    code = "import sys, download_wan; print(sorted({'torch', 'diffusers', 'huggingface_hub'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_offline_env_gives_one_banner_with_manual_copy_steps(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raise_from_snapshot(monkeypatch, AssertionError("must not contact the Hub when offline"))
    code, _, err = run_main(capsys, "--local_dir", tmp_path / "wan22")
    assert code == 5
    assert_one_banner(err)
    assert "Hugging Face Hub cannot be reached" in err
    assert "HF_HUB_OFFLINE" in err
    assert "hf download Wan-AI/Wan2.2-T2V-A14B-Diffusers --local-dir wan22" in err
    assert "huggingface-cli download" in err and "rsync" in err
    assert f"python download_wan.py --verify {tmp_path / 'wan22'}" in err
    assert not (tmp_path / "wan22").exists()


def test_offline_env_with_a_complete_folder_only_verifies_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tiny_teacher: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raise_from_snapshot(monkeypatch, AssertionError("must not contact the Hub when offline"))
    code, out, _ = run_main(capsys, "--local_dir", tiny_teacher)
    assert code == 0 and "OK" in out


@pytest.mark.parametrize(
    "error",
    [
        LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub."),
        ConnectionError("[Errno -2] Name or service not known"),
        TimeoutError("timed out"),
    ],
    ids=["local-entry-not-found", "connection", "timeout"],
)
def test_network_errors_give_the_same_banner(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, error: Exception
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    raise_from_snapshot(monkeypatch, error)
    code, _, err = run_main(capsys, "--preset", "wan2.1-t2v-1.3b", "--local_dir", tmp_path / "w")
    assert code == 5
    assert_one_banner(err)
    assert "cannot be reached" in err and "Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in err
    assert str(error).split()[0] in err  # the underlying reason is shown


def test_innermost_network_reason_is_shown(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    try:
        try:
            raise OSError(-2, "Name or service not known")
        except OSError as dns:
            raise ConnectionError("connect failed") from dns
    except ConnectionError as wrapped:
        error = LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub.")
        error.__cause__ = wrapped
    raise_from_snapshot(monkeypatch, error)
    code, _, err = run_main(capsys, "--local_dir", tmp_path / "w")
    assert code == 5 and "ConnectionError: connect failed" in err


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (http_error(GatedRepoError, 401, "401 Client Error: access is restricted"), "gated"),
        (http_error(RepositoryNotFoundError, 404, "404 Client Error: Repository Not Found"), "not found"),
    ],
    ids=["gated", "not-found"],
)
def test_access_errors_mention_token_and_repo_id(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    error: Exception,
    expected: str,
) -> None:
    raise_from_snapshot(monkeypatch, error)
    code, _, err = run_main(capsys, "--repo_id", "Some-Org/Some-Repo", "--local_dir", tmp_path / "w")
    assert code == 5
    assert_one_banner(err)
    assert "Cannot access Some-Org/Some-Repo: the repository" in err and expected in err
    assert "HF_TOKEN" in err and "--token" in err and "misspelt" in err


def test_full_disk_is_explained(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    raise_from_snapshot(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    code, _, err = run_main(capsys, "--local_dir", tmp_path / "w")
    assert code == 5
    assert_one_banner(err)
    assert "disk under" in err and "No space left" in err and "--local_dir" in err


# --- download (Hub mocked) ----------------------------------------------------------------------


def test_download_defaults_and_token_from_env(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_teacher: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    seen = fake_snapshot(monkeypatch, tiny_teacher)
    code, out, _ = run_main(capsys, "--revision", "v1")
    assert code == 0
    assert seen["repo_id"] == "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    assert Path(seen["local_dir"]) == Path("models/Wan2.2-T2V-A14B-Diffusers")
    assert (seen["token"], seen["revision"]) == ("hf_from_env", "v1")
    assert "OK" in out and (tmp_path / "models/Wan2.2-T2V-A14B-Diffusers/transformer_2").is_dir()

    run_main(capsys, "--token", "hf_flag", "--local_dir", tmp_path / "x")
    assert seen["token"] == "hf_flag"


def test_incomplete_download_lists_what_is_missing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_teacher: Path
) -> None:
    fake_snapshot(monkeypatch, tiny_teacher, drop=("transformer_2", "vae"))
    code, _, err = run_main(capsys, "--local_dir", tmp_path / "w")
    assert code == 5
    assert_one_banner(err)
    assert "missing transformer_2/" in err and "missing vae/" in err
    assert "transformer/" in err.split("Found in")[1]  # what was found is listed too
    assert "Run the same command again" in err


def test_student_preset_needs_only_the_transformer(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_teacher: Path
) -> None:
    student = tmp_path / "student_repo"
    shutil.copytree(tiny_teacher / "transformer", student / "transformer")
    seen = fake_snapshot(monkeypatch, student)
    code, out, _ = run_main(capsys, "--preset", "wan2.1-t2v-1.3b", "--local_dir", tmp_path / "w")
    assert code == 0 and "student initialisation" in out
    assert seen["repo_id"] == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"


# --- --verify -----------------------------------------------------------------------------------


def test_verify_accepts_a_complete_teacher(capsys: pytest.CaptureFixture[str], tiny_teacher: Path) -> None:
    code, out, err = run_main(capsys, "--verify", tiny_teacher)
    assert code == 0 and out.startswith("OK") and err == ""


def _drop_folder(folder: Path) -> None:
    shutil.rmtree(folder / "transformer_2")


def _drop_vae_config(folder: Path) -> None:
    (folder / "vae/config.json").unlink()


def _no_boundary_ratio(folder: Path) -> None:
    index = json.loads((folder / "model_index.json").read_text())
    del index["boundary_ratio"]
    (folder / "model_index.json").write_text(json.dumps(index))


def _broken_index(folder: Path) -> None:
    (folder / "model_index.json").write_text('{"_class_name": "WanPipeline",')


def _missing_shard(folder: Path) -> None:
    expert = folder / "transformer"
    (expert / "diffusion_pytorch_model.safetensors").rename(
        expert / "diffusion_pytorch_model-00001-of-00002.safetensors"
    )
    shards = {
        "a": "diffusion_pytorch_model-00001-of-00002.safetensors",
        "b": "diffusion_pytorch_model-00002-of-00002.safetensors",
    }
    (expert / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))


def _no_vocabulary(folder: Path) -> None:
    (folder / "tokenizer/tokenizer.json").unlink()


def _truncated_weights(folder: Path) -> None:
    (weights,) = (folder / "transformer").glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:-1000])


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (_truncated_weights, "it was cut short"),
        (_drop_folder, "missing transformer_2/"),
        (_drop_vae_config, "vae/config.json is missing"),
        (_no_boundary_ratio, "names no boundary_ratio"),
        (_broken_index, "model_index.json does not parse"),
        (_missing_shard, "transformer/diffusion_pytorch_model-00002-of-00002.safetensors is missing"),
        (_no_vocabulary, "tokenizer/ has no vocabulary"),
    ],
)
def test_verify_names_each_problem(
    capsys: pytest.CaptureFixture[str], tiny_teacher: Path, tmp_path: Path, damage, expected: str
) -> None:
    folder = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, folder)
    damage(folder)
    code, out, err = run_main(capsys, "--verify", folder)
    assert code == 5 and "OK" not in out
    assert_one_banner(err)
    assert expected in err
    assert "Found in" in err and "model_index.json" in err


def test_verify_recognises_the_original_layout(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for name in ("high_noise_model", "low_noise_model"):
        (tmp_path / name).mkdir()
    for name in ("models_t5_umt5-xxl-enc-bf16.pth", "Wan2.1_VAE.pth"):
        (tmp_path / name).write_bytes(b"")
    code, _, err = run_main(capsys, "--verify", tmp_path)
    assert code == 5 and "ORIGINAL Wan 2.2 layout" in err


# --- --tiny and usage -----------------------------------------------------------------------------


def test_tiny_writes_a_verifiable_teacher(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run_main(capsys, "--tiny", tmp_path / "t", "--seed", "3")
    assert code == 0
    assert str(tmp_path / "t") in out and "transformer_2/" in out and "seed 3" in out
    assert run_main(capsys, "--verify", tmp_path / "t")[0] == 0


def test_tiny_refuses_a_foreign_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = run_main(capsys, "--tiny", tmp_path)
    assert code == 4 and "--overwrite" in err and "Traceback" not in err
    assert (tmp_path / "notes.txt").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--verify", "x", "--token", "t"],
        ["--seed", "1"],
        ["--tiny", "x", "--verify", "y"],
        ["--preset", "nope"],
    ],
)
def test_usage_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        download_wan.main(argv)
    assert caught.value.code == 2


def test_cli_tiny_in_a_fresh_process_is_byte_identical(tiny_teacher: Path, tmp_path: Path) -> None:
    """Also guards determinism across processes (hash seeds, thread pools), not just within one."""
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    cmd = [sys.executable, "download_wan.py", "--tiny", str(tmp_path / "t")]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for path in tiny_teacher.rglob("*"):
        if path.is_file():
            copy = tmp_path / "t" / path.relative_to(tiny_teacher)
            assert copy.read_bytes() == path.read_bytes(), path


@pytest.mark.parametrize("flag", ["--tiny", "--toy"])
def test_an_unwritable_output_folder_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    code, _out, err = run_main(capsys, flag, "/proc/nope/teacher")
    assert code == 3 and f"ERROR (config): {flag} /proc/nope/teacher is not writable" in err
    assert "Traceback" not in err
