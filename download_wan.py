"""Download the Wan 2.2 teacher (or a Wan 2.1 student initialisation), check a teacher folder,
or write a tiny random teacher for tests and offline demos.

    # The Wan 2.2 T2V A14B teacher (~120 GB) into models/Wan2.2-T2V-A14B-Diffusers:
    python download_wan.py
    # Its configs only (no weights): enough for `train_distillation.py --config <recipe> --dry_run`
    # to print the plan (memory per GPU, GPU-hours) before the 120 GB download:
    python download_wan.py --configs_only
    # The Wan 2.1 T2V 1.3B model, whose transformer/ can initialise the student:
    python download_wan.py --preset wan2.1-t2v-1.3b
    # Any repository, revision, folder and token (the token defaults to $HF_TOKEN):
    python download_wan.py --repo_id Wan-AI/Wan2.2-T2V-A14B-Diffusers --revision main \\
        --local_dir /data/wan22 --token hf_xxx
    # Check a folder that was copied by hand:
    python download_wan.py --verify models/Wan2.2-T2V-A14B-Diffusers
    # A tiny random teacher in the same layout (a second, no network):
    python download_wan.py --tiny outputs/tiny_teacher --seed 0
    # ... or in the ORIGINAL Wan layout (high_noise_model/, low_noise_model/, *.pth):
    python download_wan.py --tiny outputs/tiny_teacher_original --layout original
    # The Wan 2.2 I2V A14B teacher (image to video, ~120 GB) into models/Wan2.2-I2V-A14B-Diffusers:
    python download_wan.py --preset wan2.2-i2v-a14b
    # The Wan 2.2 TI2V 5B teacher (text or image to video, one transformer) into models/Wan2.2-TI2V-5B-Diffusers:
    python download_wan.py --preset wan2.2-ti2v-5b
    # ... or a tiny one of another Wan 2.2 model, in either layout:
    python download_wan.py --tiny outputs/tiny_i2v_teacher --tiny_kind i2v    # Wan2.2-I2V-A14B
    python download_wan.py --tiny outputs/tiny_ti2v_teacher --tiny_kind ti2v  # Wan2.2-TI2V-5B
    python download_wan.py --tiny outputs/tiny_ti2v_original --tiny_kind ti2v --layout original
    # A small teacher TRAINED on a synthetic world (shipped weights, a second, no network):
    python download_wan.py --toy outputs/toy-wan
    # ... or its image-to-video teacher (Wan2.2-I2V-A14B layout, trained on the same world):
    python download_wan.py --toy outputs/toy-i2v --toy_kind i2v
    # Convert an ORIGINAL Wan2.2-T2V-A14B download to the diffusers layout once:
    python download_wan.py --convert models/Wan2.2-T2V-A14B models/Wan2.2-T2V-A14B-Diffusers

An interrupted download resumes where it stopped: run the same command again
(huggingface_hub's snapshot_download skips finished files and continues partial ones).
Progress bars come from huggingface_hub; HF_HUB_DISABLE_PROGRESS_BARS=1 turns them off.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distill.models.layout import (
    CONFIG_PATTERNS,
    DIFFUSERS_COMPONENTS,
    ONE_TRANSFORMER_COMPONENTS,
    ORIGINAL_COMPONENTS,
    missing_components,
    present_entries,
    safetensors_problem,
)
from distill.models.teacher_kind import KINDS, T2V_A14B, TeacherKind, describe_folder, resume_command
from distill.ops.command import Parser, PathAction, entry_point, integer
from distill.ops.errors import DistillError, Stage, report
from distill.ops.paths import Kind
from distill.ops.requirements import require_installed


@dataclass(frozen=True)
class Preset:
    """A known repository and what this project needs from it."""

    repo_id: str
    """The Hugging Face Hub repository."""
    required: tuple[str, ...]
    """The entries that must be present after the download (see distill.models.layout)."""
    role: str
    """What the download is for, shown to the user."""
    kind: Any = None
    """The Wan 2.2 teacher kind it is (distill/models/teacher_kind.py), None for a student's start."""
    experts: int = 2
    """The transformers its model_index.json lists: what tells a Wan2.1 model from an A14B teacher."""


# The teachers' presets are their kinds' (`TeacherKind.preset`), so every fix that names a download
# (TeacherKind.download_command) names one this script accepts.
PRESETS = {
    kind.preset: Preset(
        kind.repo_id,
        DIFFUSERS_COMPONENTS if kind.experts == 2 else ONE_TRANSFORMER_COMPONENTS,
        "teacher",
        kind,
        kind.experts,
    )
    for kind in KINDS
}
# Only the transformer is used: it initialises the student. Its VAE and text encoder are the same as
# the teacher's, which the teacher download already provides.
PRESETS["wan2.1-t2v-1.3b"] = Preset(
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", ("transformer/",), "student initialisation", T2V_A14B, 1
)
DEFAULT_PRESET = "wan2.2-t2v-a14b"
# --toy_kind: the trained toy teachers shipped in assets/ (distill/toy/shipped.py TOY_TEACHERS).
TOY_KINDS = ("t2v", "i2v")
# --tiny_kind: the short names of distill/models/teacher_kind.py's kinds.
TINY_KINDS = ("t2v", "i2v", "ti2v")

# The file each component folder must hold for diffusers/transformers to load it.
COMPONENT_CONFIGS = {
    "text_encoder": ("config.json",),
    "transformer": ("config.json",),
    "transformer_2": ("config.json",),
    "vae": ("config.json",),
    "scheduler": ("scheduler_config.json",),
    "tokenizer": ("tokenizer_config.json",),
}
WEIGHTED_COMPONENTS = ("text_encoder", "transformer", "transformer_2", "vae")
# A tokenizer needs its vocabulary in one of these forms (fast tokenizer or SentencePiece).
TOKENIZER_VOCABS = ("tokenizer.json", "spiece.model")

# Exception class names that mean "the network is down" across huggingface_hub versions
# (requests before 1.0, httpx after, httpx2 in 2.x), so no HTTP library is imported here.
_NETWORK_ERROR_NAMES = {
    "ConnectError",
    "ConnectionError",
    "ConnectTimeout",
    "LocalEntryNotFoundError",
    "NetworkError",
    "OfflineModeIsEnabled",
    "ProxyError",
    "ReadTimeout",
    "RemoteProtocolError",
    "TimeoutException",
    "TransportError",
    "gaierror",
}
_OFFLINE_VALUES = {"1", "on", "yes", "true"}


@entry_point
def main(argv: list[str] | None = None) -> int:
    """Entry point: returns the process exit code (0 on success)."""
    args = parse_args(argv)
    try:
        check_output_folder(args)
        if args.toy is not None:
            return write_toy(Path(args.toy), args.seed, args.overwrite, args.toy_kind or "t2v")
        if args.tiny is not None:
            return write_tiny(
                Path(args.tiny),
                args.seed or 0,
                args.overwrite,
                args.layout or "diffusers",
                args.tiny_kind or "t2v",
            )
        if args.convert is not None:
            return convert(Path(args.convert[0]), Path(args.convert[1]))
        if args.verify is not None:
            return verify(Path(args.verify))
        return download(args)
    except DistillError as error:
        return report(error)


def check_output_folder(args: argparse.Namespace) -> None:
    """The folder this command will write, proven writable before it downloads or builds anything,
    and the folder it reads (--verify, --convert SRC) a folder, not a file (a missing one is reported
    with what a teacher folder must hold)."""
    from distill.ops.output_dir import writable_folder
    from distill.ops.paths import Kind, PathFlag, check_paths

    check_paths(
        [
            PathFlag("--verify", args.verify, Kind.FOLDER, must_exist=False),
            PathFlag(
                "--convert SRC", args.convert[0] if args.convert else None, Kind.FOLDER, must_exist=False
            ),
        ]
    )

    for flag, value in (
        ("--toy", args.toy),
        ("--tiny", args.tiny),
        ("--convert DST", args.convert[1] if args.convert else None),
        ("--local_dir", None if (args.verify or args.toy or args.tiny or args.convert) else args.local_dir),
    ):
        if value is not None:
            writable_folder(value, flag, create=False)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = Parser(
        prog="download_wan.py",
        description="Download the Wan 2.2 teacher, verify a teacher folder, or write a tiny test teacher.",
        epilog="Exit codes: 0 OK, 2 usage error, 3 a path of the wrong kind (a file for a folder) or not "
        "writable, 4 --tiny folder refused or this Python lacks the requirements (use .venv/bin/python), "
        "5 download or teacher folder problem.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--tiny",
        metavar="DIR",
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        help="write a tiny random teacher to DIR (no network)",
    )
    mode.add_argument(
        "--toy",
        metavar="DIR",
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        help="write the small teacher trained on the toy world to DIR (no network)",
    )
    mode.add_argument(
        "--verify",
        metavar="DIR",
        action=PathAction,
        kind=Kind.FOLDER,
        must_exist=False,
        help="check that DIR holds a complete diffusers teacher",
    )
    mode.add_argument(
        "--convert",
        nargs=2,
        metavar=("SRC", "DST"),
        help="convert the ORIGINAL Wan layout in SRC to the diffusers layout in DST (no network)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help=f"known repository (default: {DEFAULT_PRESET})",
    )
    source.add_argument("--repo_id", help="any Hub repository in the diffusers layout")
    parser.add_argument(
        "--local_dir",
        action=PathAction,
        kind=Kind.OUTPUT_FOLDER,
        help="download folder (default: models/<repository name>)",
    )
    parser.add_argument("--revision", help="branch, tag or commit of the repository")
    parser.add_argument("--token", help="Hub access token (default: $HF_TOKEN, then `hf auth login`)")
    parser.add_argument(
        "--configs_only",
        action="store_true",
        help="fetch only the configs (model_index.json, each component's config, the scheduler's and the "
        "tokenizer's: well under a MB, no weights): enough for train_distillation.py --dry_run to print a "
        "recipe's memory and GPU-hours; the same command without it fetches the rest later",
    )
    parser.add_argument(
        "--seed", type=integer(0), help="with --tiny: seed of the random weights (default: 0)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="with --tiny or --toy: replace a DIR that holds anything else (without it such a DIR is "
        "refused; one that already holds what the command writes is kept as it is)",
    )
    parser.add_argument(
        "--layout",
        choices=("diffusers", "original"),
        help="with --tiny: the on-disk layout (default: diffusers; original = Wan's own release layout)",
    )
    parser.add_argument(
        "--tiny_kind",
        choices=TINY_KINDS,
        help="with --tiny: which Wan 2.2 model, in either layout (default: t2v = Wan2.2-T2V-A14B; "
        "i2v = Wan2.2-I2V-A14B; ti2v = Wan2.2-TI2V-5B)",
    )
    parser.add_argument(
        "--toy_kind",
        choices=TOY_KINDS,
        help="with --toy: which trained toy teacher (default: t2v = Wan2.2-T2V-A14B layout; "
        "i2v = Wan2.2-I2V-A14B layout, image to video)",
    )
    args = parser.parse_args(argv)
    _reject_stray_options(parser, args)
    return args


def _reject_stray_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options that would be silently ignored are usage errors instead."""
    download_opts = [
        flag
        for flag, value in (
            ("--preset", args.preset),
            ("--repo_id", args.repo_id),
            ("--local_dir", args.local_dir),
            ("--revision", args.revision),
            ("--token", args.token),
            ("--configs_only", args.configs_only or None),
        )
        if value is not None
    ]
    modes = {"--tiny": args.tiny, "--toy": args.toy, "--verify": args.verify, "--convert": args.convert}
    local_mode = next((flag for flag, value in modes.items() if value is not None), None)
    if local_mode and download_opts:
        parser.error(f"{', '.join(download_opts)} cannot be combined with {local_mode}")
    if args.tiny is None and args.toy is None and (args.overwrite or args.seed is not None):
        parser.error("--seed and --overwrite only apply to --tiny and --toy")
    if args.tiny is None and args.layout is not None:
        parser.error("--layout only applies to --tiny")
    if args.tiny is None and args.tiny_kind is not None:
        parser.error("--tiny_kind only applies to --tiny")
    if args.toy is None and args.toy_kind is not None:
        parser.error("--toy_kind only applies to --toy")


# --- download -------------------------------------------------------------------------------


def download(args: argparse.Namespace) -> int:
    """Fetch the repository with resumable snapshot_download, then check what arrived."""
    preset = _resolve_preset(args.preset, args.repo_id)
    local_dir = Path(args.local_dir or Path("models") / preset.repo_id.split("/")[-1])
    refuse_other_model(preset, local_dir)
    token = args.token or os.environ.get("HF_TOKEN") or None
    check = _check_configs if args.configs_only else _check_download
    if _offline_requested():
        # Decided here rather than by snapshot_download, which returns a partial local_dir with
        # only a warning when offline.
        if missing_components(local_dir, preset.required):
            raise hub_unreachable(preset, local_dir, "HF_HUB_OFFLINE is set", args.configs_only)
        print(f"HF_HUB_OFFLINE is set: not contacting the Hub, checking the existing {local_dir}")
        return check(preset, local_dir)
    what = "its configs only" if args.configs_only else "resumes if interrupted"
    print(f"Downloading {preset.repo_id} ({preset.role}) into {local_dir} ({what})")
    try:
        _snapshot(preset, local_dir, args.revision, token, args.configs_only)
    except KeyboardInterrupt:
        print("\nInterrupted: run the same command again to resume the download.", file=sys.stderr)
        return 130  # the shell's code for Ctrl-C
    return check(preset, local_dir)


def refuse_other_model(preset: Preset, local_dir: Path) -> None:
    """A download only adds files: into a folder that holds another model it would leave two models'
    files mixed, which is no model at all (the one overwrite rule, distill/ops/replace.py: never
    replaced by another model). Refused before anything is fetched, with no flag to force it; a
    folder whose files name no model (empty, a download cut short early) is resumed."""
    from distill.models.teacher_kind import read_teacher_kind
    from distill.ops.replace import free_sibling, replace_refusal

    try:
        reading = read_teacher_kind(local_dir)
    except DistillError:  # files of two models already: refused too, it names none to resume
        reading = None
    else:
        # Nothing that names a model (empty, a download cut short early): resumed. The same model
        # (kind and transformer count, Wan2.1 against A14B) too; an unknown --repo_id has no kind.
        if reading is None or (reading.kind == preset.kind and reading.experts in (None, preset.experts)):
            return
    default = Path("models") / preset.repo_id.split("/")[-1]
    new = default if not default.exists() else free_sibling(local_dir)
    ours = next((name for name, p in PRESETS.items() if p.repo_id == preset.repo_id), None)
    source = f"--preset {ours}" if ours else f"--repo_id {preset.repo_id}"
    refusal = replace_refusal(
        local_dir,
        "--local_dir",
        describe_folder(local_dir),
        f"the files of {preset.repo_id} ({preset.role})",
        overwrite_flag=None,
        new_folder=f"download into a new folder: python download_wan.py {source} --local_dir {new}",
    )
    kind = reading.kind if reading is not None and reading.experts in (None, reading.kind.experts) else None
    if kind is not None:
        refusal.fixes.append(
            f"or resume the download of the model it holds: {kind.download_command(local_dir)}"
        )
    raise refusal


def _check_configs(preset: Preset, local_dir: Path) -> int:
    """After --configs_only: every config a --dry_run plan reads is there (weights are not expected)."""
    problems = [f"missing {name}" for name in missing_components(local_dir, preset.required)]
    for name in preset.required:
        folder = local_dir / name.rstrip("/")
        if folder.is_dir() and folder.name in COMPONENT_CONFIGS:
            problems += [
                f"{name}{c} is missing" for c in COMPONENT_CONFIGS[folder.name] if not (folder / c).is_file()
            ]
    if _whole_teacher(preset):
        problems += _model_index_problems(local_dir / "model_index.json")
    if problems:
        raise DistillError(
            f"The configs of {preset.repo_id} are incomplete",
            _problem_details(local_dir, problems),
            causes=[
                "The download was interrupted.",
                "The repository does not have the Wan diffusers layout.",
            ],
            fixes=["Run the same command again."],
            stage=Stage.TEACHER_LOAD,
        )
    names = {p.repo_id: name for name, p in PRESETS.items()}
    source = (
        f" --repo_id {preset.repo_id}"
        if preset.repo_id not in names
        else ("" if names[preset.repo_id] == DEFAULT_PRESET else f" --preset {names[preset.repo_id]}")
    )
    print(
        f"OK: {local_dir} holds the configs of {preset.repo_id}, no weights: enough for a plan, e.g.\n"
        f"  python train_distillation.py --config config/recipes/<recipe>.yaml --teacher_path {local_dir} "
        "--dry_run\n"
        "Fetch the weights into the same folder before training (the same command without --configs_only):\n"
        f"  python download_wan.py{source} --local_dir {local_dir}"
    )
    return 0


def _whole_teacher(preset: Preset) -> bool:
    """Whether the preset is a whole teacher (two experts, or TI2V-5B's one transformer), whose
    model_index.json is checked too, rather than one folder of a model."""
    return preset.required in (DIFFUSERS_COMPONENTS, ONE_TRANSFORMER_COMPONENTS)


def _resolve_preset(preset_name: str | None, repo_id: str | None) -> Preset:
    if repo_id is None:
        return PRESETS[preset_name or DEFAULT_PRESET]
    known = {p.repo_id: p for p in PRESETS.values()}
    # An unknown repository is checked as a teacher: that is what this script is for.
    return known.get(repo_id, Preset(repo_id, DIFFUSERS_COMPONENTS, "teacher"))


def _snapshot(
    preset: Preset,
    local_dir: Path,
    revision: str | None,
    token: str | None,
    configs_only: bool = False,
) -> None:
    # Imported here so that --help and --verify stay fast.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    repo_id = preset.repo_id
    patterns = {"allow_patterns": list(CONFIG_PATTERNS)} if configs_only else {}
    try:
        snapshot_download(repo_id=repo_id, local_dir=local_dir, revision=revision, token=token, **patterns)
    except GatedRepoError as error:
        raise _access_error(repo_id, "the repository is gated", error) from None
    except RevisionNotFoundError as error:
        raise DistillError(
            f"Revision {revision!r} does not exist in {repo_id}",
            _first_line(error),
            fixes=["Pass an existing branch, tag or commit with --revision, or leave it out for 'main'."],
            stage=Stage.TEACHER_LOAD,
        ) from None
    except RepositoryNotFoundError as error:
        raise _access_error(repo_id, "the repository was not found or needs a login", error) from None
    except Exception as error:
        if _is_network_error(error):
            raise hub_unreachable(preset, local_dir, _network_reason(error), configs_only) from None
        if _http_status(error) in (401, 403):
            raise _access_error(repo_id, "the Hub refused the token", error) from None
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            raise DistillError(
                f"The disk under {local_dir} is full",
                _first_line(error),
                fixes=[
                    "Free space (the A14B teacher needs about 130 GB), or pass --local_dir on a bigger disk.",
                    "Then run the same command again: finished files are kept.",
                ],
                stage=Stage.TEACHER_LOAD,
            ) from None
        raise


def _check_download(preset: Preset, local_dir: Path) -> int:
    """Verify what arrived: the whole teacher layout, or only the folders the preset needs."""
    problems = [f"missing {name}" for name in missing_components(local_dir, preset.required)]
    for name in preset.required:
        folder = local_dir / name.rstrip("/")
        if folder.is_dir() and folder.name in COMPONENT_CONFIGS:
            problems += _component_problems(folder, COMPONENT_CONFIGS[folder.name])
    if _whole_teacher(preset):
        problems += _model_index_problems(local_dir / "model_index.json")
    if problems:
        raise DistillError(
            f"The download of {preset.repo_id} is incomplete",
            _problem_details(local_dir, problems),
            causes=[
                "The download was interrupted.",
                "The repository does not have the Wan diffusers layout.",
            ],
            fixes=["Run the same command again: finished files are kept and the rest resumes."],
            stage=Stage.TEACHER_LOAD,
        )
    print(f"OK: {local_dir} holds {', '.join(preset.required)} ({preset.role}).")
    return 0


def hub_unreachable(preset: Preset, local_dir: Path, reason: str, configs_only: bool = False) -> DistillError:
    """The banner for a machine that cannot reach huggingface.co: how to copy the files by hand, the
    configs alone for --configs_only (well under a MB, not the whole model), and the tiny teacher of the
    same model to try the trainer meanwhile."""
    repo_id, name = preset.repo_id, local_dir.name
    if _offline_requested():
        causes = ["HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1) is set: unset it on a machine with internet."]
    else:
        causes = [
            "This machine has no internet access (air-gapped cluster, firewall, DNS failure).",
            "A proxy is required but HTTPS_PROXY is not set.",
        ]
    names = {p.repo_id: n for n, p in PRESETS.items()}
    source = f"--preset {names[repo_id]}" if repo_id in names else f"--repo_id {repo_id}"
    include = " ".join(f"'{pattern}'" for pattern in CONFIG_PATTERNS) if configs_only else ""
    fetch = f"hf download {repo_id}{f' --include {include}' if include else ''} --local-dir {name}"
    old_cli = fetch.replace("hf download", "huggingface-cli download", 1)
    if configs_only:
        check = (
            "Check them here, without the network: HF_HUB_OFFLINE=1 python download_wan.py --configs_only "
            f"{source} --local_dir {local_dir}"
        )
    elif _whole_teacher(preset):
        check = f"Check it: python download_wan.py --verify {local_dir}"
    else:
        check = f"Only {', '.join(preset.required)} is used: check it holds config.json and *.safetensors."
    what = "the configs of " if configs_only else ""
    need = (
        "\nThe configs are well under a MB, but they come from the Hub like the weights: fetch them once "
        "where huggingface.co can be reached (or HF_ENDPOINT names a mirror), then copy them here."
        if configs_only
        else ""
    )
    kind = preset.kind if isinstance(preset.kind, TeacherKind) else T2V_A14B
    return DistillError(
        "The Hugging Face Hub cannot be reached",
        f"Could not download {what}{repo_id} ({preset.role}): {reason}{need}",
        causes=causes,
        fixes=[
            f"On a machine with internet run: {fetch}  (huggingface_hub < 1.0: {old_cli})",
            f"Copy the folder to this machine: rsync -a --partial {name}/ <this-host>:{local_dir.absolute()}/"
            "  (or scp -r)",
            check,
            f"To try the trainer without any weights: {kind.tiny_command()}",
        ],
        stage=Stage.TEACHER_LOAD,
    )


def _access_error(repo_id: str, what: str, error: BaseException) -> DistillError:
    return DistillError(
        f"Cannot access {repo_id}: {what}",
        _first_line(error),
        causes=[
            "The repository id is misspelt (it is case-sensitive).",
            "The repository is gated or private and no valid token was sent.",
        ],
        fixes=[
            "Check the id on https://huggingface.co/" + repo_id,
            "Accept the licence on the model page, then pass --token hf_... or set HF_TOKEN "
            "(or run `hf auth login`).",
        ],
        stage=Stage.TEACHER_LOAD,
    )


def _offline_requested() -> bool:
    # Read at call time: huggingface_hub only reads HF_HUB_OFFLINE when it is first imported.
    return any(
        os.environ.get(name, "").strip().lower() in _OFFLINE_VALUES
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _is_network_error(error: BaseException) -> bool:
    """Whether `error`, or anything it was raised from, means the Hub could not be reached."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        if any(cls.__name__ in _NETWORK_ERROR_NAMES for cls in type(current).__mro__):
            return True
        current = current.__cause__ or current.__context__
    return False


def _network_reason(error: BaseException) -> str:
    """The innermost network error (e.g. 'ConnectError: Name or service not known'), not the wrapper."""
    reason = _first_line(error)
    current: BaseException | None = error
    for _ in range(8):  # cause chains are short; the bound guards against cycles
        current = current.__cause__ or current.__context__
        if current is None:
            break
        if _is_network_error(current):
            reason = f"{type(current).__name__}: {_first_line(current)}"
    return reason


def _http_status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# --- verify ---------------------------------------------------------------------------------


def verify(folder: Path, any_kind: bool = False) -> int:
    """Check that `folder` is a complete Wan 2.2 teacher in the diffusers layout; print the result.
    `any_kind`: check the layout of a model this version does not distil too (after --convert)."""
    from distill.models.teacher_kind import read_teacher_kind, refuse_undistillable

    # Another Wan 2.2 model is told so, not that it misses this one's parts (or that it is complete).
    reading = read_teacher_kind(folder) if any_kind else refuse_undistillable(folder)
    components = _teacher_components(reading)
    problems = teacher_problems(folder)
    if problems:
        causes = ["The download or copy was interrupted.", "The folder is not the -Diffusers repository."]
        if not missing_components(folder, ORIGINAL_COMPONENTS):
            causes.insert(0, "This is the ORIGINAL Wan 2.2 layout (high_noise_model/, low_noise_model/).")
        raise DistillError(
            f"{folder} is not a complete Wan 2.2 diffusers teacher",
            _problem_details(folder, problems),
            causes=causes,
            fixes=[
                # The preset of the model its files name: the download refuses any other into it.
                f"Resume the download: {resume_command(folder, reading.kind if reading else None)}",
                "Or copy the missing parts from a complete copy, then run --verify again.",
                f"An ORIGINAL layout folder converts with: python download_wan.py --convert {folder} "
                f"{folder}-Diffusers",
            ],
            stage=Stage.TEACHER_LOAD,
        )
    model = f": {reading.kind.model}, {reading.kind.task}" if reading is not None else ""
    print(f"OK: {folder} is a complete Wan 2.2 diffusers teacher ({', '.join(components)}{model}).")
    if reading is not None and not reading.kind.distillable:
        print(f"  It holds {reading.kind.model} ({reading.kind.task}); this version does not distil it yet.")
    return 0


def _teacher_components(reading: Any) -> tuple[str, ...]:
    """What a diffusers teacher of the kind its files say (`reading`, None: unknown = two experts) holds."""
    from distill.models.layout import diffusers_components

    return diffusers_components(reading.kind.experts if reading is not None else 2)


def teacher_problems(folder: Path) -> list[str]:
    """Everything that would stop `folder` from loading as a Wan 2.2 teacher (empty if none): the
    parts of the model its files name (TI2V-5B has no transformer_2/), two experts when they name none."""
    from distill.models.teacher_kind import read_teacher_kind

    if not folder.is_dir():
        return [f"{folder} does not exist or is not a folder"]
    try:
        reading = read_teacher_kind(folder)
    except DistillError as error:  # files that disagree on the model: the problem, listed
        return [error.title]
    components = _teacher_components(reading)
    problems = [f"missing {name}" for name in missing_components(folder, components)]
    problems += _model_index_problems(folder / "model_index.json")
    for component, configs in COMPONENT_CONFIGS.items():
        if (folder / component).is_dir():
            problems += _component_problems(folder / component, configs)
    return problems


def _model_index_problems(path: Path) -> list[str]:
    if not path.is_file():
        return []  # already reported as missing
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return [f"model_index.json does not parse: {error}"]
    if not isinstance(index, dict):
        return ["model_index.json is not a JSON object"]
    problems = []
    if index.get("expand_timesteps") is True:
        return problems  # TI2V-5B: one transformer, no expert switch to name
    if "boundary_ratio" not in index:
        problems.append("model_index.json names no boundary_ratio (a Wan 2.1 single-expert model?)")
    if "transformer_2" not in index:
        problems.append("model_index.json names no transformer_2 (the low-noise expert)")
    return problems


def _component_problems(component: Path, configs: tuple[str, ...]) -> list[str]:
    name = component.name
    problems = [f"{name}/{c} is missing" for c in configs if not (component / c).is_file()]
    if name == "tokenizer" and not any((component / v).is_file() for v in TOKENIZER_VOCABS):
        problems.append(f"tokenizer/ has no vocabulary ({' or '.join(TOKENIZER_VOCABS)})")
    if name in WEIGHTED_COMPONENTS:
        problems += _weight_problems(component)
    return problems


def _weight_problems(component: Path) -> list[str]:
    """Missing weights, including shards an index names but an interrupted copy left out."""
    name = component.name
    indexes = sorted(component.glob("*.index.json"))
    weights = [p for p in component.iterdir() if p.suffix in (".safetensors", ".bin")]
    if not indexes and not weights:
        return [f"{name}/ has no weight files (*.safetensors)"]
    problems = []
    for index in indexes:
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            problems.append(f"{name}/{index.name} does not parse: {error}")
            continue
        problems += [
            f"{name}/{s} is missing (listed in {index.name})"
            for s in sorted(shards)
            if not (component / s).is_file()
        ]
    # A file cut short (an interrupted copy) has the right name: its header says how long it must be.
    for file in sorted(w for w in weights if w.suffix == ".safetensors"):
        problem = safetensors_problem(file)
        if problem:
            problems.append(f"{name}/{file.name}: {problem}")
    return problems


def _found(folder: Path) -> str:
    entries = present_entries(folder)
    return ", ".join(entries) if entries else "(nothing)"


def _problem_details(folder: Path, problems: list[str]) -> str:
    return "Problems:\n" + "\n".join(f"- {p}" for p in problems) + f"\nFound in {folder}: {_found(folder)}"


# --- tiny -----------------------------------------------------------------------------------


def write_tiny(
    out_dir: Path, seed: int, overwrite: bool, layout: str = "diffusers", tiny_kind: str = "t2v"
) -> int:
    """Write the tiny random teacher (diffusers or original layout) and say what it holds."""
    # imports torch and diffusers
    from distill.models.teacher_kind import KINDS
    from distill.models.tiny import (
        original_layout_shape,
        tiny_shape,
        write_tiny_original_teacher,
        write_tiny_teacher,
    )

    kind = next(k for k in KINDS if k.name.split("-")[0] == tiny_kind)
    if layout == "original":
        shape = original_layout_shape(kind)
        path = write_tiny_original_teacher(out_dir, seed=seed, shape=shape, overwrite=overwrite, kind=kind)
    else:
        shape = tiny_shape(kind)
        path = write_tiny_teacher(out_dir, seed=seed, shape=shape, kind=kind, overwrite=overwrite)
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    name = kind.model.replace("Wan2.2-", "").replace("-", " ")
    print(
        f"Wrote a tiny random Wan 2.2 {name} teacher (seed {seed}, {layout} layout) to {path} "
        f"({total / 1024:.0f} KiB):"
    )
    for entry in present_entries(path):
        files = sorted(p.name for p in (path / entry).iterdir()) if entry.endswith("/") else []
        print(f"  {entry:<18} {' '.join(files)}")
    if kind.experts == 1:
        where = "WanModel (config.json + shards at the top)" if layout == "original" else "transformer"
        print(
            f"  {where}: {shape.num_layers} layers, {shape.num_attention_heads} heads x "
            f"{shape.attention_head_dim}, text_dim {shape.text_dim}, {kind.in_channels} channels in and out, "
            "a timestep per token (expand_timesteps)"
        )
        return 0
    print(
        f"  experts: {shape.num_layers} layers, {shape.num_attention_heads} heads x {shape.attention_head_dim}, "
        f"text_dim {shape.text_dim}, boundary_ratio {shape.boundary_ratio} "
        + (
            "(high_noise_model/ = high noise, low_noise_model/ = low noise)"
            if layout == "original"
            else "(transformer/ = high noise, transformer_2/ = low noise)"
        )
    )
    if not kind.distillable:
        print(f"  {kind.in_channels} input channels ({kind.inputs}); this version does not distil it yet")
    return 0


def write_toy(out_dir: Path, seed: int | None, overwrite: bool, toy_kind: str = "t2v") -> int:
    """Copy a trained toy teacher (`toy_kind` t2v or i2v) into `out_dir` and say what it holds."""
    import json

    from distill.toy.shipped import TOY_TEACHERS, write_toy_teacher
    from distill.toy.world import WORLD_FILE

    source, model, rebuild = TOY_TEACHERS[toy_kind]
    shipped = (
        json.loads((source / WORLD_FILE).read_text())["recipe"]["seed"]
        if (source / WORLD_FILE).is_file()
        else 0
    )
    if seed is not None and seed != shipped:
        raise DistillError(
            f"The shipped toy teacher was trained with seed {shipped}, not {seed}",
            "Its weights are trained (minutes), not drawn at random, so a seed cannot be applied on copying.",
            fixes=[
                f"Leave out --seed, or train one with that seed first: {rebuild} --seed {seed} --output {out_dir}",
            ],
            stage=Stage.SETUP,
        )
    path = write_toy_teacher(out_dir, overwrite=overwrite, source=source)
    description = json.loads((path / WORLD_FILE).read_text())
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    print(f"Wrote the toy {model} teacher (trained, seed {shipped}) to {path} ({total / 1024:.0f} KiB)")
    print(f"  world: {description['grammar']} ({path / WORLD_FILE})")
    if "motion_prompt_example" in description:
        print(
            f"  prompts name the motion only, the image shows the rest: {description['motion_prompt_example']!r}"
        )
    print(
        f"  samples at {description['height']}x{description['width']}, {description['sample_steps']} steps, "
        f"guidance {description['guidance_scale']} / {description['guidance_scale_2']}"
    )
    return 0


# --- convert --------------------------------------------------------------------------------


def convert(src: Path, dst: Path) -> int:
    """Write the diffusers layout of an ORIGINAL Wan 2.2 folder, then check it like --verify."""
    from distill.models.original.convert import convert_original  # imports torch and diffusers lazily

    # Conversion is a layout operation: any model it takes converts (the I2V teacher too); the
    # trainer refuses the kinds it cannot distil when it loads the result.
    convert_original(src, dst)
    return verify(dst, any_kind=True)


if __name__ == "__main__":
    # Before a command imports diffusers or huggingface_hub: a Python without the requirements
    # is told which Python to use (the imports above are the standard library's and this project's).
    require_installed()
    sys.exit(main())
