"""GPU profiles: the figures of each emulated AMD Instinct model.

A profile is data, not code: one TOML file per model in ``emulator/profiles/``,
so adding a model never touches Python. Everything that reports a device
property (the shim's ``torch.cuda.get_device_properties``, the cost model, the
console) reads it from a :class:`Profile`. This module must not import torch:
the daemon loads profiles too.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path

#: The profile a run uses when none is named.
DEFAULT_PROFILE = "mi350x"

#: Where the bundled profile files live: emulator/profiles/, beside this module.
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
    nic_gbps: float  # scale-out NIC line rate per GPU, Gbit/s (one NIC per GPU)
    nic_latency_us: float  # one inter-node step of a collective (NIC, fabric, proxy), LL protocol
    pci_device_id: str  # "vendor:device", hex
    board_power_w: int

    @property
    def hbm_gib(self) -> float:
        """HBM capacity in GiB."""
        return self.hbm_bytes / 2**30


_FIELD_TYPES: dict[str, type] = typing.get_type_hints(Profile)


def _from_file(path: Path) -> Profile:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ProfileError(f"{path}: {e}") from None
    values: dict[str, object] = {}
    for f in dataclasses.fields(Profile):
        if f.name not in data:
            raise ProfileError(f"{path}: missing field {f.name!r}")
        want, value = _FIELD_TYPES[f.name], data[f.name]
        # TOML writes 8 for 8.0; accept an integer where a float is wanted, but
        # never a bool where a number is (bool is an int subclass in Python).
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or isinstance(value, bool):
            raise ProfileError(
                f"{path}: field {f.name!r} must be {want.__name__}, got {type(value).__name__}"
            )
        values[f.name] = value
    unknown = sorted(set(data) - set(values))
    if unknown:
        # A misspelt key would otherwise be silently ignored.
        raise ProfileError(f"{path}: unknown field {unknown[0]!r}")
    return Profile(**values)  # type: ignore[arg-type]


def profile_names() -> list[str]:
    """Names of the bundled profiles, sorted."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def list_profiles() -> list[Profile]:
    """Every bundled profile, sorted by name."""
    return [_from_file(PROFILE_DIR / f"{name}.toml") for name in profile_names()]


def load_profile(name: str) -> Profile:
    """Load the bundled profile ``name`` (case-insensitive) or a ``.toml`` file path.

    Raises :class:`ProfileError` for an unknown name, naming the valid choices,
    or for a malformed file, naming the file and the field.
    """
    if name.endswith(".toml"):
        return _from_file(Path(name))
    names = profile_names()
    if name.lower() not in names:
        raise ProfileError(f"unknown profile {name!r}; choose one of: {', '.join(names)}")
    return _from_file(PROFILE_DIR / f"{name.lower()}.toml")


def bus_id(device: int) -> str:
    """The PCI bus id NCCL prints for the node's GPU ``device`` (a hex integer): GPU i sits on bus i+1."""
    return f"{(device + 1) << 12:x}"
