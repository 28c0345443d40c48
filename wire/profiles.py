"""GPU profiles: the figures of each emulated AMD Instinct model.

A profile is data, not code: one TOML file per model in ``wire/profiles/``,
so adding a model never touches Python. Users add their own beside the built-ins
in ``$XDG_CONFIG_HOME/mirage/profiles/`` (default ``~/.config/mirage/profiles``). Everything that reports a device
property (the shim's ``torch.cuda.get_device_properties``, the cost model, the
console) reads it from a :class:`Profile`. This module must not import torch:
the daemon loads profiles too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path

#: The profile a run uses when none is named.
DEFAULT_PROFILE = "mi350x"

#: Where the bundled profile files live: wire/profiles/, beside this module.
PROFILE_DIR = Path(__file__).with_suffix("")


class ProfileError(ValueError):
    """An unknown profile name, or a profile file that is not well formed."""


@dataclass(frozen=True)
class Profile:
    """One GPU model. Units are in the field names; memory in bytes is binary."""

    name: str  # the short name users type, e.g. "mi350x"
    product: str  # the marketing name torch reports, e.g. "AMD Instinct MI350X"
    arch: str  # "CDNA3", "CDNA4"
    gfx: str  # LLVM target, e.g. "gfx950"
    gcn_arch_name: str  # torch's gcnArchName, target plus features
    major: int  # compute capability as ROCm torch reports it
    minor: int
    compute_units: int
    wavefront: int
    lds_per_cu_kib: int
    l2_cache_bytes: int
    infinity_cache_mb: int
    clock_mhz: int
    fp16_tflops: float  # FP16/BF16, dense
    fp8_tflops: float  # dense
    fp32_tflops: float  # FP32 vector
    fp64_tflops: float  # FP64 vector
    hbm_bytes: int  # what torch reports as total_memory
    hbm_type: str
    hbm_tbps: float
    xgmi_links: int
    xgmi_gbps_per_link: float  # GB/s per link per direction
    nic_gbps: float  # scale-out NIC line rate, Gbit/s, per NIC
    nics_per_node: int  # scale-out NICs per node, one per GPU on rail-optimised platforms
    nic_latency_us: float  # one inter-node step of a collective (NIC, fabric, proxy), LL protocol
    pci_device_id: str  # "vendor:device", hex
    board_power_w: int

    @property
    def hbm_gib(self) -> float:
        """HBM capacity in GiB."""
        return self.hbm_bytes / 2**30


_FIELD_TYPES: dict[str, type] = typing.get_type_hints(Profile)
#: Fields added after user profiles were first written, with the value that keeps what the model did
#: before them (one NIC bounded a ring across nodes), so a profile saved then still loads.
_ADDED_LATER: dict[str, object] = {"nics_per_node": 1}
#: Figures the cost models divide by: 0 is no hardware at all, refused where it is given.
_POSITIVE = {"nics_per_node", "nic_gbps", "xgmi_gbps_per_link", "hbm_tbps"}


def _check_positive(field: str, value: object) -> None:
    if field in _POSITIVE and value <= 0:
        raise ProfileError(f"field {field!r} must be greater than 0, got {value!r}")


def _typed(field: str, value: object) -> object:
    """``value`` as ``Profile.field`` holds it; raise :class:`ProfileError` (without a file) if it cannot be."""
    if field not in _FIELD_TYPES:
        raise ProfileError(f"unknown field {field!r}")
    want = _FIELD_TYPES[field]
    # TOML writes 8 for 8.0; accept an integer where a float is wanted, but
    # never a bool where a number is (bool is an int subclass in Python).
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, want) or isinstance(value, bool):
        raise ProfileError(f"field {field!r} must be {want.__name__}, got {type(value).__name__}")
    _check_positive(field, value)
    return value


def _from_file(path: Path) -> Profile:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ProfileError(f"{path}: {e}") from None
    values: dict[str, object] = {}
    for f in dataclasses.fields(Profile):
        if f.name not in data and f.name in _ADDED_LATER:
            values[f.name] = _ADDED_LATER[f.name]
            continue
        if f.name not in data:
            raise ProfileError(f"{path}: missing field {f.name!r}")
        try:
            values[f.name] = _typed(f.name, data[f.name])
        except ProfileError as e:
            raise ProfileError(f"{path}: {e}") from None
    unknown = sorted(set(data) - set(values))
    if unknown:
        # A misspelt key would otherwise be silently ignored.
        raise ProfileError(f"{path}: unknown field {unknown[0]!r}")
    return Profile(**values)  # type: ignore[arg-type]


def user_profile_dir() -> Path:
    """Where user profiles live: ``$XDG_CONFIG_HOME/mirage/profiles``, default ``~/.config/mirage/profiles``."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    # the XDG spec: a relative XDG_CONFIG_HOME is invalid and must be ignored
    root = Path(base) if os.path.isabs(base) else Path.home() / ".config"
    return root / "mirage" / "profiles"


def builtin_names() -> list[str]:
    """Names of the bundled profiles, sorted."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def user_profile_files() -> dict[str, Path]:
    """The user profiles, name (the file's stem, lower-cased) to file, sorted by name.

    Raises :class:`ProfileError` for a file named like a built-in: it would
    silently change what that name means in every run.
    """
    builtins = set(builtin_names())
    files: dict[str, Path] = {}
    for path in sorted(user_profile_dir().glob("*.toml")):
        name = path.stem.lower()
        if name in builtins:
            raise ProfileError(f"{path}: a user profile may not shadow the built-in profile {name!r}; rename the file")
        files[name] = path
    return files


def profile_names() -> list[str]:
    """Names of every profile, built-in and user, sorted."""
    return sorted([*builtin_names(), *user_profile_files()])


def profile_path(name: str) -> Path:
    """The file the profile ``name`` (case-insensitive) or ``.toml`` path loads from.

    Raises :class:`ProfileError` for an unknown name, naming the valid choices.
    """
    if name.endswith(".toml"):
        return Path(name)
    key = name.lower()
    user = user_profile_files()  # first: a user file shadowing a built-in is an error even for the built-in
    if key in builtin_names():
        return PROFILE_DIR / f"{key}.toml"
    if key in user:
        return user[key]
    raise ProfileError(f"unknown profile {name!r}; choose one of: {', '.join(profile_names())}")


def list_profiles() -> list[Profile]:
    """Every profile, built-in and user, sorted by name."""
    return [load_profile(name) for name in profile_names()]


def load_profile(name: str) -> Profile:
    """Load the profile ``name`` (built-in or user, case-insensitive) or a ``.toml`` file path.

    Raises :class:`ProfileError` for an unknown name, naming the valid choices,
    or for a malformed file, naming the file and the field.
    """
    path = profile_path(name)
    profile = _from_file(path)
    if not name.endswith(".toml") and profile.name != path.stem.lower():
        # the name a run was asked for must be the one its devices report
        raise ProfileError(f"{path}: field 'name' is {profile.name!r}, but the file is named for {path.stem.lower()!r}")
    return profile


#: A name ``create_user_profile`` accepts: what a user can type and a file system keeps.
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}\Z")


def profile_values(profile: Profile) -> dict[str, object]:
    """``profile``'s fields, in file order, as the TOML has them."""
    return {f.name: getattr(profile, f.name) for f in dataclasses.fields(Profile)}


def parse_field(field: str, text: str) -> object:
    """``text`` from a command line as a value of ``Profile.field``; raise :class:`ProfileError` if it is not one."""
    if field not in _FIELD_TYPES:
        raise ProfileError(f"unknown field {field!r}; choose one of: {', '.join(_FIELD_TYPES)}")
    want = _FIELD_TYPES[field]
    if want is str:
        return text
    try:
        value = want(text)
    except ValueError:
        raise ProfileError(f"field {field!r} must be {want.__name__}, got {text!r}") from None
    # a data-sheet figure is never negative or infinite; such a value would only break the cost models later
    if not (math.isfinite(value) and value >= 0):
        raise ProfileError(f"field {field!r} must be a finite number of at least 0, got {text!r}")
    _check_positive(field, value)
    return value


def _toml_value(value: object) -> str:
    # json's string escapes are valid TOML basic-string escapes; repr of an int or float is a TOML number
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)


def create_user_profile(name: str, base: str, overrides: dict[str, object], force: bool = False) -> Path:
    """Write the user profile ``name``: ``base``'s figures with ``overrides``; return its file.

    Raises :class:`ProfileError` for a name that is not a simple lower-case
    identifier or is a built-in's, for an unknown base or field, a value of the
    wrong type, or an existing file without ``force``.
    """
    if not _NAME.match(name):
        raise ProfileError(
            f"a profile name is a lower-case letter, then letters, digits, '-' or '_' (64 at most), got {name!r}"
        )
    if name in builtin_names():
        raise ProfileError(f"{name!r} is a built-in profile; choose another name")
    if "name" in overrides:
        raise ProfileError("field 'name' is the new profile's NAME; set it there")
    source = load_profile(base)
    values = profile_values(source) | {field: _typed(field, value) for field, value in overrides.items()}
    values["name"] = name
    path = user_profile_dir() / f"{name}.toml"
    if path.exists() and not force:
        raise ProfileError(f"{path} already exists; pass --force to overwrite it")
    changed = ", ".join(f"{k} = {_toml_value(v)}" for k, v in overrides.items()) or "nothing"
    lines = [
        f"# mirage user profile {name!r}, made by 'mirage profiles create' from {source.name!r} ({source.product}).",
        f"# Changed: {changed}.",
        *(f"{k} = {_toml_value(v)}" for k, v in values.items()),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def bus_id(device: int) -> str:
    """The PCI bus id NCCL prints for the node's GPU ``device`` (a hex integer): GPU i sits on bus i+1."""
    return f"{(device + 1) << 12:x}"
