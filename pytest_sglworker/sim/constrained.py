"""Constrained decoding for the simulated engine: the output a ``regex`` or a ``json_schema`` allows, and the errors
the real engine answers when it cannot compile one.

Part of :mod:`pytest_sglworker.sim`; stdlib only (``re``'s own parser walks the regex). What sglang 0.5.23 does
(``srt/sampling/sampling_params.py``, ``srt/constrained/grammar_manager.py``, ``xgrammar_backend.py``,
``json_schema_validation.py``) and what the sim keeps:

- at most one of ``json_schema``, ``regex``, ``ebnf``, ``structural_tag`` (an empty one counts as unset), else
  ``Only one of json_schema, regex, ebnf, or structural_tag can be set.`` (a request check: 400);
- the grammar is compiled after the request is admitted; a failure aborts it with 400 ``Failed to compile
  <regex|json> grammar: <error>``: a ``json_schema`` that is not JSON (Python's own ``json`` message, as the real
  one), a keyword xgrammar would ignore (sglang's ``validate_xgrammar_json_schema``, word for word), a type it does
  not know (xgrammar's ``Unsupported type "foo"``), a regex that does not parse (xgrammar's "Regex parsing error at
  position N", with Python's description of the error: xgrammar's own words differ);
- the output then fully matches the regex, or is JSON valid against the schema, deterministically (seeded by the
  prompt), then the EOS token; the grammar does not stretch ``max_new_tokens``: a cut output is cut, as the real
  engine's. The JSON is compact (``json.dumps``), where xgrammar allows any whitespace.

Supported: regex literals, classes, categories, ``.``, alternation, groups, back-references, repeats (lookarounds
and anchors are checked, not generated: a regex whose only matches need them is refused as one the sim cannot
generate); JSON Schema ``type`` (one or a list), ``properties``, ``required``, ``items``, ``prefixItems``,
``minItems``/``maxItems``, ``enum``, ``const``, ``minLength``/``maxLength``, ``pattern``, ``format`` (xgrammar's
list), ``minimum``/``maximum`` (and exclusive), ``anyOf``/``oneOf``/``allOf``, ``$ref`` into ``$defs`` or
``definitions``; an ``ebnf`` grammar that is not recursive (:func:`ebnf_text`: its rules become one regex).
A recursive ``ebnf`` and ``structural_tag`` are accepted and not simulated (the output is the usual echo).
"""

from __future__ import annotations

import importlib
import json
import random
import re
import string
import time
from collections.abc import Callable
from typing import Any

#: ``re``'s parser (``re._parser`` since 3.11; ``sre_parse`` before).
_PARSER: Any = importlib.import_module("re._parser" if hasattr(re, "_parser") else "sre_parse")

ONLY_ONE = "Only one of json_schema, regex, ebnf, or structural_tag can be set."
#: sglang's ``_XGRAMMAR_UNSUPPORTED_KEYWORDS`` and ``_XGRAMMAR_STRING_FORMATS`` (with a value of each format).
_UNSUPPORTED = frozenset({"contains", "dependentRequired", "dependentSchemas", "else", "if", "maxContains",
                          "minContains", "multipleOf", "not", "then", "uniqueItems"})
_FORMATS = {"date": "2024-01-01", "date-time": "2024-01-01T00:00:00Z", "duration": "P1D", "email": "sim@example.com",
            "hostname": "example.com", "ipv4": "127.0.0.1", "ipv6": "::1", "json-pointer": "/sim",
            "relative-json-pointer": "0", "time": "00:00:00Z", "uri": "https://example.com/sim",
            "uri-reference": "/sim", "uri-template": "https://example.com/{sim}",
            "uuid": "00000000-0000-4000-8000-000000000000"}
_SUBSCHEMA = ("additionalItems", "additionalProperties", "contains", "contentSchema", "else", "if", "items", "not",
              "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("$defs", "definitions", "dependentSchemas", "patternProperties", "properties")
_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
#: How deep a ``$ref`` may recurse, and how many extra repeats a regex ``*``/``+``/``{m,}`` gets at most.
_MAX_DEPTH = 12
_MAX_EXTRA = 2


class ConstraintError(ValueError):
    """A constraint the real engine refuses (the message is its ``ValueError``'s)."""


def grammar_of(params: dict[str, Any]) -> tuple[str, str] | None:
    """The one grammar of sampling params (``("regex", ...)``, ``("json", ...)``, ``("ebnf", ...)``,
    ``("structural_tag", ...)``), or None; raises :class:`ConstraintError` for more than one."""
    found = [(kind, params.get(key)) for key, kind in (("json_schema", "json"), ("regex", "regex"), ("ebnf", "ebnf"),
                                                       ("structural_tag", "structural_tag"))]
    found = [(kind, value) for kind, value in found if value]
    if len(found) > 1:
        raise ConstraintError(ONLY_ONE)
    if not found:
        return None
    kind, value = found[0]
    return kind, value if isinstance(value, str) else json.dumps(value)


def _stamp() -> str:
    return time.strftime("%H:%M:%S")


def constrained_text(grammar: tuple[str, str] | None, seed: int) -> str | None:
    """The output ``grammar`` allows for a prompt of this seed (None: no grammar, or one the sim does not
    simulate); raises :class:`ConstraintError` with the real engine's ``Failed to compile ... grammar`` message."""
    if grammar is None:
        return None
    kind, value = grammar
    if kind == "regex":
        return regex_text(value, seed)
    if kind == "json":
        return json_text(value, seed)
    if kind == "ebnf":
        return ebnf_text(value, seed)
    return None


# ---------------------------------------------------------------------------------------------- EBNF

#: GBNF's tokens: a string literal, a character class, a rule's head, a rule name, an operator, a comment
_EBNF_TOKEN = re.compile(r'\s+|#[^\n]*|(?P<str>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])'
                         r"|(?P<head>[A-Za-z_][\w-]*)\s*::=|(?P<name>[A-Za-z_][\w-]*)"
                         r"|(?P<op>[()|*+?]|\{\d*(?:,\d*)?\})")


def ebnf_text(source: str, seed: int) -> str | None:
    """A string the GBNF grammar ``source`` (xgrammar's EBNF) allows from its ``root``: the grammar becomes a regex
    (string literals, character classes, groups, ``|``, ``* + ? {m,n}``, references to other rules), which
    :func:`regex_text` walks. A reference to a rule it does not define is xgrammar's compile error (a 400); None
    (not simulated: the usual echo) for a recursive grammar or syntax it does not know."""
    rules: dict[str, list[tuple[str, str]]] = {}
    refs: list[tuple[str, int]] = []
    current: list[tuple[str, str]] | None = None
    pos = 0
    while pos < len(source):
        m = _EBNF_TOKEN.match(source, pos)
        if m is None:
            return None
        pos = m.end()
        kind = m.lastgroup
        if kind == "head":
            current = rules.setdefault(m.group("head"), [])
        elif kind is not None:
            if current is None:
                return None
            current.append((kind, m.group(kind)))
            if kind == "name":
                refs.append((m.group(kind), m.start()))
    for name, at in refs:
        if name not in rules:
            line = source.count("\n", 0, at) + 1
            column = at - (source.rfind("\n", 0, at) + 1) + 1
            raise ConstraintError(f"Failed to compile ebnf grammar: [{_stamp()}] /project/cpp/grammar_parser.cc:820: "
                                  f'EBNF parser error at line {line}, column {column}: Rule "{name}" is not defined\n')
    try:
        pattern = _ebnf_regex(rules, "root", ())
    except (KeyError, ValueError):
        return None
    return regex_text(pattern, seed)


def _ebnf_regex(rules: dict[str, list[tuple[str, str]]], name: str, seen: tuple[str, ...]) -> str:
    if name in seen:
        raise ValueError(f"rule {name!r} is recursive")
    parts = []
    for kind, text in rules[name]:
        if kind == "str":
            parts.append(re.escape(json.loads(text)))
        elif kind == "name":
            parts.append(f"(?:{_ebnf_regex(rules, text, (*seen, name))})")
        elif kind == "op" and text in "()":
            parts.append("(?:" if text == "(" else ")")
        else:  # a character class, | and the repeats mean the same in a regex
            parts.append(text)
    return "".join(parts)


# ---------------------------------------------------------------------------------------------- regex


def regex_text(pattern: str, seed: int) -> str:
    """A string that fully matches ``pattern`` (tries a few seeds when lookarounds or anchors get in the way)."""
    try:
        parsed = _PARSER.parse(pattern)
    except re.error as exc:
        raise ConstraintError(f"Failed to compile regex grammar: [{_stamp()}] /project/cpp/regex_converter.cc:83: "
                              f"Regex parsing error at position {exc.pos or 0}: {exc.msg}\n") from None
    for attempt in range(8):
        text = _Regex(random.Random(seed + attempt)).walk(parsed)
        if re.fullmatch(pattern, text):
            return text
    raise ConstraintError(f"Failed to compile regex grammar: the simulated engine found no string that fully "
                          f"matches {pattern!r} (it does not generate lookarounds or anchors)")


class _Regex:
    """One walk of a parsed regex, choosing branches, characters and repeat counts with ``rng``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.groups: dict[int, str] = {}

    def walk(self, items: Any) -> str:
        return "".join(self.item(str(op), av) for op, av in items)

    def item(self, op: str, av: Any) -> str:
        if op == "LITERAL":
            return chr(av)
        if op == "NOT_LITERAL":
            return next(c for c in "ab" if c != chr(av))
        if op == "ANY":
            return self.rng.choice(string.ascii_lowercase)
        if op == "IN":
            return self.char_in(av)
        if op == "BRANCH":
            return self.walk(self.rng.choice(av[1]))
        if op == "SUBPATTERN":
            group, _, _, sub = av
            text = self.walk(sub)
            if group is not None:
                self.groups[group] = text
            return text
        if op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = av
            count = low + self.rng.randint(0, max(min(high - low, _MAX_EXTRA), 0))
            return "".join(self.walk(sub) for _ in range(count))
        if op == "GROUPREF":
            return self.groups.get(av, "")
        if op == "GROUPREF_EXISTS":
            group, yes, no = av
            return self.walk(yes) if group in self.groups else (self.walk(no) if no is not None else "")
        if op == "ATOMIC_GROUP":
            return self.walk(av)
        return ""  # AT (anchors), ASSERT, ASSERT_NOT: checked by the full match, not generated

    def char_in(self, items: Any) -> str:
        allowed: list[str] = []
        negate = False
        for op, av in items:
            name = str(op)
            if name == "NEGATE":
                negate = True
            elif name == "LITERAL":
                allowed.append(chr(av))
            elif name == "RANGE":
                allowed += [chr(c) for c in range(av[0], min(av[1], av[0] + 63) + 1)]
            elif name == "CATEGORY":
                allowed += _category(str(av))
        if negate:
            return next((c for c in string.ascii_letters + string.digits + " " if c not in allowed), "~")
        readable = [c for c in allowed if c.isalnum()] or allowed
        return self.rng.choice(readable) if readable else "a"


def _category(name: str) -> list[str]:
    return {"CATEGORY_DIGIT": list(string.digits), "CATEGORY_NOT_DIGIT": list(string.ascii_letters),
            "CATEGORY_SPACE": [" "], "CATEGORY_NOT_SPACE": list(string.ascii_letters),
            "CATEGORY_WORD": list(string.ascii_letters + string.digits + "_"),
            "CATEGORY_NOT_WORD": [" ", "-"]}.get(name, ["a"])


# ---------------------------------------------------------------------------------------------- JSON schema


def json_text(source: str, seed: int) -> str:
    """Compact JSON valid against the schema ``source`` (a JSON text)."""
    try:
        schema = json.loads(source)
    except ValueError as exc:
        raise ConstraintError(f"Failed to compile json grammar: {exc}") from None
    check_xgrammar_schema(schema)
    value = _Schema(schema, random.Random(seed)).value(schema, 0)
    return json.dumps(value)


def _subschemas(schema: Any, pointer: str = "#") -> list[tuple[dict[str, Any], str]]:
    """sglang's ``_iter_subschemas``: every schema-bearing keyword, with its JSON pointer."""
    if not isinstance(schema, dict):
        return []
    out = [(schema, pointer)]
    for key in _SUBSCHEMA:
        child = schema.get(key)
        if isinstance(child, (bool, dict)):
            out += _subschemas(child, f"{pointer}/{key}")
        elif key == "items" and isinstance(child, list):
            for index, item in enumerate(child):
                out += _subschemas(item, f"{pointer}/{key}/{index}")
    for key in _SUBSCHEMA_LISTS:
        children = schema.get(key)
        if isinstance(children, list):
            for index, child in enumerate(children):
                out += _subschemas(child, f"{pointer}/{key}/{index}")
    for key in (*_SUBSCHEMA_MAPS, "dependencies"):
        children = schema.get(key)
        if isinstance(children, dict):
            for name, child in children.items():
                if key != "dependencies" or isinstance(child, (bool, dict)):
                    escaped = name.replace("~", "~0").replace("/", "~1")
                    out += _subschemas(child, f"{pointer}/{key}/{escaped}")
    return out


def check_xgrammar_schema(schema: Any) -> None:
    """sglang's ``validate_xgrammar_json_schema``: constraints xgrammar would silently ignore are refused."""

    def refuse(pointer: str, reason: str) -> None:
        raise ConstraintError(f"Failed to compile json grammar: JSON Schema at {pointer} is not supported by "
                              f"xgrammar: {reason}")

    for sub, pointer in _subschemas(schema):
        unsupported = sorted(_UNSUPPORTED.intersection(sub))
        if unsupported:
            refuse(pointer, f"keyword(s) {', '.join(unsupported)} would be ignored")
        kind = sub.get("type")
        stringy = kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)
        if stringy and "format" in sub and (not isinstance(sub["format"], str) or sub["format"] not in _FORMATS):
            refuse(pointer, f"string format {sub['format']!r} is not implemented")
        groups = [name for name, present in (("format", "format" in sub), ("pattern", "pattern" in sub),
                                             ("minLength/maxLength", "minLength" in sub or "maxLength" in sub))
                  if present] if stringy else []
        if len(groups) > 1:
            refuse(pointer, f"constraints {', '.join(groups)} cannot be enforced together")


class _Schema:
    """One instance of a schema, choosing among enums, branches and booleans with ``rng``."""

    def __init__(self, root: Any, rng: random.Random) -> None:
        self.root = root
        self.rng = rng

    def fail(self, reason: str) -> ConstraintError:
        return ConstraintError(f"Failed to compile json grammar: [{_stamp()}] /project/cpp/json_schema_converter.cc:"
                               f"4175: {reason}\n")

    def resolve(self, ref: str) -> Any:
        node = self.root
        if not ref.startswith("#"):
            raise self.fail(f"Unsupported $ref {ref!r}: only references into this schema are simulated")
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise self.fail(f"Invalid $ref {ref!r}")
            node = node[part]
        return node

    def value(self, schema: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise self.fail("the schema recurses too deeply for the simulated engine")
        if schema is True or schema == {}:
            return {}
        if schema is False or not isinstance(schema, dict):
            raise self.fail("Unsatisfiable schema" if schema is False else f"Invalid schema {schema!r}")
        if "$ref" in schema:
            return self.value(self.resolve(str(schema["$ref"])), depth + 1)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.rng.choice(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self.value(schema[key][0], depth + 1)
        if isinstance(schema.get("allOf"), list):
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                part = self.resolve(part["$ref"]) if isinstance(part, dict) and "$ref" in part else part
                if isinstance(part, dict):
                    merged["properties"] = {**merged.get("properties", {}), **part.get("properties", {})}
                    merged.update({k: v for k, v in part.items() if k != "properties"})
            return self.value(merged, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        makers: dict[str, Callable[[dict[str, Any], int], Any]] = {
            "object": self.object, "array": self.array, "string": self.string, "integer": self.integer,
            "number": self.number}
        maker = makers.get(str(kind))
        if maker is None:
            raise self.fail(f'Unsupported type "{kind}"')
        return maker(schema, depth)

    def object(self, schema: dict[str, Any], depth: int) -> Any:
        props: dict[str, Any] = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
        out = {name: self.value(sub, depth + 1) for name, sub in props.items()}
        for name in schema.get("required") or []:
            if name not in out:
                extra = schema.get("additionalProperties")
                out[name] = self.value(extra if isinstance(extra, dict) else {"type": "string"}, depth + 1)
        return out

    def array(self, schema: dict[str, Any], depth: int) -> Any:
        prefix: list[Any] = schema["prefixItems"] if isinstance(schema.get("prefixItems"), list) else []
        items = schema.get("items", {})
        low, high = int(schema.get("minItems") or 0), schema.get("maxItems")
        count = max(low, len(prefix), 1)
        if isinstance(high, int):
            count = min(count, high)
        out = [self.value(prefix[i], depth + 1) for i in range(min(count, len(prefix)))]
        if items is False:
            return out
        return out + [self.value(items if isinstance(items, (dict, bool)) else {}, depth + 1)
                      for _ in range(count - len(out))]

    def string(self, schema: dict[str, Any], depth: int) -> Any:
        if isinstance(schema.get("format"), str):
            return _FORMATS[schema["format"]]
        if isinstance(schema.get("pattern"), str):
            try:
                return regex_text(schema["pattern"], self.rng.randrange(2**31))
            except ConstraintError as exc:
                raise self.fail(f"pattern {schema['pattern']!r}: {exc}") from None
        low, high = int(schema.get("minLength") or 0), schema.get("maxLength")
        if isinstance(high, int) and high < low:
            raise self.fail("Unsatisfiable string length bounds")
        text = self.rng.choice(_WORDS)
        while len(text) < low:
            text += self.rng.choice(_WORDS)
        return text[:high] if isinstance(high, int) else text

    def _bounds(self, schema: dict[str, Any], step: float) -> tuple[float | None, float | None]:
        low, high = schema.get("minimum"), schema.get("maximum")
        if isinstance(schema.get("exclusiveMinimum"), (int, float)):
            low = schema["exclusiveMinimum"] + step
        if isinstance(schema.get("exclusiveMaximum"), (int, float)):
            high = schema["exclusiveMaximum"] - step
        return low, high

    def integer(self, schema: dict[str, Any], depth: int) -> Any:
        low, high = self._bounds(schema, 1)
        lo = int(-(-low // 1)) if low is not None else None  # ceil
        hi = int(high // 1) if high is not None else None
        start = lo if lo is not None else min(0, hi) if hi is not None else 0
        end = hi if hi is not None else start + 99
        if end < start:
            raise self.fail("Unsatisfiable bounds")
        return self.rng.randint(start, min(end, start + 99))

    def number(self, schema: dict[str, Any], depth: int) -> Any:
        low, high = self._bounds(schema, 1e-6)
        start = float(low) if low is not None else min(0.0, float(high)) if high is not None else 0.0
        end = float(high) if high is not None else start + 99.0
        if end < start:
            raise self.fail("Unsatisfiable bounds")
        value = start + (min(end, start + 99.0) - start) * self.rng.random()
        return round(value, 3) if start <= round(value, 3) <= end else value
