"""The plugin's options: one table, every option ``--sgl-*`` with an ``SGLWORKER_*`` environment variable and
an ini key. Precedence: command line > environment > ini > default. A bad value is a usage error naming the
option, variable or key it came from.

A pytest-facing module (split from ``plugin.py``); it imports nothing heavy at module level.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ..errors import SglWorkerError

# --------------------------------------------------------------------------------------------------------
# Options: every option is --sgl-*, with an ini twin and an SGLWORKER_* environment variable.
# Precedence: command line > environment > ini > default.
# --------------------------------------------------------------------------------------------------------

MODEL_DESC = "model spec(s) to run worker tests against; repeatable or comma-separated (see --sgl-list-models)"
ENGINE_DESC = "'real' (python -m sglang.launch_server, default) or 'sim' (the simulated engine, CPU only)"
LAUNCHER_DESC = "command that starts the engine, shlex-split (default: '<python> -m sglang.launch_server')"
LOG_DIR_DESC = "directory for sglang-worker-<port>.log files (default: <tmp>/pytest-sglworker-<uid>/logs)"
LOCK_DIR_DESC = "directory for GPU and port lock files shared by every pytest process of the machine"
STARTUP_TIMEOUT_DESC = "seconds a worker may take to become healthy (default 600)"
LEASE_TIMEOUT_DESC = "seconds to wait for a free GPU lease before failing (default 1800)"
GPUS_DESC = "GPUs to use: NVML indices '0,2', UUIDs, or a declared inventory 'sim:N' / 'sim:NxGiB' (e.g. sim:4x80)"
PORT_RANGE_DESC = "port range for worker port blocks, 'LOW-HIGH' (default: below the ephemeral range)"
KEEP_LOGS_DESC = "keep every worker log, whatever --sgl-log-retention-policy says"
REUSE_DESC = "reuse a running worker across tests of the same configuration: 'on' (default) or 'off'"
REORDER_DESC = "reorder tests so that tests of one worker configuration run together: 'on' (default) or 'off'"
DIST_DESC = ("how pytest-xdist hands out worker tests: 'auto' (default: by worker configuration under -n when no "
             "--dist is given), 'on' (by worker configuration, whatever --dist says), 'off' (xdist's own --dist); "
             "',steal=K' starts an extra copy of a configuration only while K or more of its tests are left per copy "
             "(default 4), ',steal=off' never")
REPORT_DESC = "write the run report (launches, reuses, startup times, failures) as JSON to this path"
TAIL_DESC = "log lines shown in failure reports (default 40)"
CARD_DESC = "GPU card for the memory ledger of --sgl-list-models, e.g. H100-80G, H200, A100-40G, L4"
TIMELINE_DESC = "write the run's timeline (a lane per GPU, a bar per launch) as one self-contained HTML file"
TRACE_DESC = "write the run's launches as Chrome trace-event JSON (Perfetto, chrome://tracing)"
RETENTION_COUNT_DESC = ("how many sessions' worker logs to keep under the default log root, in session-<N> "
                        "directories with a 'current' link (default 3, like pytest's tmp_path_retention_count); "
                        "a session whose summary says 'log kept' is left out of the count for 7 days")
RETENTION_POLICY_DESC = ("which worker logs to keep: 'all' (default), 'failed' (only those of workers that failed "
                         "or served a failing test), 'none' (like pytest's tmp_path_retention_policy)")
LAUNCH_AHEAD_DESC = ("start up to N upcoming worker configurations ahead, on free GPUs, while earlier tests "
                     "run (default 1; 0 turns it off)")
WORKER_URL_DESC = ("run the tests of model spec NAME against the running worker at URL instead of launching one "
                   "(never leased, never stopped; its /server_info must keep the budget); repeatable, several URLs "
                   "of one NAME make a group")
SHARD_DESC = ("run only the K-th of N shards of the selected tests, 'K/N' (e.g. 2/4): each worker configuration's "
              "tests stay on one shard; balanced by --sgl-shard-report, else by test count")
SHARD_REPORT_DESC = ("earlier runs' --sgl-report file(s) whose measured times balance --sgl-shard; comma-separated "
                     "paths or glob patterns (a missing file falls back to balancing by test count)")
CLUSTER_DESC = ("where workers run: 'off' (default: this machine, file-lock GPU leases), 'ray' (a Ray cluster, "
                "ray.init(address='auto'), RAY_ADDRESS honoured), 'ray://HOST:PORT' (Ray Client) or 'ray:HOST:PORT' "
                "(a GCS address); Ray's scheduler then leases the GPUs (needs pytest-sglworker[ray])")
KEEP_WARM_DESC = ("keep the pooled workers still healthy at the session's end running, for the next session of an "
                  "unchanged configuration to adopt, until TTL after their last use: bare (15m), or =TTL (90s, 15m, "
                  "1h, 600) or =off; off by default, and off under CI (the CI variable set) unless given on the "
                  "command line or in the environment")
WARM_DESC = ("'list': show the warm workers of the lock directory (--sgl-keep-warm) and exit; 'stop': end every one "
             "no session uses right now, and exit")
ROUTER_LAUNCHER_DESC = ("command that starts the router of sgl_router, shlex-split "
                        "(default: '<python> -m sglang_router.launch_router')")


@dataclass(frozen=True)
class _Opt:
    name: str  # --sgl-<name>
    env: str
    ini: str
    help: str
    default: Any
    parse: Callable[[str], Any] | None = None


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number of seconds") from None
    if not number > 0:
        raise ValueError(f"{value!r} must be greater than 0")
    return number


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an integer") from None
    if number < 0:
        raise ValueError(f"{value!r} must be 0 or more")
    return number


def _on_off(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"on", "1", "true", "yes"}:
        return True
    if lowered in {"off", "0", "false", "no"}:
        return False
    raise ValueError(f"{value!r} is not 'on' or 'off'")


def _retention_policy(value: str) -> str:
    lowered = value.strip().lower()
    if lowered not in ("all", "failed", "none"):
        raise ValueError(f"{value!r} is not a retention policy; choose 'all', 'failed' or 'none'")
    return lowered


def _engine(value: str) -> str:
    if value not in {"real", "sim"}:
        raise ValueError(f"{value!r} is not an engine; choose 'real' or 'sim'")
    return value


def _launcher(value: str) -> tuple[str, ...]:
    from ..workers.launcher import parse_launcher

    return tuple(parse_launcher(value))


def _port_range(value: str) -> tuple[int, int]:
    from ..resources.ports import PORT_BLOCK_SIZE, parse_port_range

    low, high = parse_port_range(value)
    if high - low + 1 < PORT_BLOCK_SIZE:
        raise ValueError(f"{value!r} holds {high - low + 1} port(s), less than one worker's block of "
                         f"{PORT_BLOCK_SIZE}")
    return low, high


def _path(value: str) -> Path:
    if not value.strip():
        raise ValueError("the path is empty")
    return Path(value)


def _report_path(value: str) -> Path:
    path = _path(value)
    if path.is_dir():
        raise ValueError(f"{value!r} is a directory; give a file path, e.g. {path / 'sglworker-report.json'}")
    return path


def _card(value: str) -> str:
    from ..engine.ledger import gpu_card_mib

    gpu_card_mib(value)
    return value


def _gpus(value: str) -> str:
    from ..resources.gpus import parse_gpus_option

    parse_gpus_option(value)
    return value


#: ``--sgl-dist`` modes, and the fewest tests a copy of a configuration must take over to be worth a startup
DIST_MODES = ("auto", "on", "off")
DEFAULT_STEAL_MIN = 4


def parse_dist_option(value: str) -> tuple[str, int | None]:
    """``auto|on|off[,steal=K|off]`` -> ``(mode, K)``; ``K`` is None when stealing is off."""
    parts = [p.strip().lower() for p in value.split(",")]
    mode, rest = parts[0], parts[1:]
    if mode not in DIST_MODES:
        raise ValueError(f"{value!r} is not 'auto', 'on' or 'off' (optionally followed by ',steal=K' or "
                         "',steal=off')")
    steal: int | None = DEFAULT_STEAL_MIN
    for part in rest:
        name, _, raw = part.partition("=")
        if name.strip() != "steal" or not raw.strip():
            raise ValueError(f"{value!r}: unknown setting {part!r}; the only one is 'steal=K' or 'steal=off'")
        raw = raw.strip()
        if raw == "off":
            steal = None
            continue
        try:
            steal = int(raw)
        except ValueError:
            raise ValueError(f"{value!r}: steal={raw!r} is not an integer or 'off'") from None
        if steal < 1:
            raise ValueError(f"{value!r}: steal={raw} must be 1 or more (or 'off')")
    return mode, steal




def _dist(value: str) -> tuple[str, int | None]:
    return parse_dist_option(value)


def _shard(value: str) -> Any:
    from .sharding import parse_shard

    return parse_shard(value)


def _cluster(value: str) -> Any:
    from ..workers.sources.ray_connect import parse_cluster

    return parse_cluster(value)


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_ttl(value: str) -> float | None:
    """A ``--sgl-keep-warm`` value: ``on`` (the default TTL), ``off``, or a TTL ``90s``, ``15m``, ``1h`` or a number of
    seconds; returns the TTL in seconds, None for off."""
    from ..resources.warm_records import DEFAULT_TTL, MAX_TTL, MIN_TTL

    text = value.strip().lower()
    if text in ("on", "true", "yes", ""):
        return DEFAULT_TTL
    if text in ("off", "false", "no", "0"):
        return None
    unit = _UNITS.get(text[-1:])
    number = text[:-1] if unit is not None else text
    try:
        seconds = float(number) * (unit or 1.0)
    except ValueError:
        raise ValueError(f"{value!r} is not a TTL: give 'on', 'off', or a duration such as 90s, 15m, 1h or 600 "
                         "(seconds); a TTL goes after '=' (--sgl-keep-warm=15m), or the word after the flag would "
                         "be read as one") from None
    if not MIN_TTL <= seconds <= MAX_TTL:  # NaN too (it compares false)
        raise ValueError(f"{value!r} is not a TTL between {MIN_TTL:g} s and {MAX_TTL / 86400:g} days: give one "
                         "such as 90s, 15m or 1h, or 'off'")
    return seconds


def _keep_warm(value: str) -> float | None:
    return parse_ttl(value)


def _patterns(value: str) -> tuple[str, ...]:
    patterns = tuple(p.strip() for p in value.replace("\n", ",").split(",") if p.strip())
    if not patterns:
        raise ValueError("no path given")
    return patterns


OPTIONS: tuple[_Opt, ...] = (
    _Opt("engine", "SGLWORKER_ENGINE", "sgl_engine", ENGINE_DESC, "real", _engine),
    _Opt("launcher", "SGLWORKER_LAUNCHER", "sgl_launcher", LAUNCHER_DESC, None, _launcher),
    _Opt("log-dir", "SGLWORKER_LOG_DIR", "sgl_log_dir", LOG_DIR_DESC, None, _path),
    _Opt("lock-dir", "SGLWORKER_LOCK_DIR", "sgl_lock_dir", LOCK_DIR_DESC, None, _path),
    _Opt("startup-timeout", "SGLWORKER_STARTUP_TIMEOUT", "sgl_startup_timeout", STARTUP_TIMEOUT_DESC, 600.0,
         _positive_float),
    _Opt("lease-timeout", "SGLWORKER_LEASE_TIMEOUT", "sgl_lease_timeout", LEASE_TIMEOUT_DESC, 1800.0,
         _positive_float),
    _Opt("gpus", "SGLWORKER_GPUS", "sgl_gpus", GPUS_DESC, None, _gpus),
    _Opt("port-range", "SGLWORKER_PORT_RANGE", "sgl_port_range", PORT_RANGE_DESC, None, _port_range),
    _Opt("keep-logs", "SGLWORKER_KEEP_LOGS", "sgl_keep_logs", KEEP_LOGS_DESC, False, _on_off),
    _Opt("reuse", "SGLWORKER_REUSE", "sgl_reuse", REUSE_DESC, True, _on_off),
    _Opt("reorder", "SGLWORKER_REORDER", "sgl_reorder", REORDER_DESC, True, _on_off),
    _Opt("dist", "SGLWORKER_DIST", "sgl_dist", DIST_DESC, ("auto", 4), _dist),
    _Opt("report", "SGLWORKER_REPORT", "sgl_report", REPORT_DESC, None, _report_path),
    _Opt("tail-lines", "SGLWORKER_TAIL_LINES", "sgl_tail_lines", TAIL_DESC, 40, _positive_int),
    _Opt("card", "SGLWORKER_CARD", "sgl_card", CARD_DESC, None, _card),
    _Opt("timeline", "SGLWORKER_TIMELINE", "sgl_timeline", TIMELINE_DESC, None, _report_path),
    _Opt("trace", "SGLWORKER_TRACE", "sgl_trace", TRACE_DESC, None, _report_path),
    _Opt("log-retention-count", "SGLWORKER_LOG_RETENTION_COUNT", "sgl_log_retention_count", RETENTION_COUNT_DESC,
         3, _positive_int),
    _Opt("log-retention-policy", "SGLWORKER_LOG_RETENTION_POLICY", "sgl_log_retention_policy", RETENTION_POLICY_DESC,
         "all", _retention_policy),
    _Opt("launch-ahead", "SGLWORKER_LAUNCH_AHEAD", "sgl_launch_ahead", LAUNCH_AHEAD_DESC, 1, _positive_int),
    _Opt("router-launcher", "SGLWORKER_ROUTER_LAUNCHER", "sgl_router_launcher", ROUTER_LAUNCHER_DESC, None,
         _launcher),
    _Opt("shard", "SGLWORKER_SHARD", "sgl_shard", SHARD_DESC, None, _shard),
    _Opt("shard-report", "SGLWORKER_SHARD_REPORT", "sgl_shard_report", SHARD_REPORT_DESC, (), _patterns),
    _Opt("cluster", "SGLWORKER_CLUSTER", "sgl_cluster", CLUSTER_DESC, None, _cluster),
    _Opt("keep-warm", "SGLWORKER_KEEP_WARM", "sgl_keep_warm", KEEP_WARM_DESC, None, _keep_warm),
)


def _dest(name: str) -> str:
    return "sgl_" + name.replace("-", "_")


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("sglworker", "sglang workers (pytest-sglworker)")
    group.addoption("--sgl-model", dest="sgl_model", action="append", default=None, metavar="NAME",
                    help=MODEL_DESC + " [env SGLWORKER_MODELS, ini sgl_models]")
    parser.addini("sgl_models", MODEL_DESC, default="")
    group.addoption("--sgl-worker-url", dest="sgl_worker_url", action="append", default=None, metavar="NAME=URL",
                    help=WORKER_URL_DESC + " [env SGLWORKER_WORKER_URLS, comma-separated; ini sgl_worker_urls, one "
                                           "per line]")
    parser.addini("sgl_worker_urls", WORKER_URL_DESC, type="linelist", default=[])
    group.addoption("--sgl-list-models", dest="sgl_list_models", action="store_true", default=False,
                    help="print the model registry (model, memory, tp, features, budget, memory ledger) and exit")
    group.addoption("--sgl-warm", dest="sgl_warm", choices=("list", "stop"), default=None, metavar="list|stop",
                    help=WARM_DESC)
    for opt in OPTIONS:
        flag = f"--sgl-{opt.name}"
        if opt.default is False and opt.parse is _on_off:
            group.addoption(flag, dest=_dest(opt.name), action="store_const", const="on", default=None,
                            help=f"{opt.help} [env {opt.env}, ini {opt.ini}]")
        elif opt.parse is _keep_warm:  # --sgl-keep-warm[=TTL]
            group.addoption(flag, dest=_dest(opt.name), nargs="?", const="on", default=None, metavar="TTL",
                            help=f"{opt.help} [env {opt.env}, ini {opt.ini}]")
        else:
            group.addoption(flag, dest=_dest(opt.name), default=None, metavar="VALUE",
                            help=f"{opt.help} [env {opt.env}, ini {opt.ini}]")
        parser.addini(opt.ini, opt.help, default="")


@dataclass(frozen=True)
class Settings:
    """The resolved options of the session."""

    models: tuple[str, ...] = ()
    engine: str = "real"
    launcher: tuple[str, ...] | None = None
    log_dir: Path | None = None
    lock_dir: Path | None = None
    startup_timeout: float = 600.0
    lease_timeout: float = 1800.0
    gpus: str | None = None
    port_range: tuple[int, int] | None = None
    keep_logs: bool = False
    reuse: bool = True
    reorder: bool = True
    dist: tuple[str, int | None] = ("auto", 4)
    report: Path | None = None
    tail_lines: int = 40
    card: str | None = None
    router_launcher: tuple[str, ...] | None = None
    timeline: Path | None = None
    trace: Path | None = None
    log_retention_count: int = 3
    log_retention_policy: str = "all"
    launch_ahead: int = 1
    shard: Any = None  # sharding.ShardSpec
    shard_report: tuple[str, ...] = ()
    cluster: Any = None  # ray_cluster.ClusterSpec
    #: ``--sgl-keep-warm``: the TTL in seconds of the groups kept warm at the session's end; None: none is kept
    keep_warm: float | None = None
    #: why a keep-warm setting of the ini file is not used (CI, a cluster, attached workers), for the header
    keep_warm_note: str = ""
    #: spec name -> the attached workers of --sgl-worker-url (attached.WorkerUrl)
    worker_urls: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)

    def attached(self, spec_name: str) -> bool:
        """Whether the workers of spec ``spec_name`` are attached (``--sgl-worker-url``): none is launched or leased."""
        return spec_name in self.worker_urls

    @property
    def log_policy(self) -> str:
        """The retention policy in force: ``--sgl-keep-logs`` keeps every log whatever the policy says."""
        return "all" if self.keep_logs else self.log_retention_policy

    @property
    def gpus_explicit(self) -> bool:
        return self.sources.get("gpus", "default") != "default"


def _raw(config: pytest.Config, name: str, env: str, ini: str) -> tuple[str | None, str]:
    cli = config.getoption(_dest(name))
    if cli is not None:
        return str(cli), f"--sgl-{name}"
    if os.environ.get(env, "") != "":
        return os.environ[env], env
    value = config.getini(ini)
    if value not in ("", None, []):
        return str(value), f"ini {ini}"
    return None, "default"


def _raw_list(config: pytest.Config, name: str, env: str, ini: str) -> tuple[list[str], str]:
    """A repeatable option's raw values and where they come from: each ``--sgl-<name>`` given, else the
    environment variable (one value), else the ini (a string ini is one value, a linelist one per line)."""
    cli = config.getoption(_dest(name))
    if cli:
        return [str(v) for v in cli], f"--sgl-{name}"
    if os.environ.get(env):
        return [os.environ[env]], env
    value = config.getini(ini)
    return [str(v) for v in value] if isinstance(value, list) else [str(value or "")], f"ini {ini}"


def resolve_settings(config: pytest.Config) -> Settings:
    """Resolve every option (command line > env > ini > default); a bad value is a usage error naming it."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for opt in OPTIONS:
        raw, source = _raw(config, opt.name, opt.env, opt.ini)
        sources[opt.name] = source
        if raw is None:
            values[_dest(opt.name)[4:]] = opt.default
            continue
        try:
            values[_dest(opt.name)[4:]] = opt.parse(raw) if opt.parse else raw
        except (ValueError, SglWorkerError) as exc:
            raise pytest.UsageError(f"{source}: invalid value {raw!r}: {exc}") from None
    models: list[str] = []
    raw_models, sources["model"] = _raw_list(config, "model", "SGLWORKER_MODELS", "sgl_models")
    for chunk in raw_models:
        for name in chunk.replace("\n", ",").split(","):
            name = name.strip()
            if name and name not in models:
                models.append(name)
    raw_urls, sources["worker-url"] = _raw_list(config, "worker-url", "SGLWORKER_WORKER_URLS", "sgl_worker_urls")
    values["worker_urls"] = {}
    if not raw_urls:
        sources["worker-url"] = "default"
    else:
        from ..workers.sources.attached import (
            parse_worker_urls,  # only when given: a run without attached workers never imports it
        )

        try:
            values["worker_urls"] = parse_worker_urls(raw_urls)
        except ValueError as exc:
            raise pytest.UsageError(f"{sources['worker-url']}: {exc}") from None
    if values["cluster"] is not None and values["gpus"] is not None:
        raise pytest.UsageError(f"{sources['gpus']} and {sources['cluster']} exclude each other: on a cluster, its "
                                "scheduler leases the GPUs (drop the GPU selection, or the cluster)")
    if values["engine"] == "sim" and values["gpus"] is None:
        values["gpus"] = "sim:8x80"
    values["keep_warm"], values["keep_warm_note"] = _keep_warm_in_force(values, sources)
    return Settings(models=tuple(models), sources=sources, **values)


def running_under_ci(environ: Mapping[str, str] | None = None) -> str | None:
    """The value of ``CI`` when it says this is a CI run (set, and not ``0``/``false``/``no``/``off``), else None."""
    value = (os.environ if environ is None else environ).get("CI", "").strip()
    return value if value and value.lower() not in ("0", "false", "no", "off") else None


def _keep_warm_in_force(values: Mapping[str, Any], sources: Mapping[str, str]) -> tuple[float | None, str]:
    """``--sgl-keep-warm`` as it applies: the command line and the environment are explicit (with a cluster,
    attached workers or ``--sgl-reuse off`` that is a usage error); the ini file is a project's default, which CI
    runs and runs that cannot keep workers warm ignore (the header says so)."""
    ttl = values["keep_warm"]
    source = sources.get("keep-warm", "default")
    if ttl is None:
        return None, ""
    clash = None
    if values["cluster"] is not None:
        clash = (f"{sources['cluster']} (a Ray cluster's scheduler leases its GPUs; nothing of it outlives the "
                 "session)")
    elif values["worker_urls"]:
        clash = f"{sources['worker-url']} (attached workers are never launched, kept or stopped by the plugin)"
    elif not values["reuse"]:
        clash = f"{sources['reuse']} off (no worker is pooled, so none is left to keep warm)"
    explicit = not source.startswith("ini ")
    if clash is not None:
        if explicit:
            raise pytest.UsageError(f"{source} cannot be used with {clash}: drop one of them")
        return None, f"{source} is not used with {clash}"
    ci = running_under_ci()
    if ci is not None and not explicit:
        return None, (f"{source} is not used under CI (CI={ci!r}); ask for it with --sgl-keep-warm or "
                      "SGLWORKER_KEEP_WARM")
    return ttl, ""


