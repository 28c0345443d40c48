"""The bundled GPU profiles load, carry the data-sheet figures, and bad ones fail clearly."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from wire.profiles import (
    DEFAULT_PROFILE,
    PROFILE_DIR,
    Profile,
    ProfileError,
    list_profiles,
    load_profile,
    parse_field,
    profile_names,
    user_profile_dir,
)

NAMES = ["mi300x", "mi325x", "mi350x", "mi355x"]
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_user_profiles(monkeypatch, tmp_path):
    """The bundled profiles alone, whatever the user running the tests keeps in ~/.config."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def test_bundled_names():
    assert profile_names() == NAMES
    assert [p.name for p in list_profiles()] == NAMES
    assert DEFAULT_PROFILE in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_file_name_matches_profile_name(name):
    assert load_profile(name).name == name


def test_mi300x_figures():
    p = load_profile("mi300x")
    assert (p.product, p.arch, p.gfx, p.gcn_arch_name) == (
        "AMD Instinct MI300X",
        "CDNA3",
        "gfx942",
        "gfx942:sramecc+:xnack-",
    )
    assert (p.major, p.minor, p.compute_units, p.wavefront) == (9, 4, 304, 64)
    assert p.hbm_bytes == 192 * 2**30 and p.hbm_gib == 192
    assert (p.hbm_type, p.hbm_tbps) == ("HBM3", 5.3)
    assert (p.fp16_tflops, p.fp8_tflops) == (1307.4, 2614.9)
    assert (p.xgmi_links, p.xgmi_gbps_per_link) == (7, 64.0)
    assert (p.pci_device_id, p.board_power_w) == ("1002:74a1", 750)


def test_mi350x_figures():
    p = load_profile("mi350x")
    assert (p.arch, p.gfx, p.major, p.minor) == ("CDNA4", "gfx950", 9, 5)
    assert (p.compute_units, p.lds_per_cu_kib, p.clock_mhz) == (256, 160, 2200)
    assert p.l2_cache_bytes == 4 * 1024 * 1024 and p.infinity_cache_mb == 256
    assert p.hbm_bytes == 288 * 2**30 and p.hbm_type == "HBM3E" and p.hbm_tbps == 8.0
    assert (p.fp16_tflops, p.fp8_tflops) == (2300.0, 4600.0)
    assert p.xgmi_gbps_per_link == 76.8
    assert (p.pci_device_id, p.board_power_w) == ("1002:75a0", 1000)


def test_other_profiles_differ_where_the_data_sheets_do():
    mi325, mi355 = load_profile("mi325x"), load_profile("mi355x")
    assert (mi325.hbm_bytes, mi325.hbm_tbps, mi325.pci_device_id) == (256 * 2**30, 6.0, "1002:74a5")
    assert (mi355.clock_mhz, mi355.fp16_tflops, mi355.board_power_w) == (2400, 2500.0, 1400)
    assert mi355.pci_device_id == "1002:75a3"


def test_name_is_case_insensitive():
    assert load_profile("MI350X") == load_profile("mi350x")


def test_profile_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        load_profile("mi300x").compute_units = 1  # type: ignore[misc]


def test_unknown_name_lists_choices():
    with pytest.raises(ProfileError) as e:
        load_profile("h100")
    assert str(e.value) == "unknown profile 'h100'; choose one of: mi300x, mi325x, mi350x, mi355x"


def _write_variant(tmp_path: Path, drop: str = "", replace: tuple[str, str] | None = None) -> Path:
    """A copy of the mi350x file with one line dropped or one value replaced."""
    lines = []
    for line in (PROFILE_DIR / "mi350x.toml").read_text().splitlines():
        key = line.split("=")[0].strip()
        if drop and key == drop:
            continue
        if replace and key == replace[0]:
            line = f"{key} = {replace[1]}"
        lines.append(line)
    path = tmp_path / "custom.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_path_to_toml_loads(tmp_path):
    path = _write_variant(tmp_path, replace=("compute_units", "128"))
    p = load_profile(str(path))
    assert isinstance(p, Profile) and p.compute_units == 128


def test_integer_accepted_for_float(tmp_path):
    assert load_profile(str(_write_variant(tmp_path, replace=("hbm_tbps", "8")))).hbm_tbps == 8.0


def test_missing_field_names_file_and_field(tmp_path):
    path = _write_variant(tmp_path, drop="compute_units")
    with pytest.raises(ProfileError, match=r"custom\.toml: missing field 'compute_units'"):
        load_profile(str(path))


def test_a_profile_saved_before_nics_per_node_loads_with_one_nic(tmp_path):
    # one NIC bounded a ring across nodes before the field existed: the old profile keeps that model
    assert load_profile(str(_write_variant(tmp_path, drop="nics_per_node"))).nics_per_node == 1


@pytest.mark.parametrize("key,value", [("nics_per_node", "0"), ("nic_gbps", "0.0"), ("hbm_tbps", "0")])
def test_a_figure_the_cost_models_divide_by_is_never_zero(tmp_path, key, value):
    with pytest.raises(ProfileError, match=rf"custom\.toml: field '{key}' must be greater than 0"):
        load_profile(str(_write_variant(tmp_path, replace=(key, value))))
    with pytest.raises(ProfileError, match=rf"field '{key}' must be greater than 0"):
        parse_field(key, value)


@pytest.mark.parametrize(
    "key,value,want",
    [
        ("compute_units", '"256"', "int, got str"),
        ("fp16_tflops", "true", "float, got bool"),
        ("product", "7", "str, got int"),
        ("major", "9.0", "int, got float"),
    ],
)
def test_wrong_type_names_file_and_field(tmp_path, key, value, want):
    path = _write_variant(tmp_path, replace=(key, value))
    with pytest.raises(ProfileError, match=rf"custom\.toml: field '{key}' must be {want}"):
        load_profile(str(path))


def test_unknown_field_is_an_error(tmp_path):
    path = _write_variant(tmp_path)
    path.write_text(path.read_text() + "compute_unit = 3\n")
    with pytest.raises(ProfileError, match=r"custom\.toml: unknown field 'compute_unit'"):
        load_profile(str(path))


def test_invalid_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ProfileError, match=r"bad\.toml: "):
        load_profile(str(bad))
    with pytest.raises(ProfileError, match=r"absent\.toml: "):
        load_profile(str(tmp_path / "absent.toml"))


def test_profiles_module_does_not_import_torch():
    code = "import sys, wire.profiles as p; p.list_profiles(); print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    )
    assert out.stdout.strip() == "False"


def test_user_profile_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert user_profile_dir() == tmp_path / "mirage" / "profiles"
    # the XDG spec: an unset or relative XDG_CONFIG_HOME means ~/.config
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative")
    assert user_profile_dir() == tmp_path / "home" / ".config" / "mirage" / "profiles"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert user_profile_dir() == tmp_path / "home" / ".config" / "mirage" / "profiles"


def test_user_profiles_join_the_names(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    folder = tmp_path / "mirage" / "profiles"
    folder.mkdir(parents=True)
    (folder / "lab.toml").write_text((PROFILE_DIR / "mi300x.toml").read_text().replace('"mi300x"', '"lab"'))
    assert profile_names() == sorted([*NAMES, "lab"])
    assert load_profile("LAB").gfx == "gfx942"
    assert [p.name for p in list_profiles()] == profile_names()
