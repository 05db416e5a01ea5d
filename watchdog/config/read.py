"""A parsed YAML mapping validated into the schema's objects.

A mistake raises ConfigError whose text is one line naming the source, the field
path (a job by its name once it has a valid one: ``jobs.train.command[3]``),
what was expected and what was found.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from trainwatch.config import fields, sections, slurmwatch
from trainwatch.config.command import check_command, check_exec_size, span
from trainwatch.config.fields import Refused, Said, show
from trainwatch.config.reader import DUR as _DUR
from trainwatch.config.reader import MISSING as _MISSING
from trainwatch.config.reader import OPT_DUR as _OPT_DUR
from trainwatch.config.reader import STR as _STR
from trainwatch.config.reader import Reader
from trainwatch.config.reader import action as _action
from trainwatch.config.schema import (
    DEFAULT_ACTIONS,
    Backoff,
    Config,
    Escalate,
    Gpu,
    Gpus,
    Heartbeat,
    Job,
    Learned,
    Metrics,
    Policy,
    Rollback,
    check_socket_paths,
    default_dirs,
)
from trainwatch.detectors.xidcatalog import Immediate
from trainwatch.types import DETECTED_KINDS, Action, FaultKind

MAX_SIM_GPUS = 1024
_COMMAND = "a non-empty list of strings (the command and its arguments)"
_NOT_DECLARED = ("a job that is not declared to beat cannot be judged by the absence of"
                 " beats")


def _env(r: Reader, raw: object, path: str) -> dict[str, str]:
    """A job's env: names to scalars, each mistake named by its variable."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise r.fail(path, "a mapping of variable names to values", raw)
    out: dict[str, str] = {}
    for k, x in raw.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k:
            raise r.fail(path, "variable names without '=' or NUL bytes", k)
        where = f"{path}.{fields.key(k)}"
        if isinstance(x, dict | list) or x is None:
            raise r.fail(where, "a string, number or true/false", x)
        try:
            out[k] = fields.argument(x)
        except Refused as e:
            raise r.fail(where, e.expected, e.got) from None
    return out


def _actions(r: Reader, raw: object, path: str) -> dict[FaultKind, Action]:
    detected = ", ".join(sorted(k.value for k in DETECTED_KINDS))
    known = {k.value for k in FaultKind}
    m = r.mapping(raw, path, known, f"one of {detected}")
    actions = dict(DEFAULT_ACTIONS)
    for kind, act in m.items():
        where = f"{path}.{kind}"
        if FaultKind(kind) not in DETECTED_KINDS:
            # An action for a fault nothing raises would promise a response that never comes.
            raise r.fail(where, f"a fault kind this version detects ({detected})",
                         Said(f"{kind}, which no detector raises yet"))
        actions[FaultKind(kind)] = _action(r, where, act)
    return actions


def _policy(r: Reader, name: str, raw: object) -> Policy:
    path = f"policies.{name}"
    m = r.mapping(raw, path, {"max_restarts", "window", "backoff", "kill_grace", "actions",
                              "xid_actions", "escalate", "exec", "rollback"})
    d = Policy()
    bp = f"{path}.backoff"
    b = r.mapping(m.get("backoff"), bp, {"initial", "factor", "max", "jitter", "reset_after"})
    backoff = Backoff(
        initial=r.get(b, "initial", bp, fields.DUR0, d.backoff.initial),
        factor=r.get(b, "factor", bp, fields.FACTOR, d.backoff.factor),
        max=r.get(b, "max", bp, _DUR, d.backoff.max),
        jitter=r.get(b, "jitter", bp, "a fraction 0 <= x < 1", d.backoff.jitter),
        reset_after=r.get(b, "reset_after", bp, _DUR, d.backoff.reset_after),
    )
    if backoff.max < backoff.initial:
        got = b.get("max", _MISSING)
        if got is _MISSING:
            got = Said(f"the default {backoff.max:g}s")
        raise r.fail(f"{bp}.max", f"at least initial ({backoff.initial:g}s)", got)
    xid_actions: dict[int | str, Action] = {}
    classes = {c.value for c in Immediate}
    raw_xid = m.get("xid_actions") or {}
    if not isinstance(raw_xid, dict):
        raise r.fail(f"{path}.xid_actions", "a mapping of Xids or Xid classes to actions", raw_xid)
    for key, act in raw_xid.items():
        where = f"{path}.xid_actions.{fields.key(key)}"
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10:
            key = int(key)  # "79", as JSON writes every key
        xid_number = isinstance(key, int) and not isinstance(key, bool) and 0 < key < 1 << 31
        if not xid_number and key not in classes:
            raise r.fail(where, "an Xid number or a class (" + ", ".join(sorted(classes)) + ")",
                         key)
        xid_actions[key] = _action(r, where, act)
    ep = f"{path}.escalate"
    e = r.mapping(m.get("escalate"), ep, {"after", "window"})
    escalate = Escalate(
        after=r.get(e, "after", ep, fields.POSITIVE, d.escalate.after),
        window=r.get(e, "window", ep, _DUR, d.escalate.window),
    )
    rp = f"{path}.rollback"
    rb = r.mapping(m.get("rollback"), rp, {"before", "skip_before", "skip_after",
                                           "max_widenings"})
    rollback = Rollback(
        before=r.get(rb, "before", rp, fields.NATURAL, d.rollback.before),
        skip_before=r.get(rb, "skip_before", rp, fields.NATURAL, d.rollback.skip_before),
        skip_after=r.get(rb, "skip_after", rp, fields.NATURAL, d.rollback.skip_after),
        max_widenings=r.get(rb, "max_widenings", rp, fields.NATURAL, d.rollback.max_widenings),
    )
    raw_exec = m.get("exec")
    return Policy(
        rollback=rollback,
        name=name,
        xid_actions=xid_actions,
        escalate=escalate,
        exec=() if raw_exec is None else r.arguments(raw_exec, f"{path}.exec",
                                                     "a list of strings"),
        max_restarts=r.get(m, "max_restarts", path, fields.NATURAL, d.max_restarts),
        window=r.get(m, "window", path, _DUR, d.window),
        backoff=backoff,
        kill_grace=r.get(m, "kill_grace", path, _DUR, d.kill_grace),
        actions=_actions(r, m.get("actions"), f"{path}.actions"),
    )


def _heartbeat(r: Reader, raw: object, hp: str) -> Heartbeat:
    h = r.mapping(raw, hp, {"timeout", "startup_timeout", "learned", "required", "ranks"})
    learned: Learned | None = None
    if h.get("learned") not in (None, False):
        lp = f"{hp}.learned"
        raw_l = {} if h["learned"] is True else h["learned"]
        lm = r.mapping(raw_l, lp, {"factor", "floor", "min_samples"})
        dl = Learned()
        learned = Learned(
            factor=r.get(lm, "factor", lp, fields.FACTOR, dl.factor),
            floor=r.get(lm, "floor", lp, _DUR, dl.floor),
            min_samples=r.get(lm, "min_samples", lp, fields.POSITIVE, dl.min_samples),
        )
    heartbeat = Heartbeat(
        timeout=r.get(h, "timeout", hp, _DUR, Heartbeat.timeout),
        startup_timeout=r.get(h, "startup_timeout", hp, _OPT_DUR, None),
        learned=learned,
        required=r.get(h, "required", hp, "true or false", False),
        ranks=r.get(h, "ranks", hp, fields.RANKS, None),
    )
    if heartbeat.startup_timeout is not None and not heartbeat.required:
        raise r.fail(f"{hp}.startup_timeout", "it only with heartbeat.required: true",
                     Said(f"{show(h['startup_timeout'])} without it ({_NOT_DECLARED})"))
    return heartbeat


def _job(r: Reader, i: int, raw: object, policies: Mapping[str, Policy],
         seen: set[str], backend: str) -> Job:
    said = raw.get("name") if isinstance(raw, dict) else None
    usable = isinstance(said, str) and fields.NAME_RE.match(said) and said not in seen
    m = r.mapping(raw, f"jobs.{said}" if usable else f"jobs[{i}]", {
        "name", "command", "workdir", "user", "group", "env", "env_passthrough", "resume_args",
        "checkpoints", "nodes",
        "heartbeat", "policy", "gpus", "anomalies", "logs", "stall", "evidence",
    })
    if not m:
        raise r.fail(f"jobs[{i}]", "a mapping with name and command", raw)
    name = r.get(m, "name", f"jobs[{i}]", fields.NAME, _MISSING)
    if name in seen:
        raise r.fail(f"jobs[{i}].name", "a name used by one job only", name)
    seen.add(name)
    path = f"jobs.{name}"  # from here on the job is named by its name
    command = r.arguments(m.get("command", _MISSING), f"{path}.command", _COMMAND)
    if not command:
        raise r.fail(f"{path}.command", _COMMAND, [])
    if not command[0]:
        raise r.fail(f"{path}.command[0]", "the program to run (a non-empty string)", "")
    check_command(command, backend, lambda n: f"{r.source}: {path}.command[{n}]")
    raw_resume = m.get("resume_args")
    resume_args = () if raw_resume is None else r.arguments(
        raw_resume, f"{path}.resume_args", "a list of strings")
    if resume_args and not any("{checkpoint}" in a for a in resume_args):
        raise r.fail(f"{path}.resume_args", "an argument containing {checkpoint}",
                     list(resume_args))
    env = _env(r, m.get("env"), f"{path}.env")
    raw_pass = m.get("env_passthrough")
    passthrough = () if raw_pass is None else r.arguments(
        raw_pass, f"{path}.env_passthrough", "a list of variable names")
    for k in passthrough:
        if not k or "=" in k:
            raise r.fail(f"{path}.env_passthrough", "variable names without '='", k)
    check_exec_size(r, path, command, resume_args, env)

    checkpoints = sections.checkpoints(r, m.get("checkpoints"), f"{path}.checkpoints")
    nodes = span(r, m, path, command, env, checkpoints.dir)
    heartbeat = _heartbeat(r, m.get("heartbeat"), f"{path}.heartbeat")

    policy = r.get(m, "policy", path, _STR, "default")
    if policy not in policies:
        defined = ", ".join(sorted(policies))
        raise r.fail(f"{path}.policy", f"a policy defined under policies ({defined})", policy)
    gp = f"{path}.gpus"
    g = r.mapping(m.get("gpus"), gp, {"devices", "min", "preflight_every"})
    devices = g.get("devices")
    if devices is not None and (
        not isinstance(devices, list) or not devices
        or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_SIM_GPUS
                   for x in devices)
        or len(set(devices)) != len(devices)
    ):
        raise r.fail(f"{gp}.devices", "a list of distinct GPU indices, or null for all", devices)
    gpus = Gpus(
        devices=tuple(devices) if devices is not None else None,
        min=r.get(g, "min", gp, fields.POSITIVE, 1),
        preflight_every=r.get(g, "preflight_every", gp, _DUR, Gpus.preflight_every),
    )
    if gpus.devices is not None and gpus.min > len(gpus.devices):
        raise r.fail(f"{gp}.min", f"at most the {len(gpus.devices)} devices listed", gpus.min)
    return Job(
        name=name,
        gpus=gpus,
        command=command,
        workdir=r.get(m, "workdir", path, _STR, None),
        user=r.get(m, "user", path, fields.USER, None),
        group=r.get(m, "group", path, fields.GROUP, None),
        nodes=nodes,
        env=env,
        env_passthrough=passthrough,
        resume_args=resume_args,
        checkpoints=checkpoints,
        heartbeat=heartbeat,
        policy=policy,
        anomalies=sections.anomalies(r, m.get("anomalies"), f"{path}.anomalies"),
        logs=sections.logs(r, m.get("logs"), f"{path}.logs"),
        stall=sections.stall(r, m.get("stall"), f"{path}.stall"),
        evidence=sections.evidence(r, m.get("evidence"), f"{path}.evidence"),
    )


def _gpu(r: Reader, raw: object) -> Gpu:
    gm = r.mapping(raw, "gpu", {"backend", "count", "poll_interval", "kmsg", "thermal_sustain",
                                "recheck_after"})
    backend = r.get(gm, "backend", "gpu", "auto, nvml, sim or off", Gpu.backend)
    count = r.get(gm, "count", "gpu", fields.NATURAL, Gpu.count)
    if count > MAX_SIM_GPUS:
        raise r.fail("gpu.count", f"at most {MAX_SIM_GPUS} simulated GPUs", count)
    if backend == "sim" and not count:
        raise r.fail("gpu.count", "the number of GPUs to simulate (>= 1) with backend sim",
                     gm.get("count", _MISSING))
    return Gpu(
        backend=backend,
        count=count,
        poll_interval=r.get(gm, "poll_interval", "gpu", _DUR, Gpu.poll_interval),
        kmsg=r.get(gm, "kmsg", "gpu", _STR, Gpu.kmsg) if gm.get("kmsg", "") is not None
        else None,
        thermal_sustain=r.get(gm, "thermal_sustain", "gpu", _DUR, Gpu.thermal_sustain),
        recheck_after=r.get(gm, "recheck_after", "gpu", _OPT_DUR, Gpu.recheck_after),
    )


def from_mapping(raw: object, source: str = "<config>") -> Config:
    """Validate a parsed YAML document into a Config."""
    r = Reader(source)
    keys = {"state_dir", "run_dir", "metrics", "gpu", "jobs", "policies", "observe_only",
            "removed_jobs", "host", "slurm", "admin_group"}
    m = r.mapping(raw, "", keys)
    state_default, run_default = default_dirs()

    raw_policies = m.get("policies") or {}
    if not isinstance(raw_policies, dict):
        raise r.fail("policies", "a mapping of policy names to policies", raw_policies)
    policies = {"default": Policy()}
    for pname, praw in raw_policies.items():
        if not isinstance(pname, str) or not fields.NAME_RE.match(pname):
            raise r.fail(f"policies.{fields.key(pname)}",
                         fields.NAME.replace("a name", "a policy name"), pname)
        policies[pname] = _policy(r, pname, praw)

    gpu = _gpu(r, m.get("gpu"))
    raw_jobs = m.get("jobs", _MISSING)
    # `jobs: []` is a daemon with nothing to supervise yet (added by a reload).
    if not isinstance(raw_jobs, list):
        raise r.fail("jobs", "a list of jobs (`jobs: []` for none yet)", raw_jobs)
    seen: set[str] = set()
    jobs = tuple(_job(r, i, j, policies, seen, gpu.backend) for i, j in enumerate(raw_jobs))

    host = r.get(m, "host", "", fields.HOST, None) or socket.gethostname()
    slurm = slurmwatch.read(r, m.get("slurm"), host, lambda t: _job(r, 0, t, policies, set(),
                                                                    gpu.backend))
    mm = r.mapping(m.get("metrics"), "metrics", {"address", "port"})
    run_dir = r.get(m, "run_dir", "", _STR, run_default)
    check_socket_paths(r.source, run_dir, jobs)
    return Config(
        state_dir=r.get(m, "state_dir", "", _STR, state_default),
        run_dir=run_dir,
        jobs=jobs,
        policies=policies,
        metrics=Metrics(
            address=r.get(mm, "address", "metrics", fields.ADDRESS, Metrics.address),
            port=r.get(mm, "port", "metrics", "a port number 1-65535, or 0 for off",
                       Metrics.port),
        ),
        gpu=gpu,
        observe_only=r.get(m, "observe_only", "", "true or false", False),
        removed_jobs=_removed(r, m.get("removed_jobs", "keep")),
        admin_group=r.get(m, "admin_group", "", fields.GROUP, Config.admin_group),
        source=source,
        host=host,
        slurm=slurm,
    )


def _removed(r: Reader, v: object) -> str:
    """What a reload does with a running job that left the config."""
    if v not in ("keep", "stop"):
        raise r.fail("removed_jobs", "keep (left running, unwatched) or stop", v)
    return str(v)
