"""A LoRA folder as every command meets it: `train_distillation.py --student_lora_init`,
`python -m distill.generate --student` and `python -m distill.evaluate --student`.

    lora/            diffusers keys, adapter_config.json (rank, alpha, targets)
    lora/comfyui/    the same adapters in Wan keys, an alpha per module (no adapter_config.json)

A folder holds one file per expert: high_noise_lora / low_noise_lora for the two A14B experts, or
lora.safetensors for the one transformer of TI2V-5B (`LoraFolder.experts` says which).

`check_lora_folder` reads the safetensors headers only (shapes, never the weights) and refuses, with
the file, the key and the shape named, anything that would fail or silently differ once the weights
are applied: a missing or cut-short file, a key that is no Wan transformer LoRA key, an
adapter_config.json whose rank, alpha or targets disagree with the tensors, and, given the teacher,
adapters whose shapes or blocks are another teacher's (naming the teacher they were trained on when
the run's run_settings.json says). `LoraFolder.states()` then loads the weights in diffusers' key
names, whichever of the two formats the folder holds; `LoraFolder.recorded_kind` is what the folder
says of the Wan 2.2 model its adapters were trained on (distill.sample.lora_fit judges it).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distill.config.settings import LORA_TARGETS
from distill.models.layout import safetensors_problem
from distill.models.lora import EXPERTS, ONE_EXPERT, LoraShape
from distill.models.lora_files import (
    FILES,
    KIND_KEY,
    LORA_SUFFIXES,
    ONE_FILE,
    WAN_FORMAT_DIR,
    lora_files,
    wan_module_name,
)
from distill.ops.errors import DistillError, Stage

CONFIG_FILE = "adapter_config.json"
EXPERT_FOLDERS = {"high": "transformer", "low": "transformer_2"}
# A module of one block, as peft names it (attn1 = self-attention, attn2 = cross-attention), and the
# --student_lora_targets name that selects it.
BLOCK_MODULES = {
    **{f"{attn}.{t}": t for attn in ("attn1", "attn2") for t in LORA_TARGETS if t.startswith("to_")},
    **{t: t for t in LORA_TARGETS if not t.startswith("to_")},
}
WAN_KINDS = {wan: kind for kind, wan in LORA_SUFFIXES.items()}  # lora_down -> lora_A


@functools.cache
def wan_modules() -> dict[str, str]:
    """The block modules in Wan's names (what lora/comfyui/ holds): self_attn.q -> attn1.to_q, ...

    Built on first use, not at import: the names are checked against diffusers' converter, whose
    module pulls in much of transformers, and most processes never read a Wan-format file."""
    return {wan_module_name(f"blocks.0.{m}").removeprefix("blocks.0."): m for m in BLOCK_MODULES}


@dataclass(frozen=True)
class LoraFolder:
    """A checked LoRA folder: its adapters' shape and, per expert, every tensor's shape by its
    diffusers key name (`blocks.0.attn1.to_q.lora_A.weight`)."""

    path: Path
    wan_format: bool  # lora/comfyui/: Wan key names
    shape: LoraShape
    experts: tuple[str, ...]  # EXPERTS (two files), or ONE_EXPERT (lora.safetensors: one transformer)
    shapes: dict[str, dict[str, tuple[int, ...]]]
    keys: dict[str, dict[str, str]] = field(repr=False)  # expert -> diffusers key -> key in the file
    recorded_kind: tuple[str, str] | None = None
    """(value, where) of the teacher kind the folder itself records (KIND_KEY in adapter_config.json
    or in a file's metadata), None when it records none: LoRA layers have the same shapes on every
    Wan 2.2 A14B model, so only a record tells a text-to-video folder from an image-to-video one."""

    def file(self, which: str) -> Path:
        return self.path / lora_files(self.experts)[which]

    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        """{"high": state, "low": state} ({"high": state} for one transformer) in diffusers key names,
        the weights as the files hold them."""
        from safetensors import safe_open

        states = {}
        for which in self.experts:
            with safe_open(self.file(which), "pt") as handle:
                states[which] = {key: handle.get_tensor(name) for key, name in self.keys[which].items()}
        return states


def check_lora_folder(folder: str | Path, flag: str) -> LoraFolder:
    """The LoRA folder `folder` (given as `flag`), checked whole from the files' headers (whether it
    fits a teacher is distill.sample.lora_fit's question)."""
    folder = Path(folder)
    experts = _experts(folder, flag)
    names = lora_files(experts)
    headers = {which: _header(folder / names[which], flag) for which in experts}
    wan_format = any(key.startswith("diffusion_model.") for key in headers["high"])
    parsed = {which: _parse(folder / names[which], headers[which], wan_format, flag) for which in experts}
    shape = _shape(folder, parsed, wan_format, flag)
    found = LoraFolder(
        folder,
        wan_format,
        shape,
        experts,
        {w: {k: s for k, (s, _) in p.modules.items()} for w, p in parsed.items()},
        {w: {k: n for k, (_, n) in p.modules.items()} for w, p in parsed.items()},
        _recorded_kind(folder, parsed),
    )
    return found


def _experts(folder: Path, flag: str) -> tuple[str, ...]:
    """Which experts `folder` holds adapters for, from its file names: both A14B experts (FILES) or
    the one transformer (ONE_FILE); a folder with neither set whole, or with both, is refused."""
    two = [name for name in FILES.values() if (folder / name).is_file()]
    one = [name for name in ONE_FILE.values() if (folder / name).is_file()]
    if one and two:
        raise _error(
            f"{flag} {folder} holds adapters for one transformer and for two experts",
            f"{', '.join(one)} (a teacher with one transformer, TI2V-5B) beside {', '.join(two)} (the two "
            "experts of an A14B teacher): one run never writes both",
            causes=["the files of two LoRA runs were copied into one folder"],
            fixes=[
                f"keep the files of one run in {folder}: copy its lora/ folder again into an empty folder"
            ],
        )
    if one:
        return ONE_EXPERT
    if len(two) == len(FILES):
        return EXPERTS
    found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    inside = [
        folder / name
        for name in ("lora", "lora_ema")
        if any((folder / name / f).is_file() for f in (FILES["high"], *ONE_FILE.values()))
    ]
    missing = [name for name in FILES.values() if name not in two]
    raise _error(
        f"{flag} {folder} holds no LoRA adapters" if not two else f"{flag} {folder}: {missing[0]} is missing",
        f"expected {', '.join(FILES.values())} (two experts) or {', '.join(ONE_FILE.values())} (one "
        f"transformer) there; it holds: {', '.join(found) or 'nothing'}",
        fixes=[
            *([f"pass {inside[0]}: the adapters of the run in {folder}"] if inside else []),
            "pass the lora/ (or lora_ema/, or lora/comfyui/) folder a LoRA run of train_distillation.py "
            "wrote into its --output_dir",
            "or copy the folder again: the files of both experts belong together",
        ],
    )


def _recorded_kind(folder: Path, parsed: dict[str, _Parsed]) -> tuple[str, str] | None:
    """What the folder records of its teacher's kind: adapter_config.json first, then the files'
    metadata (the comfyui/ format has no adapter_config.json)."""
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError):  # absent (comfyui/) or already refused by _shape
        config = None
    if isinstance(config, dict) and isinstance(config.get(KIND_KEY), str):
        return config[KIND_KEY], f"{folder / CONFIG_FILE}: {KIND_KEY} = {config[KIND_KEY]}"
    for which, part in parsed.items():
        value = part.metadata.get(KIND_KEY)
        if value:
            return value, f"{folder / _name(parsed, which)} (its metadata): {KIND_KEY} = {value}"
    return None


@dataclass
class _Parsed:
    modules: dict[str, tuple[tuple[int, ...], str]]  # diffusers key -> (shape, key in the file)
    alphas: dict[str, float]  # Wan format: module -> alpha
    metadata: dict[str, str]


def _header(path: Path, flag: str) -> dict[str, Any]:
    header: dict[str, Any] = {}
    try:
        problem = safetensors_problem(path)  # a cut-short file, or one that is no safetensors file at all
        if problem is None:
            with path.open("rb") as handle:
                header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
            entries = [e for k, e in header.items() if k != "__metadata__"]
            if not all(isinstance(e, dict) and isinstance(e.get("shape"), list) for e in entries):
                problem = "its header lists an entry without a shape: not a safetensors file"
    except (OSError, ValueError, AttributeError, TypeError, KeyError) as exc:  # a header that is no mapping
        problem = f"not a safetensors file ({type(exc).__name__}: {exc})"
    if problem is not None:
        raise _error(
            f"{flag}: {path} is damaged",
            problem,
            causes=["an interrupted copy or download", "a full disk while it was written"],
            fixes=[
                f"copy {path.parent} again from the --output_dir of the run that wrote it (an export is "
                "written whole and renamed into place, so the run's own copy is complete)",
            ],
        )
    return header


def _parse(path: Path, header: Mapping[str, Any], wan_format: bool, flag: str) -> _Parsed:
    parsed = _Parsed({}, {}, dict(header.get("__metadata__") or {}))
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        key = _diffusers_key(name, wan_format)
        if key is None:
            raise _error(
                f"{flag}: {path} holds a key that is no LoRA key of a Wan transformer: {name}",
                "expected "
                + (
                    "diffusion_model.blocks.N.<self_attn|cross_attn>.<q|k|v|o>.<lora_down|lora_up>.weight, "
                    "ffn.0 / ffn.2 and .alpha (the comfyui/ format)"
                    if wan_format
                    else "transformer.blocks.N.<attn1|attn2>.<to_q|to_k|to_v|to_out.0>.<lora_A|lora_B>.weight "
                    "and ffn.net.0.proj / ffn.net.2 (the diffusers format)"
                ),
                causes=["a LoRA file of another model or tool, or one of both formats mixed into the other"],
                fixes=["pass a lora/ (or lora/comfyui/) folder a LoRA run of train_distillation.py wrote"],
            )
        if key.endswith(".alpha"):
            parsed.alphas[key.removesuffix(".alpha")] = float("nan")  # the value is read below
        else:
            parsed.modules[key] = (tuple(entry["shape"]), name)
    if parsed.alphas:
        from safetensors import safe_open

        with safe_open(path, "pt") as handle:  # scalars only
            for name in header:
                key = _diffusers_key(name, wan_format)
                if key and key.endswith(".alpha"):
                    parsed.alphas[key.removesuffix(".alpha")] = float(handle.get_tensor(name))
    return parsed


def _diffusers_key(name: str, wan_format: bool) -> str | None:
    """`name` of a file as the diffusers key `blocks.N.<module>.lora_A.weight` (or `.alpha`), None if
    it is no key of a Wan transformer LoRA in that format."""
    if wan_format:
        prefix, _, rest = name.partition(".")
        parts = rest.split(".")
        if prefix != "diffusion_model" or len(parts) < 4 or parts[0] != "blocks" or not parts[1].isdigit():
            return None
        block, tail = parts[1], ".".join(parts[2:])
        if tail.endswith(".alpha"):
            module, kind = tail.removesuffix(".alpha"), "alpha"
        else:
            module, _, kind = tail.removesuffix(".weight").rpartition(".")
            if not tail.endswith(".weight") or kind not in WAN_KINDS:
                return None
            kind = f"{WAN_KINDS[kind]}.weight"
        if module not in wan_modules():
            return None
        return f"blocks.{block}.{wan_modules()[module]}.{kind}"
    parts = name.removeprefix("transformer.").split(".")
    if len(parts) < 5 or parts[0] != "blocks" or not parts[1].isdigit() or parts[-1] != "weight":
        return None
    module, kind = ".".join(parts[2:-2]), parts[-2]
    if module not in BLOCK_MODULES or kind not in LORA_SUFFIXES:
        return None
    return ".".join(parts)


def _name(parsed: Mapping[str, Any], which: str) -> str:
    """The file name of expert `which` in a folder whose files `parsed` holds (one per expert)."""
    return lora_files(tuple(parsed))[which]


def _module(key: str) -> str:
    """`blocks.0.attn1.to_q.lora_A.weight` -> `blocks.0.attn1.to_q`."""
    return key.rsplit(".", 2)[0]


def _shape(folder: Path, parsed: dict[str, _Parsed], wan_format: bool, flag: str) -> LoraShape:
    """The adapters' rank, alpha and targets, from the tensors, checked against what the folder says
    of them (adapter_config.json and the files' metadata; the Wan format's alpha per module)."""
    ranks: dict[int, str] = {}
    for which, part in parsed.items():
        if not part.modules:
            raise _error(
                f"{flag}: {folder / _name(parsed, which)} holds no adapter tensors", fixes=_copy_again(folder)
            )
        modules: dict[str, set[str]] = {}
        for key, (shape, name) in part.modules.items():
            kind = key.rsplit(".", 2)[1]
            modules.setdefault(_module(key), set()).add(kind)
            if len(shape) != 2:
                raise _error(
                    f"{flag}: {folder / _name(parsed, which)}: {name} has shape {list(shape)}",
                    "a LoRA weight is a matrix: lora_A (down) is [rank, in], lora_B (up) is [out, rank]",
                    fixes=_copy_again(folder),
                )
            rank = shape[0] if kind == "lora_A" else shape[1]
            ranks.setdefault(rank, f"{_name(parsed, which)}: {name} {list(shape)}")
        unpaired = sorted(m for m, kinds in modules.items() if len(kinds) != 2)
        if unpaired:
            raise _error(
                f"{flag}: {folder / _name(parsed, which)}: {unpaired[0]} has only one of its two LoRA matrices",
                f"{len(unpaired)} module(s) without their pair, first: {unpaired[0]}",
                fixes=_copy_again(folder),
            )
    if len(ranks) > 1:
        (rank, first), (other, second) = list(ranks.items())[:2]
        raise _error(
            f"{flag}: the adapters in {folder} mix ranks {rank} and {other}",
            f"{first}\n{second}",
            fixes=_copy_again(folder),
        )
    rank = next(iter(ranks))
    targets = tuple(
        sorted(
            {BLOCK_MODULES[_module(k).split(".", 2)[2]] for part in parsed.values() for k in part.modules},
            key=LORA_TARGETS.index,
        )
    )
    if wan_format:
        return LoraShape(rank, _wan_alpha(folder, parsed, rank, flag), targets)
    config = _read_config(folder, flag)
    said = {"r": rank, "lora_alpha": config.get("lora_alpha", rank), "target_modules": list(targets)}
    for key in said:
        if key not in config:
            raise _error(
                f"{flag}: {folder / CONFIG_FILE} has no {key!r}",
                f"it holds: {json.dumps(config)}",
                fixes=[f"write {json.dumps(said)} into it"],
            )
    named = config["target_modules"]
    try:
        named = named.split(",") if isinstance(named, str) else named  # peft also takes "to_q,to_k"
        shape = LoraShape(int(config["r"]), float(config["lora_alpha"]), tuple(named))
    except (TypeError, ValueError, AttributeError) as exc:
        raise _error(
            f"{flag}: {folder / CONFIG_FILE} holds a value of the wrong type",
            f"{type(exc).__name__}: {exc}\nit holds: {json.dumps(config)}",
            fixes=['"r": an integer, "lora_alpha": a number, "target_modules": a list of names'],
        ) from None
    if shape.rank != rank:
        raise _error(
            f'{flag}: {folder / CONFIG_FILE} says "r": {shape.rank}, but the adapters are rank {rank}',
            f"{ranks[rank]} (lora_A is [rank, in], lora_B is [out, rank])",
            causes=[f"{CONFIG_FILE} was edited, or copied from another run"],
            fixes=[f'write "r": {rank} in {folder / CONFIG_FILE}', *_copy_again(folder)],
        )
    if set(shape.targets) != set(targets):
        raise _error(
            f"{flag}: {folder / CONFIG_FILE} names other target modules than the adapters hold",
            f"{CONFIG_FILE}: {','.join(shape.targets)}\ntensors: {','.join(targets)}",
            causes=[f"{CONFIG_FILE} was edited, or copied from another run"],
            fixes=[
                f'write "target_modules": {json.dumps(list(targets))} in {folder / CONFIG_FILE}',
                *_copy_again(folder),
            ],
        )
    _check_file_metadata(folder, parsed, config, flag)
    return LoraShape(rank, shape.alpha, targets)


def _read_config(folder: Path, flag: str) -> dict[str, Any]:
    """adapter_config.json, read as a JSON object."""
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise _error(
            f"{flag}: {path} is missing",
            "the diffusers-format adapter files need it beside them (rank, alpha and target modules)",
            fixes=[*_copy_again(folder), f"or pass {folder / WAN_FORMAT_DIR}, the same adapters in Wan keys"],
        ) from None
    except (OSError, ValueError) as exc:
        raise _error(
            f"{flag}: cannot read {path}", f"{type(exc).__name__}: {exc}", fixes=_copy_again(folder)
        ) from None
    if not isinstance(config, dict):
        raise _error(
            f"{flag}: {path} is not a JSON object",
            f"it holds: {str(config)[:200]}",
            fixes=_copy_again(folder),
        )
    return config


def _check_file_metadata(folder: Path, parsed: dict[str, _Parsed], config: dict[str, Any], flag: str) -> None:
    path = folder / CONFIG_FILE
    for which, part in parsed.items():
        try:
            meta = json.loads(part.metadata.get("lora_adapter_metadata", "{}"))
        except ValueError:
            meta = None
        if not isinstance(meta, dict):
            meta = {}
        # diffusers' load_lora_weights (generate) builds the adapters from the file's own metadata, this
        # project (train, evaluate) from adapter_config.json: the two must say the same.
        for key in ("r", "lora_alpha", "target_modules"):
            theirs, ours = meta.get(f"transformer.{key}"), config.get(key)
            if theirs is None or ours is None or _same(theirs, ours):
                continue
            raise _error(
                f"{flag}: {path} and {_name(parsed, which)} disagree on {key}",
                f"{CONFIG_FILE}: {json.dumps(ours)}\n{_name(parsed, which)} (its lora_adapter_metadata): {json.dumps(theirs)}",
                causes=[f"{CONFIG_FILE} was edited, or copied from another run"],
                fixes=[f'write "{key}": {json.dumps(theirs)} in {path}', *_copy_again(folder)],
            )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) or isinstance(b, list):  # targets: the same modules in any order or spelling
        return _names(a) == _names(b)
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return a == b


def _names(value: Any) -> set[str]:
    """Target module names of a list or of peft's comma-separated text."""
    names = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]
    return {str(name).strip() for name in names}


def _wan_alpha(folder: Path, parsed: dict[str, _Parsed], rank: int, flag: str) -> float:
    """The one alpha of Wan-format adapters (each module carries its own; none = the rank)."""
    found: dict[float, str] = {}
    for which, part in parsed.items():
        modules = {_module(k) for k in part.modules}
        without = sorted(modules - set(part.alphas))
        if part.alphas and without:
            raise _error(
                f"{flag}: {folder / _name(parsed, which)}: {without[0]} has no alpha, other modules do",
                fixes=_copy_again(folder),
            )
        for module, alpha in part.alphas.items():
            found.setdefault(alpha, f"{_name(parsed, which)}: {module}.alpha = {alpha:g}")
    if len(found) > 1:
        raise _error(
            f"{flag}: the adapters in {folder} carry different alphas",
            "\n".join(list(found.values())[:2]),
            causes=["a LoRA file of another tool; this project writes one alpha for every module"],
            fixes=["pass the lora/ folder beside it (diffusers keys), or a folder this project wrote"],
        )
    return next(iter(found)) if found else float(rank)


def _copy_again(folder: Path) -> list[str]:
    return [f"copy {folder} again from the --output_dir of the LoRA run that wrote it"]


def _error(
    title: str, details: str = "", *, causes: list[str] | None = None, fixes: list[str]
) -> DistillError:
    # The folder a flag names is the user's input: refused as a config mistake, before any work.
    return DistillError(title, details, causes=causes or [], fixes=fixes, stage=Stage.CONFIG)


def read_lora_folder(folder: str | Path) -> tuple[LoraShape, dict[str, dict[str, torch.Tensor]]]:
    """(shape, {"high": state, "low": state}) of a folder `write_lora_folder` wrote (lora/ or
    lora/comfyui/), in diffusers key names without the `transformer.` prefix, checked first."""
    found = check_lora_folder(folder, "LoRA folder")
    return found.shape, found.states()
