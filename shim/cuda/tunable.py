"""TunableOp (``torch.cuda.tunable``) on the emulated GPUs: its settings as a ROCm build keeps them, nothing tuned.

On ROCm, TunableOp times the candidate GEMM kernels (hipBLASLt, rocBLAS) for
each shape and keeps the fastest; programs and launch scripts turn it on with
``PYTORCH_TUNABLEOP_*`` variables or ``torch.cuda.tunable.enable()``. A CPU
build has none of its entry points (``AttributeError``). Here the settings are
read from the same variables, set and read back as torch's ``TuningContext``
does; with no device kernels to time, no GEMM is tuned: ``get_results()`` is
empty and no results file is written. Turning it on says so once on stderr.
"""

from __future__ import annotations

import os
import sys

import torch

NOTICE = ("mirage: TunableOp is on, and tunes nothing on the emulated GPUs (no kernels to time; no results file "
          "is written); this notice is printed once")


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value == "1"


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


class TuningContext:
    """``at::cuda::tunable::TuningContext``'s settings, from ``PYTORCH_TUNABLEOP_*`` with torch's defaults."""

    def __init__(self):
        self.noticed = False
        self.enabled = False
        self.enable(_env_flag("PYTORCH_TUNABLEOP_ENABLED", False))
        self.tuning = _env_flag("PYTORCH_TUNABLEOP_TUNING", True)
        self.record_untuned = _env_flag("PYTORCH_TUNABLEOP_RECORD_UNTUNED", False)
        self.max_duration_ms = _env_int("PYTORCH_TUNABLEOP_MAX_TUNING_DURATION_MS", 30)
        self.max_iterations = _env_int("PYTORCH_TUNABLEOP_MAX_TUNING_ITERATIONS", 100)
        self.filename = os.environ.get("PYTORCH_TUNABLEOP_FILENAME", "tunableop_results.csv")
        self.insert_ordinal = True  # a ROCm build names each device's file: tunableop_results0.csv
        self.rotating_mb = _env_int("PYTORCH_TUNABLEOP_ROTATING_BUFFER_SIZE", -1)

    def enable(self, value: bool = True) -> None:
        """``enable``: on or off; the first time on, one line says nothing will be tuned."""
        self.enabled = bool(value)
        if self.enabled and not self.noticed:
            self.noticed = True
            print(NOTICE, file=sys.stderr, flush=True)

    def set_filename(self, filename: str, insert_device_ordinal: bool = False) -> None:
        self.filename, self.insert_ordinal = filename, insert_device_ordinal

    def get_filename(self) -> str:
        """The results file's name, with the current device's ordinal before its extension when asked."""
        if not self.insert_ordinal:
            return self.filename
        stem, dot, ext = self.filename.rpartition(".")
        device = torch.cuda.current_device()
        return f"{stem}{device}.{ext}" if dot else f"{self.filename}{device}"

    def rotating_buffer_size(self) -> int:
        """Bytes: the size set (in MiB), or the device's L2 cache where none is (torch's answer)."""
        if self.rotating_mb < 0:
            return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
        return self.rotating_mb * 1024 * 1024

    def set_rotating_buffer_size(self, mb: int) -> None:
        self.rotating_mb = mb


def install() -> None:
    """Give the CPU build's ``torch._C`` the entry points ``torch.cuda.tunable`` calls."""
    ctx = TuningContext()

    def setter(name):
        return lambda value=True: setattr(ctx, name, value)

    for name, fn in {
        "_cuda_tunableop_enable": ctx.enable,
        "_cuda_tunableop_is_enabled": lambda: ctx.enabled,
        "_cuda_tunableop_tuning_enable": setter("tuning"),
        "_cuda_tunableop_tuning_is_enabled": lambda: ctx.tuning,
        "_cuda_record_untuned_enable": setter("record_untuned"),
        "_cuda_record_untuned_is_enabled": lambda: ctx.record_untuned,
        "_cuda_tunableop_set_max_tuning_duration": setter("max_duration_ms"),
        "_cuda_tunableop_get_max_tuning_duration": lambda: ctx.max_duration_ms,
        "_cuda_tunableop_set_max_tuning_iterations": setter("max_iterations"),
        "_cuda_tunableop_get_max_tuning_iterations": lambda: ctx.max_iterations,
        "_cuda_tunableop_set_filename": ctx.set_filename,
        "_cuda_tunableop_get_filename": ctx.get_filename,
        "_cuda_tunableop_get_results": lambda: (),  # nothing was tuned
        "_cuda_tunableop_get_validators": lambda: (),
        "_cuda_tunableop_read_file": lambda filename=None: False,  # no results are read: none would be used
        "_cuda_tunableop_set_rotating_buffer_size": ctx.set_rotating_buffer_size,
        "_cuda_tunableop_get_rotating_buffer_size": ctx.rotating_buffer_size,
        "_cuda_tunableop_set_numerical_check_tolerances": lambda enable, atol=1e-5, rtol=1e-5: None,
    }.items():
        if not hasattr(torch._C, name):
            setattr(torch._C, name, fn)
