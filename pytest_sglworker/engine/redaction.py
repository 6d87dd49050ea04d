"""Secrets never written by the plugin: which argv values and environment variables are secret (sglang's secret
flags read from its parser's flag table, with their abbreviations; other programs' ``--api-key``-like options;
variables named like ``HF_TOKEN``), masked structurally in argvs and environments and redacted from free text.
Plain Python, no pytest."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from .sglang_facts import SECRET_FLAG, flag_table

__all__ = ["MASK", "SECRET_ENV_PATTERN", "mask_argv", "mask_env", "redact", "secret_values"]

#: Environment variables whose values never appear in a message, report or JSON the plugin writes.
SECRET_ENV_PATTERN = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|CREDENTIAL|AUTH", re.IGNORECASE)

#: The secret word must stand as a whole word of the name (HF_TOKEN, OPENAI_API_KEY, AWS_SECRET_ACCESS_KEY), so
#: that TOKENIZERS_PARALLELISM=false does not turn every "false" of a log into "***".
_SECRET_NAME_WORD = re.compile(r"(?:^|_)(?:TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|CREDENTIALS?|AUTH)(?:_|$)",
                               re.IGNORECASE)
_NOT_SECRET_VALUES = frozenset({"true", "false", "none", "null", "auto"})
#: Secret-looking names that hold no secret: Ray's authentication *mode* (``token``, ``disabled``), which a worker
#: on a Ray cluster with token authentication inherits; redacted, every "token" of its log would read "***".
_NOT_SECRET_NAMES = frozenset({"RAY_AUTH_MODE"})
MASK = "***"


def _secret_positions(argv: Sequence[str]) -> list[tuple[int, bool]]:
    """``(index, inline)`` of every secret value in ``argv``: the values of sglang's secret flags (resolved
    with their abbreviations, ``--api-k``), and of other programs' ``--api-key``-like options (a router's)."""
    table = flag_table()
    found: list[tuple[int, bool]] = []
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, eq, _ = arg.partition("=")
        try:
            flag = table.resolve(name)
        except ValueError:  # ambiguous: not a flag sglang would take
            flag = None
        secret = flag.secret if flag is not None else SECRET_FLAG.fullmatch(name) is not None
        if secret:
            if eq:
                found.append((i, True))
            elif i + 1 < len(argv):
                found.append((i + 1, False))
    return found


def mask_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of every secret flag replaced by ``***``, whatever its length."""
    out = list(argv)
    for i, inline in _secret_positions(argv):
        out[i] = out[i].partition("=")[0] + "=" + MASK if inline else MASK
    return out


def _secret_name(name: str) -> bool:
    return bool(SECRET_ENV_PATTERN.search(name) and _SECRET_NAME_WORD.search(name)) and name not in _NOT_SECRET_NAMES


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the value of every secret-looking variable (``HF_TOKEN``, ``OPENAI_API_KEY``) masked."""
    return {k: MASK if _secret_name(k) and v.lower() not in _NOT_SECRET_VALUES else v for k, v in env.items()}


def secret_values(env: Mapping[str, str], argv: Sequence[str] = ()) -> list[str]:
    """Values to redact from free text (log tails, messages): secret-looking env vars and secret flag values,
    4+ characters (a shorter one would mangle unrelated text; argvs are masked structurally by
    :func:`mask_argv` instead)."""
    values = [v for k, v in env.items() if _secret_name(k) and len(v) >= 4 and v.lower() not in _NOT_SECRET_VALUES]
    for i, inline in _secret_positions(argv):
        value = argv[i].partition("=")[2] if inline else argv[i]
        if len(value) >= 4:
            values.append(value)
    return sorted(set(values), key=len, reverse=True)


def redact(text: str, secrets: Sequence[str]) -> str:
    for value in secrets:
        text = text.replace(value, "***")
    return text
