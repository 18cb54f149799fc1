"""The one registry mechanism: name -> builder tables with one way of reporting a wrong name or option,
shared by every component kind (rules in :mod:`fedtrust.rules`; datasets, partitioners, corruptions,
attacks, models beside their code)."""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from fedtrust._checks import check_seed


class UnknownNameError(ValueError):
    """A component name or option that does not exist; the message lists the valid ones."""


def options_of(builder: Callable) -> dict[str, Any]:
    """Option name -> default (``inspect.Parameter.empty`` when required) of a class or function."""
    return dict(_options(builder))


@cache
def _options(builder: Callable) -> tuple[tuple[str, Any], ...]:
    # inspect.signature of a builtin __init__ parses its text signature: 0.15 ms a rule built
    target = builder.__init__ if inspect.isclass(builder) else builder
    return tuple(
        (p.name, p.default)
        for p in inspect.signature(target).parameters.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )


def lookup(kind: str, table: Mapping[str, Callable], name: Any) -> Callable:
    """``table[name]``, or an error naming the valid names (and the closest one)."""
    if not isinstance(name, str):
        raise UnknownNameError(f"a {kind} name must be a string, got {name!r}")
    try:
        entry = table[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(table), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownNameError(f"unknown {kind} {name!r}.{hint} Valid {kind}s: {', '.join(table)}") from None
    return entry


def check_options(kind: str, name: str, builder: Callable, options: Mapping[str, Any], fixed=()) -> None:
    """Raise naming the first option ``builder`` does not take (``fixed`` ones are supplied by the caller),
    or a ``seed`` option that is not a 32-bit seed (every component's seed is one)."""
    valid = {k: v for k, v in options_of(builder).items() if k not in fixed}
    unknown = [k for k in options if k not in valid]
    if unknown:
        listed = ", ".join(
            k if v is inspect.Parameter.empty else f"{k} (default {v!r})" for k, v in valid.items()
        )
        key, value = str(unknown[0]), options[unknown[0]]
        typo = ""  # YAML reads "{name:bogus}" (no space after the colon) as the key "name:bogus", no value
        if ":" in key and value is None:
            meant = key.replace(":", ": ", 1)
            typo = f' (YAML reads "{key}" with no space after the colon as one key; write "{meant}")'
        raise UnknownNameError(
            f"{kind} {name!r} has no option {unknown[0]!r}{typo}; its options: {listed or 'none'}"
        )
    missing = [k for k, v in valid.items() if v is inspect.Parameter.empty and k not in options]
    if missing:  # found now, not as a TypeError about positional arguments when every run starts
        raise ValueError(f"{kind} {name!r} needs option{'s' * (len(missing) > 1)} {', '.join(missing)}")
    if "seed" in options:
        check_seed(f"{kind} {name!r}: seed", options["seed"])


def yaml_value(text: str) -> Any:
    """YAML text read as data, as every config and spec is read, with YAML 1.2's scalars: ``1e-6`` and
    ``1E5`` are numbers (PyYAML, a YAML 1.1 reader, keeps them strings unless written ``1.0e-6``), only
    true/false are booleans (``sybils: off`` is the string 'off', not YAML 1.1's False), ``010`` is ten
    (not 1.1's octal 8) and ``1:30`` and ``1_000`` are strings (1.1 read 90 and 1000). A key given twice
    in one mapping is refused (YAML forbids it; PyYAML would keep the last silently)."""
    import yaml

    return yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass


@cache
def _loader():
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"key {key!r} given twice (first on line {seen[key] + 1})", key_node.start_mark,
                    )  # fmt: skip
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    # YAML 1.2's core schema for booleans, integers and floats in place of 1.1's: no yes/no/on/off
    # booleans, no octal 010 (it is 10), no sexagesimal 1:30 (90 in 1.1: a string), no 1_000 (a string)
    replaced = {f"tag:yaml.org,2002:{kind}" for kind in ("bool", "int", "float")}
    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in replaced]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    digits = list("-+0123456789")
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
    )
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), digits
    )
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
            r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
        ),
        [*digits, "."],
    )
    Loader.add_constructor("tag:yaml.org,2002:int", _yaml_12_int)
    return Loader


def _yaml_12_int(loader, node) -> int:
    """An integer as YAML 1.2 reads it: decimal (a leading 0 included), 0o octal or 0x hexadecimal."""
    import yaml

    text = loader.construct_scalar(node)
    try:
        if text.startswith(("0o", "0x")):
            return int(text[2:], 8 if text[1] == "o" else 16)
        return int(text, 10)
    except ValueError as exc:  # more digits than Python converts (4300)
        raise yaml.constructor.ConstructorError(
            None, None, f"integer {text[:20]}...: {exc}", node.start_mark
        ) from None


def parse_spec(text: str) -> tuple[str, dict[str, Any]]:
    """A component written on one line, ``name`` or ``name(key=value, ...)`` (values read as YAML:
    ``ivar_mle(weighting=screen)``, ``model_replacement(boost=10)``, ``median(pre=[nnm, bucketing])``)
    -> (name, options): how a report names a rule with options and a Flower node config names its
    corruption or attack. Commas inside brackets or quotes belong to the value; an empty value or a key
    given twice is refused."""
    import yaml

    name, paren, rest = str(text).strip().partition("(")
    if paren and not rest.rstrip().endswith(")"):
        raise ValueError(f"{text!r}: options go in parentheses, as in 'name(key=value, other=value)'")
    options: dict[str, Any] = {}
    for item in filter(str.strip, _top_level_split(rest.rstrip()[:-1]) if paren else []):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise ValueError(f"{text!r}: option {item.strip()!r} is not of the form key=value")
        if not value.strip():
            raise ValueError(f"{text!r}: option {key!r} has no value")
        if key in options:
            raise ValueError(f"{text!r}: option {key!r} is given twice")
        try:
            options[key] = yaml_value(value)
        except yaml.YAMLError as exc:
            raise ValueError(f"{text!r}: option {key!r}: {value.strip()!r} is not a YAML value") from exc
    return name.strip(), options


def _top_level_split(text: str) -> list[str]:
    """``text`` split at the commas outside brackets, braces and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{(":
            depth += 1
        elif c in "]})":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def build(kind: str, table: Mapping[str, Callable], name: str, options: Mapping[str, Any], **supplied) -> Any:
    """``table[name](**supplied, **options)`` after checking the name and the user's option names
    (``supplied`` arguments come from the caller, e.g. the dataset a model is built for)."""
    builder = lookup(kind, table, name)
    check_options(kind, name, builder, options, fixed=tuple(supplied))
    return builder(**supplied, **options)


def add(kind: str, table: dict[str, Callable], name: Any, builder: Any, *, replace: bool = False) -> None:
    """Make ``builder`` available in ``table`` as ``name`` (how user code registers a rule or an attack):
    a name must be an identifier, and a registered name is not shadowed unless ``replace``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register: a {kind} name must be an identifier such as 'my_{kind}', got {name!r}")
    if not callable(builder):
        raise TypeError(f"register: {name!r} needs a {kind} class or builder, got {type(builder).__name__}")
    if name in table and not replace and table[name] is not builder:
        raise ValueError(
            f"register: {name!r} is already a registered {kind} ({table[name]!r}); pass replace=True"
        )
    table[name] = builder
