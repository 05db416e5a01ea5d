"""The YAML schema of DESIGN.md, validated into frozen, typed objects.

A mistake raises ConfigError whose text is one line naming the file, the field
path, what was expected and what was found.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from trainwatch.types import IMPLEMENTED_ACTIONS, Action, FaultKind
from trainwatch.xid import Immediate

# sun_path in struct sockaddr_un is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


class ConfigError(ValueError):
    """A user's mistake in a config file or flag: printed as one line, exit 2."""


@dataclass(frozen=True)
class Backoff:
    initial: float = 10.0
    factor: float = 2.0
    max: float = 600.0
    jitter: float = 0.1  # +/- this fraction, so that many hosts do not retry in step
    reset_after: float = 600.0  # an attempt that ran this long resets the backoff


DEFAULT_ACTIONS: Mapping[FaultKind, Action] = {
    FaultKind.CRASH: Action.RESTART,
    FaultKind.HANG: Action.RESTART,
    # gpu_xid has no entry: each Xid's action comes from its class (trainwatch.xid).
    FaultKind.GPU_LOST: Action.RESTART_EXCLUDE_GPU,
    FaultKind.GPU_ECC: Action.ALERT,  # a fatal ECC error also raises an Xid (48, 94, 95)
    FaultKind.GPU_THERMAL: Action.ALERT,
}


@dataclass(frozen=True)
class Escalate:
    """This many Xids on one GPU within ``window`` turn a restart into restart_exclude_gpu."""

    after: int = 3
    window: float = 3600.0


@dataclass(frozen=True)
class Policy:
    name: str = "default"
    max_restarts: int = 10
    window: float = 86400.0
    backoff: Backoff = field(default_factory=Backoff)
    kill_grace: float = 30.0
    actions: Mapping[FaultKind, Action] = field(default_factory=lambda: dict(DEFAULT_ACTIONS))
    # Per Xid (an int) or per class (an xid.Immediate name such as "RESET_GPU").
    xid_actions: Mapping[int | str, Action] = field(default_factory=dict)
    escalate: Escalate = field(default_factory=Escalate)
    exec: tuple[str, ...] = ()  # the operator hook: {job}, {gpu}, {kind} are filled in

    def action_for(self, kind: FaultKind) -> Action:
        return self.actions.get(kind, Action.ALERT)


@dataclass(frozen=True)
class Learned:
    """Learned hang timeout: factor x p99 of observed step intervals, at least floor."""

    factor: float = 5.0
    floor: float = 60.0
    min_samples: int = 20


@dataclass(frozen=True)
class Heartbeat:
    timeout: float = 300.0
    startup_timeout: float | None = None  # None: armed by the first beat only
    learned: Learned | None = None


@dataclass(frozen=True)
class Checkpoints:
    dir: str | None = None
    layout: str = "generic"
    pattern: str = "step_{step}"
    marker: str | None = None  # a file whose presence inside (or beside) means complete
    quiet_for: float | None = None  # unchanged this long means complete; None: off
    bad_after: int = 3  # deaths before the first beat that mark a checkpoint bad


@dataclass(frozen=True)
class Job:
    name: str
    command: tuple[str, ...]
    workdir: str | None = None
    user: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    resume_args: tuple[str, ...] = ()
    checkpoints: Checkpoints = field(default_factory=Checkpoints)
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    policy: str = "default"
    gpus: Gpus = field(default_factory=lambda: Gpus())


@dataclass(frozen=True)
class Gpus:
    """The GPUs a job runs on (NVML indices; None: every GPU of the host), and the
    fewest it can run on after restart_exclude_gpu takes one away."""

    devices: tuple[int, ...] | None = None
    min: int = 1


@dataclass(frozen=True)
class Metrics:
    address: str = "0.0.0.0"
    port: int = 9445


@dataclass(frozen=True)
class Gpu:
    backend: str = "auto"
    count: int = 0  # sim: how many GPUs to simulate
    poll_interval: float = 1.0
    kmsg: str | None = "/dev/kmsg"  # the kernel log read for Xids; null: off
    thermal_sustain: float = 30.0
    recheck_after: float | None = 3600.0  # excluded GPUs fault-free this long return; None: never


@dataclass(frozen=True)
class Config:
    state_dir: str
    run_dir: str
    jobs: tuple[Job, ...]
    policies: Mapping[str, Policy]
    metrics: Metrics = field(default_factory=Metrics)
    gpu: Gpu = field(default_factory=Gpu)
    observe_only: bool = False
    source: str = "<defaults>"

    def policy_for(self, job: Job) -> Policy:
        return self.policies[job.policy]

    def job(self, name: str | None) -> Job:
        if name is None:
            if len(self.jobs) != 1:
                names = ", ".join(j.name for j in self.jobs)
                raise ConfigError(f"{self.source}: jobs: expected one job or --name, got {names}")
            return self.jobs[0]
        for j in self.jobs:
            if j.name == name:
                return j
        raise ConfigError(f"{self.source}: jobs: no job named {name!r}")


def default_dirs() -> tuple[str, str]:
    """(state_dir, run_dir): the system paths for root, per-user ones otherwise."""
    if os.geteuid() == 0:
        return "/var/lib/trainwatch", "/run/trainwatch"
    home = Path.home()
    state = os.environ.get("XDG_STATE_HOME") or str(home / ".local" / "state")
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/trainwatch-{os.getuid()}"
    return f"{state}/trainwatch", f"{runtime}/trainwatch"


def parse_duration(value: object) -> float:
    """30, 30.5, '30s', '5m', '24h', '250ms' -> seconds. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int | float):
        if value < 0 or not math.isfinite(value):
            raise ValueError(value)
        return float(value)
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return float(m.group(1)) * _UNITS[m.group(2)]
    raise ValueError(value)


# --- the reader --------------------------------------------------------------


class _Reader:
    """Walks a mapping, checking each field and naming its path on error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, expected: str, got: object) -> ConfigError:
        if got is _MISSING:
            shown = "nothing"
        elif isinstance(got, _Said):
            shown = str(got)  # composed by the caller, already short
        else:
            shown = repr(got)
            if len(shown) > 60:
                shown = shown[:57] + "..."
        return ConfigError(f"{self.source}: {path}: expected {expected}, got {shown}")

    def mapping(self, value: object, path: str, keys: set[str]) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path or "top level", "a mapping", value)
        for k in value:
            if k not in keys:
                where = f"{path}.{k}" if path else str(k)
                expected = "one of " + ", ".join(sorted(keys))
                raise self.fail(where, expected, _Said("an unknown key"))
        return value

    def get(self, m: Mapping[str, Any], key: str, path: str, kind: str, default: Any) -> Any:
        value = m.get(key, _MISSING)
        where = f"{path}.{key}" if path else key
        if value is _MISSING:
            if default is _MISSING:
                raise self.fail(where, kind, value)
            return default
        check = _CHECKS[kind]
        try:
            return check(value)
        except (TypeError, ValueError):
            raise self.fail(where, kind, value) from None


_MISSING: Any = object()


class _Said(str):
    """A description of what was found, shown as is rather than quoted as a value."""


def _string(v: object) -> str:
    if not isinstance(v, str) or not v:
        raise TypeError(v)
    return v


def _string_list(v: object) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise TypeError(v)
    return tuple(v)


def _nonempty_list(v: object) -> tuple[str, ...]:
    items = _string_list(v)
    if not items or not items[0]:
        raise ValueError(v)
    return items


def _positive_duration(v: object) -> float:
    d = parse_duration(v)
    if d <= 0:
        raise ValueError(v)
    return d


def _optional_duration(v: object) -> float | None:
    return None if v is None else _positive_duration(v)


def _natural(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TypeError(v)
    return v


def _positive_int(v: object) -> int:
    n = _natural(v)
    if n == 0:
        raise ValueError(v)
    return n


def _port(v: object) -> int:
    n = _natural(v)
    if not 0 <= n < 65536:
        raise ValueError(v)
    return n


def _factor(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 1 <= v < math.inf:
        raise TypeError(v)
    return float(v)


def _fraction(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1:
        raise TypeError(v)
    return float(v)


def _boolean(v: object) -> bool:
    if not isinstance(v, bool):
        raise TypeError(v)
    return v


def _env(r: _Reader, raw: object, path: str) -> dict[str, str]:
    """A job's env: names to scalars, each mistake named by its variable."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise r.fail(path, "a mapping of variable names to values", raw)
    out: dict[str, str] = {}
    for k, x in raw.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k:
            raise r.fail(path, "variable names without '='", k)
        if isinstance(x, dict | list) or x is None:
            raise r.fail(f"{path}.{k}", "a string, number or true/false", x)
        out[k] = str(x).lower() if isinstance(x, bool) else str(x)
    return out


def _job_name(v: object) -> str:
    if not isinstance(v, str) or not _JOB_NAME.match(v):
        raise ValueError(v)
    return v


def _pattern(v: object) -> str:
    if not isinstance(v, str) or v.count("{step}") != 1 or "/" in v:
        raise ValueError(v)
    return v


def _backend(v: object) -> str:
    if v not in ("auto", "nvml", "sim", "off"):
        raise ValueError(v)
    return str(v)


def _layout(v: object) -> str:
    if v != "generic":
        raise ValueError(v)
    return "generic"


_CHECKS: dict[str, Any] = {
    "a non-empty string": _string,
    "a list of strings": _string_list,
    "a non-empty list of strings (the command and its arguments)": _nonempty_list,
    "a duration such as 30s, 5m or 24h": _positive_duration,
    "a duration such as 30s, 5m or 24h, or null": _optional_duration,
    "an integer >= 0": _natural,
    "an integer >= 1": _positive_int,
    "a port number 1-65535, or 0 for off": _port,
    "a number >= 1": _factor,
    "a fraction 0 <= x < 1": _fraction,
    "true or false": _boolean,
    "a name of letters, digits, '_', '.', '-' (at most 63)": _job_name,
    "a file name pattern with one {step} and no '/'": _pattern,
    "auto, nvml, sim or off": _backend,
    "generic": _layout,
}
_STR = "a non-empty string"
_DUR = "a duration such as 30s, 5m or 24h"
_OPT_DUR = "a duration such as 30s, 5m or 24h, or null"


def _action(r: _Reader, where: str, act: object) -> Action:
    try:
        action = Action(act)
    except ValueError:
        raise r.fail(where, "one of " + ", ".join(a.value for a in Action), act) from None
    if action not in IMPLEMENTED_ACTIONS:
        ok = ", ".join(sorted(a.value for a in IMPLEMENTED_ACTIONS))
        raise r.fail(where, f"an action this version carries out ({ok})", act)
    return action


def _policy(r: _Reader, name: str, raw: object) -> Policy:
    path = f"policies.{name}"
    m = r.mapping(raw, path, {"max_restarts", "window", "backoff", "kill_grace", "actions",
                              "xid_actions", "escalate", "exec"})
    d = Policy()
    b = r.mapping(
        m.get("backoff"), f"{path}.backoff", {"initial", "factor", "max", "jitter", "reset_after"}
    )
    bp = f"{path}.backoff"
    backoff = Backoff(
        initial=r.get(b, "initial", bp, _DUR, d.backoff.initial),
        factor=r.get(b, "factor", bp, "a number >= 1", d.backoff.factor),
        max=r.get(b, "max", bp, _DUR, d.backoff.max),
        jitter=r.get(b, "jitter", bp, "a fraction 0 <= x < 1", d.backoff.jitter),
        reset_after=r.get(b, "reset_after", bp, _DUR, d.backoff.reset_after),
    )
    if backoff.max < backoff.initial:
        got = b.get("max", _MISSING)
        if got is _MISSING:
            got = _Said(f"the default {backoff.max:g}s")
        raise r.fail(f"{bp}.max", f"at least initial ({backoff.initial:g}s)", got)
    actions = dict(DEFAULT_ACTIONS)
    kinds = {k.value for k in FaultKind}
    raw_actions = r.mapping(m.get("actions"), f"{path}.actions", kinds)
    for kind, act in raw_actions.items():
        where = f"{path}.actions.{kind}"
        actions[FaultKind(kind)] = _action(r, where, act)
    xid_actions: dict[int | str, Action] = {}
    classes = {c.value for c in Immediate}
    raw_xid = m.get("xid_actions") or {}
    if not isinstance(raw_xid, dict):
        raise r.fail(f"{path}.xid_actions", "a mapping of Xids or Xid classes to actions", raw_xid)
    for key, act in raw_xid.items():
        where = f"{path}.xid_actions.{key}"
        if isinstance(key, str) and key.isdigit():
            key = int(key)  # "79", as JSON writes every key
        xid_number = isinstance(key, int) and not isinstance(key, bool) and key > 0
        if not xid_number and key not in classes:
            raise r.fail(where, "an Xid number or a class (" + ", ".join(sorted(classes)) + ")",
                         key)
        xid_actions[key] = _action(r, where, act)
    ep = f"{path}.escalate"
    e = r.mapping(m.get("escalate"), ep, {"after", "window"})
    escalate = Escalate(
        after=r.get(e, "after", ep, "an integer >= 1", d.escalate.after),
        window=r.get(e, "window", ep, _DUR, d.escalate.window),
    )
    return Policy(
        name=name,
        xid_actions=xid_actions,
        escalate=escalate,
        exec=r.get(m, "exec", path, "a list of strings", ()),
        max_restarts=r.get(m, "max_restarts", path, "an integer >= 0", d.max_restarts),
        window=r.get(m, "window", path, _DUR, d.window),
        backoff=backoff,
        kill_grace=r.get(m, "kill_grace", path, _DUR, d.kill_grace),
        actions=actions,
    )


def _job(r: _Reader, i: int, raw: object, policies: Mapping[str, Policy]) -> Job:
    path = f"jobs[{i}]"
    keys = {
        "name", "command", "workdir", "user", "env", "resume_args", "checkpoints",
        "heartbeat", "policy", "gpus",
    }
    m = r.mapping(raw, path, keys)
    if not m:
        raise r.fail(path, "a mapping with name and command", raw)
    name = r.get(m, "name", path, "a name of letters, digits, '_', '.', '-' (at most 63)", _MISSING)
    command = r.get(
        m, "command", path, "a non-empty list of strings (the command and its arguments)", _MISSING
    )
    resume_args = r.get(m, "resume_args", path, "a list of strings", ())
    if resume_args and not any("{checkpoint}" in a for a in resume_args):
        raise r.fail(
            f"{path}.resume_args", "an argument containing {checkpoint}", list(resume_args)
        )

    cp = f"{path}.checkpoints"
    c = r.mapping(
        m.get("checkpoints"), cp, {"dir", "layout", "pattern", "marker", "quiet_for", "bad_after"}
    )
    dc = Checkpoints()
    checkpoints = Checkpoints(
        dir=r.get(c, "dir", cp, _STR, None),
        layout=r.get(c, "layout", cp, "generic", dc.layout),
        pattern=r.get(
            c, "pattern", cp, "a file name pattern with one {step} and no '/'", dc.pattern
        ),
        marker=r.get(c, "marker", cp, _STR, None),
        quiet_for=r.get(c, "quiet_for", cp, _OPT_DUR, None),
        bad_after=r.get(c, "bad_after", cp, "an integer >= 1", dc.bad_after),
    )

    hp = f"{path}.heartbeat"
    h = r.mapping(m.get("heartbeat"), hp, {"timeout", "startup_timeout", "learned"})
    learned: Learned | None = None
    if h.get("learned") not in (None, False):
        lp = f"{hp}.learned"
        raw_l = {} if h["learned"] is True else h["learned"]
        lm = r.mapping(raw_l, lp, {"factor", "floor", "min_samples"})
        dl = Learned()
        learned = Learned(
            factor=r.get(lm, "factor", lp, "a number >= 1", dl.factor),
            floor=r.get(lm, "floor", lp, _DUR, dl.floor),
            min_samples=r.get(lm, "min_samples", lp, "an integer >= 1", dl.min_samples),
        )
    heartbeat = Heartbeat(
        timeout=r.get(h, "timeout", hp, _DUR, Heartbeat.timeout),
        startup_timeout=r.get(h, "startup_timeout", hp, _OPT_DUR, None),
        learned=learned,
    )

    policy = r.get(m, "policy", path, _STR, "default")
    if policy not in policies:
        defined = ", ".join(sorted(policies))
        raise r.fail(f"{path}.policy", f"a policy defined under policies ({defined})", policy)
    gp = f"{path}.gpus"
    g = r.mapping(m.get("gpus"), gp, {"devices", "min"})
    devices = g.get("devices")
    if devices is not None and (
        not isinstance(devices, list) or not devices
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in devices)
        or len(set(devices)) != len(devices)
    ):
        raise r.fail(f"{gp}.devices", "a list of distinct GPU indices, or null for all", devices)
    gpus = Gpus(
        devices=tuple(devices) if devices is not None else None,
        min=r.get(g, "min", gp, "an integer >= 1", 1),
    )
    if gpus.devices is not None and gpus.min > len(gpus.devices):
        raise r.fail(f"{gp}.min", f"at most the {len(gpus.devices)} devices listed", gpus.min)
    return Job(
        name=name,
        gpus=gpus,
        command=command,
        workdir=r.get(m, "workdir", path, _STR, None),
        user=r.get(m, "user", path, _STR, None),
        env=_env(r, m.get("env"), f"{path}.env"),
        resume_args=resume_args,
        checkpoints=checkpoints,
        heartbeat=heartbeat,
        policy=policy,
    )


def from_mapping(raw: object, source: str = "<config>") -> Config:
    """Validate a parsed YAML document into a Config."""
    r = _Reader(source)
    keys = {"state_dir", "run_dir", "metrics", "gpu", "jobs", "policies", "observe_only"}
    m = r.mapping(raw, "", keys)
    state_default, run_default = default_dirs()

    raw_policies = m.get("policies") or {}
    if not isinstance(raw_policies, dict):
        raise r.fail("policies", "a mapping of policy names to policies", raw_policies)
    policies = {"default": Policy()}
    for pname, praw in raw_policies.items():
        policies[str(pname)] = _policy(r, str(pname), praw)

    raw_jobs = m.get("jobs", _MISSING)
    if not isinstance(raw_jobs, list) or not raw_jobs:
        raise r.fail("jobs", "a non-empty list of jobs", raw_jobs)
    jobs = tuple(_job(r, i, j, policies) for i, j in enumerate(raw_jobs))
    seen: set[str] = set()
    for i, j in enumerate(jobs):
        if j.name in seen:
            raise r.fail(f"jobs[{i}].name", "a name used by one job only", j.name)
        seen.add(j.name)

    mm = r.mapping(m.get("metrics"), "metrics", {"address", "port"})
    gm = r.mapping(m.get("gpu"), "gpu",
                   {"backend", "count", "poll_interval", "kmsg", "thermal_sustain",
                    "recheck_after"})
    run_dir = r.get(m, "run_dir", "", _STR, run_default)
    _check_socket_paths(r, run_dir, jobs)
    if gm.get("backend") == "sim" and not gm.get("count"):
        raise r.fail("gpu.count", "the number of GPUs to simulate (>= 1) with backend sim",
                     gm.get("count", _MISSING))
    return Config(
        state_dir=r.get(m, "state_dir", "", _STR, state_default),
        run_dir=run_dir,
        jobs=jobs,
        policies=policies,
        metrics=Metrics(
            address=r.get(mm, "address", "metrics", _STR, Metrics.address),
            port=r.get(mm, "port", "metrics", "a port number 1-65535, or 0 for off",
                       Metrics.port),
        ),
        gpu=Gpu(
            backend=r.get(gm, "backend", "gpu", "auto, nvml, sim or off", Gpu.backend),
            count=r.get(gm, "count", "gpu", "an integer >= 0", Gpu.count),
            poll_interval=r.get(gm, "poll_interval", "gpu", _DUR, Gpu.poll_interval),
            kmsg=r.get(gm, "kmsg", "gpu", _STR, Gpu.kmsg) if gm.get("kmsg", "") is not None
            else None,
            thermal_sustain=r.get(gm, "thermal_sustain", "gpu", _DUR, Gpu.thermal_sustain),
            recheck_after=r.get(gm, "recheck_after", "gpu", _OPT_DUR, Gpu.recheck_after),
        ),
        observe_only=r.get(m, "observe_only", "", "true or false", False),
        source=source,
    )


def _check_socket_paths(r: _Reader, run_dir: str, jobs: tuple[Job, ...]) -> None:
    """Each job's socket, run_dir/<name>.sock, must fit in sockaddr_un.sun_path."""
    for i, j in enumerate(jobs):
        if len(os.fsencode(socket_path(run_dir, j.name))) > MAX_SOCKET_PATH:
            most = MAX_SOCKET_PATH - len(os.fsencode(socket_path(run_dir, j.name)))
            most += len(os.fsencode(run_dir))
            raise r.fail(
                "run_dir",
                f"a path of at most {most} bytes, so that jobs[{i}]'s socket {j.name}.sock"
                f" fits an AF_UNIX address ({MAX_SOCKET_PATH} bytes)",
                _Said(f"{len(os.fsencode(run_dir))} bytes: {run_dir!r}"),
            )


def _resolve(config: Config, base: Path) -> Config:
    """Relative paths in a file are relative to the file's folder; a job's
    checkpoint dir is relative to its workdir when it has one."""

    def absolute(p: str | None, root: Path) -> str | None:
        return None if p is None else str((root / os.path.expanduser(p)).resolve())

    jobs = []
    for j in config.jobs:
        workdir = absolute(j.workdir, base)
        root = Path(workdir) if workdir else base
        cp = replace(j.checkpoints, dir=absolute(j.checkpoints.dir, root))
        jobs.append(replace(j, workdir=workdir, checkpoints=cp))
    return replace(
        config,
        jobs=tuple(jobs),
        state_dir=absolute(config.state_dir, base) or config.state_dir,
        run_dir=absolute(config.run_dir, base) or config.run_dir,
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""


class _DuplicateKey(yaml.constructor.ConstructorError):
    def __init__(self, key: object, mark: yaml.Mark) -> None:
        super().__init__(None, None, f"{key!r} again", mark)


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key; construct_mapping reports it
            continue
        if duplicate:
            raise _DuplicateKey(key, key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _unique_mapping,
)


def load(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML config file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{p}: byte {e.start}: expected UTF-8 text, got {e.object[e.start : e.start + 1]!r}"
        ) from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "top level"
        if isinstance(e, _DuplicateKey):
            raise ConfigError(f"{p}: {where}: expected each key once, got {e.problem}") from None
        said = [getattr(e, "context", None), getattr(e, "problem", None)]
        problem = ", ".join(x for x in said if x) or str(e)
        raise ConfigError(f"{p}: {where}: expected valid YAML, got an error: {problem}") from None
    config = _resolve(from_mapping(raw, str(p)), p.resolve().parent)
    # A relative run_dir is only as long as it is once resolved.
    _check_socket_paths(_Reader(str(p)), config.run_dir, config.jobs)
    return config


def socket_path(run_dir: str, job: str) -> str:
    """A job's heartbeat socket. In a folder of their own, so that no job's name
    (``control``, say) can take the place of trainwatch's control socket."""
    return os.path.join(run_dir, "jobs", f"{job}.sock")


def with_job(config: Config, job: Job) -> Config:
    """The config with its jobs replaced by this one (for `trainwatch run`)."""
    return replace(config, jobs=(job,))
