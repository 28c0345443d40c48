"""The wire codec: messages of :mod:`wire.messages` to JSON bytes and back.

Every message is one JSON object with a version ``v`` and a ``type``.
``decode`` turns bytes into one of the catalogue's types or raises
:class:`SchemaError`, which the daemon answers with an error reply. JSON only,
never pickle: a peer can send us nothing but data.

Speed matters here (a small all-reduce makes six messages in the daemon), so
each message class gets an encoder, a decoder and an ``__init__`` generated
from its fields at import, each checked against the generic path by
``tests/test_schema.py``: the only ``exec`` in mirage (the security scan
allows exactly these three).
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Iterator
from enum import Enum

from wire.messages import MAX_MESSAGE_BYTES, MESSAGE_TYPES, VERSION, Event, Message, SchemaError

#: Built once: ``json.dumps``/``json.loads`` with options build a new encoder/decoder per call,
#: which was a fifth of the daemon's time per collective (it encodes and decodes several messages each).
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=lambda value: _as_json(value))


def _as_json(value) -> dict:
    """A dataclass inside a message (e.g. the agents' ``Process``) as the object of its fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dict(value.__dict__)
    raise TypeError(f"{type(value).__name__} is not a JSON value")


#: ``_ENCODER``'s C encoder, made once: ``JSONEncoder.encode`` makes a new one on every call, a
#: third of encoding a small message (a small all-reduce encodes six: two replies, four events).
#: No circular-reference check (``markers`` None): messages are flat dataclasses of JSON values.
try:
    _C_ENCODE = json.encoder.c_make_encoder(
        None, _ENCODER.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
    )
except (AttributeError, TypeError):  # no C accelerator (or another signature): the encoder's own path
    _C_ENCODE = None


def _json_value(value) -> str:
    """``value`` as JSON text, as the encoder writes it."""
    return _ENCODER.encode(value) if _C_ENCODE is None else "".join(_C_ENCODE(value, 0))


def _generic(body: dict) -> bytes:
    return _json_value(body).encode()


#: message class -> its generated encoder (see :func:`_make_encoder`), or None: the generic path
_ENCODERS: dict[type, typing.Callable[[dict], bytes] | None] = {}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _make_encoder(cls: type) -> typing.Callable[[dict], bytes] | None:
    """An encoder for ``cls`` generated from its fields: one f-string from the message's ``__dict__``.

    Byte for byte what the generic path writes (the C encoder over the whole
    dict: every field in declared order), at half its cost: a small all-reduce
    makes six messages in the daemon (four events, two replies). A value that
    is not of its field's type (a bool or a non-finite float, a missing or
    extra field) takes the generic path, which writes it as it always has.
    """
    if not dataclasses.is_dataclass(cls) or not _NAME.match(cls.TYPE or ""):
        return None
    hints = typing.get_type_hints(cls)
    loads, checks, parts = [], [], []
    for i, f in enumerate(dataclasses.fields(cls)):
        if not _NAME.match(f.name):
            return None
        hint, v = hints[f.name], f"v{i}"
        loads.append(f"{v} = d[{f.name!r}]")
        if hint is str or (isinstance(hint, type) and issubclass(hint, str)):  # str enums write their value
            parts.append(f'"{f.name}":{{_ESCAPE({v})}}')  # (TypeError for a non-str: generic path)
        elif hint is int:
            checks.append(f"type({v}) is int")
            parts.append(f'"{f.name}":{{{v}}}')
        elif hint is float:
            checks.append(f"type({v}) is float and {v} - {v} == 0.0")  # NaN, inf: written as json writes them
            parts.append(f'"{f.name}":{{{v}!r}}')
        else:
            parts.append(f'"{f.name}":{{_json_value({v})}}')
    text = ",".join([f'{{{{"v":{VERSION},"type":"{cls.TYPE}"'] + parts) + "}}"
    src = (
        "def encode_fast(d):\n"
        f"    if len(d) != {len(loads)}:\n"
        "        return _generic({'v': _VERSION, 'type': _TYPE, **d})\n"
        + "".join(f"    {line}\n" for line in loads)
        + f"    if {' and '.join(checks) or 'True'}:\n"
        "        try:\n"
        f"            return f'{text}'.encode()\n"
        "        except TypeError:\n"
        "            pass\n"
        "    return _generic({'v': _VERSION, 'type': _TYPE, **d})\n"
    )
    namespace = {"_ESCAPE": json.encoder.encode_basestring_ascii, "_json_value": _json_value, "_generic": _generic,
                 "_VERSION": VERSION, "_TYPE": cls.TYPE}
    exec(src, namespace)
    return namespace["encode_fast"]


def encode(msg: Message, **fields) -> bytes:
    """Serialise ``msg`` to its JSON wire form, with ``fields`` in place of its own (unchecked: the
    caller's, e.g. a request's token and id, spares a copy of the message)."""
    # every enum here is a str enum, which json writes as its value; fields keep their declared order
    cls = type(msg)
    fast = _ENCODERS[cls] if cls in _ENCODERS else _ENCODERS.setdefault(cls, _make_encoder(cls))
    body = msg.__dict__
    if fields:
        if fast is None or not fields.keys() <= body.keys():
            return _generic({"v": VERSION, "type": msg.TYPE, **body, **fields})
        body = {**body, **fields}
    if fast is None:
        return _generic({"v": VERSION, "type": msg.TYPE, **body})
    return fast(body)


def _checker(name: str, hint: object):
    """A function that validates (and normalises) one field's JSON value; built once per field."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        (inner,) = [h for h in typing.get_args(hint) if h is not type(None)]  # ``X | None``, the one union used
        inner_check = _checker(name, inner)
        return lambda value: None if value is None else inner_check(value)
    if typing.get_origin(hint) is dict:
        key, item = typing.get_args(hint)
        if key is not str:
            raise TypeError(f"field {name!r}: JSON object keys are strings, not {key}")
        each = _checker(f"{name}{{}}", item)

        def check_dict(value):
            if not isinstance(value, dict):
                raise SchemaError(f"field {name!r}: expected an object, got {type(value).__name__}")
            return {k: each(v) for k, v in value.items()}  # (JSON keys are strings already)

        return check_dict
    if dataclasses.is_dataclass(hint):
        return _nested_checker(name, hint)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        each = _checker(f"{name}[]", item)

        def check_list(value):
            if not isinstance(value, list):
                raise SchemaError(f"field {name!r}: expected a list, got {type(value).__name__}")
            return [each(v) for v in value]

        return check_list
    if isinstance(hint, type) and issubclass(hint, Enum):
        members = {m.value: m for m in hint}  # a dict lookup: calling the enum class costs ~1 us

        def check_enum(value):
            if type(value) is str and value in members:
                return members[value]
            try:
                return hint(value)
            except ValueError:
                choices = ", ".join(m.value for m in hint)
                raise SchemaError(f"field {name!r}: {value!r} is not one of {choices}") from None

        return check_enum
    if hint is float:
        def check_float(value):
            if type(value) is float:
                return value
            if type(value) is int:
                return float(value)
            raise SchemaError(f"field {name!r}: expected float, got {type(value).__name__}")

        return check_float

    def check_exact(value):
        # exact types: JSON gives int, str, bool, float; a bool is not an int here
        if type(value) is not hint:
            raise SchemaError(f"field {name!r}: expected {hint.__name__}, got {type(value).__name__}")
        return value

    return check_exact


def _nested_checker(name: str, cls: type):
    """A checker building dataclass ``cls`` (not a message: no ``v`` or ``type``) from a JSON object; as for
    a message, fields it does not have are ignored."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: _checker(f"{name}.{f.name}", hints[f.name]) for f in dataclasses.fields(cls)}

    def check_nested(value):
        if not isinstance(value, dict):
            raise SchemaError(f"field {name!r}: expected an object, got {type(value).__name__}")
        try:
            return cls(**{k: check(value[k]) for k, check in fields.items() if k in value})
        except TypeError as e:  # a required field missing
            raise SchemaError(f"field {name!r}: {e}") from None

    return check_nested


_FIELDS: dict[type, list[tuple[str, object]]] = {}


def _fields(cls: type) -> list[tuple[str, object]]:
    fields = _FIELDS.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls)
        fields = _FIELDS[cls] = [(f.name, _checker(f.name, hints[f.name])) for f in dataclasses.fields(cls)]
    return fields


#: Per message class, how :func:`decode` builds it without calling its ``__init__`` (a frozen
#: dataclass's sets each field through ``object.__setattr__``: 6 us for a Collective), one entry
#: per field in declared order: (name, the exact type a valid value has, or None, its checker,
#: its default, its default factory or None). None for a class that needs its ``__init__``.
_PLANS: dict[type, list[tuple] | None] = {}
_EXACT = (int, str, bool, float)


def _plan(cls: type) -> list[tuple] | None:
    if cls in _PLANS:
        return _PLANS[cls]
    hints = typing.get_type_hints(cls)
    plan: list[tuple] | None = []
    for f, (name, check) in zip(dataclasses.fields(cls), _fields(cls)):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            plan = None  # a required field: __init__ says so when it is missing
            break
        exact = hints[name] if hints[name] in _EXACT else None  # (float: an int is also valid, via check)
        factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
        plan.append((name, exact, check, f.default, factory))
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        plan = None
    _PLANS[cls] = plan
    return plan


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf or nan (1e999 parses as inf)
        raise ValueError(f"{text[:20]} is not a finite number")
    return value


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)
#: The decoder's C scanner: what ``_DECODER.decode`` runs after two Python calls and two regex
#: matches for whitespace, which a message as encoded here does not have.
_SCAN = _DECODER.scan_once


def _make_decoder(cls: type, plan: list[tuple]) -> typing.Callable[[dict], Message | None]:
    """A builder for ``cls`` generated from its plan, for the common case: a body with every field
    and nothing else (as :func:`encode` writes it), each value of its exact type. None for any
    other body, which takes the field-by-field path (defaults, errors, ``int`` as ``float``)."""
    hints = typing.get_type_hints(cls)
    namespace: dict = {"_new": object.__new__, "_cls": cls}
    loads, checks, later, items = [], [], [], []
    for i, (name, exact, check, _default, _factory) in enumerate(plan):
        hint, v = hints[name], f"v{i}"
        loads.append(f"{v} = body[{name!r}]")
        if exact is not None:
            checks.append(f"type({v}) is {exact.__name__}")
        elif isinstance(hint, type) and issubclass(hint, Enum):
            namespace[f"_members{i}"] = {m.value: m for m in hint}
            later.append(f"{v} = _members{i}.get({v}) if type({v}) is str else None")
            later.append(f"if {v} is None:\n        return None")
        else:
            namespace[f"_check{i}"] = check  # lists: checked as the general path checks them
            later.append(f"{v} = _check{i}({v})")
        items.append(f"{name!r}: {v}")
    src = (
        "def decode_fast(body):\n"
        f"    if len(body) != {len(plan) + 2}:\n"
        "        return None\n"
        "    try:\n"
        + "".join(f"        {line}\n" for line in loads or ["pass"])
        + "    except KeyError:\n"
        "        return None\n"
        f"    if not ({' and '.join(checks) or 'True'}):\n"
        "        return None\n"
        + "".join(f"    {line}\n" for line in later)
        + "    msg = _new(_cls)\n"
        f"    msg.__dict__.update({{{', '.join(items)}}})\n"
        "    return msg\n"
    )
    exec(src, namespace)
    return namespace["decode_fast"]


_DECODERS: dict[type, typing.Callable[[dict], Message | None] | None] = {}


def decode(data: bytes | str, catalogue: dict[str, type[Message]] = MESSAGE_TYPES,
           max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Parse one wire message of ``catalogue`` (the daemon's by default) of at most ``max_bytes``;
    raise :class:`SchemaError` on anything malformed."""
    if len(data) > max_bytes:
        raise SchemaError(f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        text = data.decode() if isinstance(data, bytes) else data
        try:
            body, end = _SCAN(text, 0)
            if end != len(text):
                raise ValueError("more than one JSON value")
        except (ValueError, StopIteration):  # whitespace around it, or not JSON: the full parse says which
            body = _DECODER.decode(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SchemaError(f"not JSON: {e}") from None
    if not isinstance(body, dict):
        raise SchemaError("message must be a JSON object")
    if type(body.get("v")) is not int or body["v"] != VERSION:
        raise SchemaError(f"unsupported version {body.get('v')!r}, expected {VERSION}")
    kind = body.get("type")
    cls = catalogue.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise SchemaError(f"unknown message type {body.get('type')!r}")
    plan = _PLANS[cls] if cls in _PLANS else _plan(cls)
    fast = None if plan is None else _DECODERS[cls] if cls in _DECODERS else _DECODERS.setdefault(
        cls, _make_decoder(cls, plan))
    msg = None if fast is None else fast(body)
    if msg is not None:
        return msg
    if plan is None:
        try:
            return cls(**{name: check(body[name]) for name, check in _fields(cls) if name in body})
        except TypeError as e:  # a required field missing
            raise SchemaError(f"{kind!r}: {e}") from None
    # what the dataclass's __init__ would store, in field order (encode relies on it), each value checked
    values = {}
    for name, exact, check, default, factory in plan:
        if name in body:
            value = body[name]
            values[name] = value if type(value) is exact else check(value)
        else:
            values[name] = default if factory is None else factory()
    msg = object.__new__(cls)
    msg.__dict__.update(values)
    return msg


def encode_events(events: list[bytes]) -> bytes:
    """One PUB frame for several encoded events: newline-separated, as in ``events.jsonl``."""
    return b"\n".join(events)


def iter_events(lines) -> Iterator[tuple[Event, bytes]]:
    """Each event among encoded ``lines`` with its line; malformed lines are skipped (a live writer
    may have cut the last one short)."""
    for line in lines:
        try:
            msg = decode(line)
        except SchemaError:
            continue
        if isinstance(msg, Event):
            yield msg, line


def decode_events(frame: bytes) -> list[Event]:
    """The events of one PUB frame (see :func:`encode_events`)."""
    return [event for event, _ in iter_events(frame.split(b"\n"))]


def _fast_init(cls: type):
    """``cls.__init__`` filling ``__dict__`` in one go (same parameters, defaults and factories).

    A frozen dataclass's own sets each field through ``object.__setattr__``: 2
    to 6 us per message, and the daemon makes six per small all-reduce. None
    where the dataclass's own is needed (``__post_init__``, ``init=False`` or
    keyword-only fields).
    """
    fields = dataclasses.fields(cls)
    if hasattr(cls, "__post_init__") or any(not f.init or f.kw_only or not _NAME.match(f.name) for f in fields):
        return None
    namespace: dict = {"_MISSING": dataclasses.MISSING}
    params, items = [], []
    for i, f in enumerate(fields):
        if f.default_factory is not dataclasses.MISSING:
            namespace[f"_factory{i}"] = f.default_factory
            params.append(f"{f.name}=_MISSING")
            items.append(f"{f.name!r}: _factory{i}() if {f.name} is _MISSING else {f.name}")
        elif f.default is not dataclasses.MISSING:
            namespace[f"_default{i}"] = f.default
            params.append(f"{f.name}=_default{i}")
            items.append(f"{f.name!r}: {f.name}")
        else:
            params.append(f.name)
            items.append(f"{f.name!r}: {f.name}")
    exec(f"def __init__(self, {', '.join(params)}):\n    self.__dict__.update({{{', '.join(items)}}})\n", namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    return init


for _cls in list(MESSAGE_TYPES.values()):
    _init = _fast_init(_cls)
    if _init is not None:
        _cls.__init__ = _init
