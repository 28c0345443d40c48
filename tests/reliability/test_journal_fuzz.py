"""Fuzz the ``events.jsonl`` readers, and scan the source for ways to execute data.

The journal is read back by ``mirage status``, the run report, Flight Recorder
dumps and (to come) replay. A journal is a file anyone may hand us: every reader
must take exactly the well-formed events, in order, skip everything else, and
never raise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import typing
from enum import Enum
from pathlib import Path

import pytest

from mirage_tui.reports import flight_recorder
from mirage_tui.state.runstate import RunState, read_journal
from wire import schema as s

REPO_ROOT = Path(__file__).resolve().parents[2]
EVENT_TYPES = [cls for cls in s.MESSAGE_TYPES.values() if issubclass(cls, s.Event)]
N_LINES = int(os.environ.get("MIRAGE_FUZZ_LINES", "6000"))


def _value(gen: random.Random, hint, comms: list[str]):
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return [_value(gen, item, comms) for _ in range(gen.choice([0, 1, 2, 3, 40]))]
    if isinstance(hint, type) and issubclass(hint, Enum):
        return gen.choice(list(hint))
    if hint is bool:
        return gen.choice([True, False])
    if hint is float:
        return gen.choice([0.0, -1.0, 1e300, 1.5, gen.random() * 2e9, -0.0, 5e-324])
    if hint is int:
        return gen.choice([0, 1, 2, -1, 3, 2**62, -(2**63), gen.randrange(-5, 70)])
    return gen.choice(comms + ["", "x:1:f", "a" * 500, "\u00e9\n\t\"\\", "\ud800", "::", "f.py:9:<module>"])


def random_event(gen: random.Random, comms: list[str]) -> s.Event:
    """An event of any type with type-correct but arbitrary values (sizes 0, huge ranks, bad sites...)."""
    cls = gen.choice(EVENT_TYPES)
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _value(gen, hints[f.name], comms) for f in dataclasses.fields(cls) if gen.random() < 0.9})


def junk_line(gen: random.Random, valid: bytes) -> bytes:
    kind = gen.randrange(9)
    if kind == 0:
        return valid[: gen.randrange(len(valid))]  # cut short, as a live writer leaves the last line
    if kind == 1:
        return bytes(gen.randrange(256) for _ in range(gen.randrange(200))).replace(b"\n", b"")
    if kind == 2:  # one field of a wrong type
        body = json.loads(valid)
        hints = typing.get_type_hints(s.MESSAGE_TYPES[body["type"]])
        name = gen.choice([k for k in body if k in hints])
        hint = hints[name]
        wrong = {int: ["1", 1.5, True, None], float: ["1.5", None, [1.0]], str: [1, None, ["x"], {}],
                 bool: [1, "true", None]}
        body[name] = gen.choice(wrong.get(hint, [None, "not-a-member", 7, {}]))
        return json.dumps(body).encode()
    if kind == 3:
        return gen.choice([b"[]", b"null", b"1", b'"x"', b"{}", b'{"v":1}', b'{"v":2,"type":"hang"}', b"\xff\xfe"])
    if kind == 4:  # requests and replies are not events
        return s.encode(gen.choice([s.Ping(token="t"), s.Ok(req=1), s.Error(message="m"), s.Done(comm="c")]))
    if kind == 5:
        return b"[" * 50_000 + b"]" * 50_000
    if kind == 6:
        return valid.replace(b'"v":1', b'"v":1.0', 1)
    if kind == 7:  # too big to be a message
        return valid[:-1] + b',"pad":"' + b"p" * (s.MAX_MESSAGE_BYTES + 10) + b'"}'
    return valid.replace(b'"type":"', b'"type":"x', 1)


def fuzzed_journal(path: Path, seed: int, n: int) -> list[bytes]:
    """Write ``n`` lines, about half of them well-formed events; return the well-formed ones in order."""
    gen = random.Random(seed)
    comms = [f"{gen.getrandbits(128):032x}" for _ in range(3)]
    good = []
    with open(path, "wb") as f:
        for _ in range(n):
            line = s.encode(random_event(gen, comms))
            if gen.random() < 0.5:
                good.append(line)
                f.write(line + b"\n")
            else:
                f.write(junk_line(gen, line) + b"\n")
        f.write(s.encode(random_event(gen, comms))[:-7])  # a last line cut short, no newline
    return good


@pytest.mark.parametrize("seed", [1, 2])
def test_journal_readers_take_the_good_lines_and_never_raise(tmp_path, seed):
    journal = tmp_path / "events.jsonl"
    good = fuzzed_journal(journal, seed, N_LINES)
    events = list(read_journal(str(journal)))
    # exactly the well-formed events, in order, unchanged
    assert [s.encode(e) for e in events] == good
    state = RunState.from_journal(str(journal))
    state.ledger_table()
    state.ledger_table(now=0.0)
    json.dumps(state.to_json())
    assert flight_recorder.write_dumps(read_journal(str(journal)), str(tmp_path / "fr"))
    try:  # the console's replay (when this checkout has it) reads the same lines the same way
        from mirage_tui.state import replay
    except ImportError:
        return
    recording = replay.load(str(tmp_path))
    assert [s.encode(e) for e in recording.events] == good
    assert [s.encode(e) for e in replay.Player(recording, speed=0)] == good


def test_mirage_status_reads_a_fuzzed_run_directory(tmp_path):
    run = tmp_path / "20260101-000000-0123abcd"
    run.mkdir()
    fuzzed_journal(run / "events.jsonl", 3, 2000)
    r = subprocess.run([sys.executable, "-m", "mirage_tui", "status", "--fr-dump", str(run)], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout.startswith(f"run {run}: ")


# ---------------------------------------------------------------- nothing executes data

#: What would turn bytes from a socket or a file into code or a shell command.
FORBIDDEN = {
    "pickle.load": re.compile(r"\bpickle\.loads?\(|\bUnpickler\b|\bcPickle\b"),
    "marshal/shelve": re.compile(r"\bmarshal\.loads?\(|\bimport shelve\b"),
    "eval/exec": re.compile(r"(?<![.\w])(eval|exec)\("),
    "shell=True": re.compile(r"shell\s*=\s*True"),
    "os.system/popen": re.compile(r"\bos\.(system|popen)\("),
    "yaml.load": re.compile(r"\byaml\.(load|unsafe_load)\("),
    "numpy allow_pickle": re.compile(r"allow_pickle\s*=\s*True"),
}
#: Writing pickles is allowed in exactly one place: Flight Recorder dumps, which torch's analyzer reads.
#: (``torch.load`` is not scanned: the shim only maps devices for the user's own call of it.)
PICKLE_WRITERS = {"mirage_tui/reports/flight_recorder.py"}
#: The wire codec compiles an encoder, a decoder and an ``__init__`` per message class at import, as
#: ``dataclasses`` does, from the classes' own field names (checked against an identifier pattern),
#: never from a message's bytes. Exactly these lines may call ``exec``; any other is reported.
CODEGEN = {
    ("wire/codec.py", "exec(src, namespace)"): 2,
    ("wire/codec.py",
     """exec(f"def __init__(self, {', '.join(params)}):\\n    self.__dict__.update({{{', '.join(items)}}})\\n", namespace)"""): 1,
}


def _sources() -> list[Path]:
    out = []
    for top in ("wire", "emulator", "shim", "mirage_tui", "bench"):
        out += sorted((REPO_ROOT / top).rglob("*.py"))
    return out


def test_no_code_or_shell_is_built_from_data():
    sources = _sources()
    assert len(sources) > 30
    found = []
    codegen = dict.fromkeys(CODEGEN, 0)
    for path in sources:
        rel = path.relative_to(REPO_ROOT).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if (rel, line.strip()) in codegen:
                codegen[rel, line.strip()] += 1
                continue
            for what, pattern in FORBIDDEN.items():
                if pattern.search(code):
                    found.append(f"{rel}:{n}: {what}: {line.strip()}")
            if re.search(r"\bimport pickle\b", code) and rel not in PICKLE_WRITERS:
                found.append(f"{rel}:{n}: imports pickle")
    assert not found, "\n".join(found)
    assert codegen == CODEGEN, codegen  # one more exec line of the codec is a new one to review


def test_the_scan_would_catch_each_pattern():
    """The scan above is only worth something if each pattern matches what it is meant to."""
    samples = {
        "pickle.load": "obj = pickle.loads(data)",
        "marshal/shelve": "marshal.loads(b)",
        "eval/exec": "x = eval(text)",
        "shell=True": "subprocess.run(cmd, shell=True)",
        "os.system/popen": "os.system(cmd)",
        "yaml.load": "yaml.load(f)",
        "numpy allow_pickle": "np.load(f, allow_pickle=True)",
    }
    for what, pattern in FORBIDDEN.items():
        assert pattern.search(samples[what]), what
    for innocent in ("model.eval()", "spec.loader.exec_module(m)", "exec_then_activate(module)", "pickle.dump(x, f)"):
        assert not any(p.search(innocent) for p in FORBIDDEN.values()), innocent


def test_replay_at_recorded_pace_survives_an_absurd_gap():
    """Two events 1e300 s apart: the player waits (in slices) instead of raising OverflowError."""
    from mirage_tui.state import replay

    gen = random.Random(3)
    first, second = (random_event(gen, ["0" * 32]) for _ in range(2))
    events = (dataclasses.replace(first, t=1.0), dataclasses.replace(second, t=1e300))
    player = replay.Player(replay.Recording(run_dir="", events=events, skipped=0), speed=1.0)
    played, errors = [], []

    def drive():
        try:
            played.extend(player)
        except Exception as e:  # noqa: BLE001 -- the assertion below names it
            errors.append(e)

    thread = threading.Thread(target=drive)
    thread.start()
    time.sleep(1.5)  # longer than one wait slice
    assert errors == [] and played == [events[0]] and thread.is_alive()
    player.step()  # a step lets the far-future event through at once
    deadline = time.monotonic() + 5
    while len(played) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    player.stop()
    thread.join(5)
    assert errors == [] and played == list(events) and not thread.is_alive()
