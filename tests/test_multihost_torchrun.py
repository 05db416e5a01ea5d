"""The torchrun command of a job that spans hosts, as trainwatch runs it
(trainwatch.config.torchrun): which commands are torchrun, where its own
options end and the script's begin, what is added, kept, warned or refused."""

from __future__ import annotations

import pytest
from trainwatch.actions.jobenv import job_env
from trainwatch.config import Job, torchrun
from trainwatch.config.torchrun import SpanError, parse_nodes, plan, said

FLAG = "--max-restarts=1000000"
RDZV = ["--rdzv-backend=c10d", "--rdzv-endpoint=head:29400", "--rdzv-id=j"]


def _cmd(text: str) -> list[str]:
    return text.split()


# (command, nodes, job env, where --max-restarts=1000000 goes (None: not added))
ADDED = [
    ("torchrun --nnodes=2:4 --nproc-per-node=8 --rdzv-backend=c10d train.py --lr 1", (2, 4),
     {}, 1),
    ("/opt/venv/bin/torchrun --nnodes 2 train.py", (2, 2), {}, 1),
    ("python -m torch.distributed.run --nnodes=2:4 train.py", (2, 4), {}, 3),
    ("python3.11 -u -W ignore -X dev -m torch.distributed.run --nnodes=1:2 t.py", (1, 2),
     {}, 8),
    ("python -mtorch.distributed.run --nnodes=2 t.py", (2, 2), {}, 2),
    ("python -um torch.distributed.run --nnodes=2 t.py", (2, 2), {}, 3),
    # the script's own --max-restarts is the script's, not torchrun's
    ("torchrun --nnodes=2 train.py --max-restarts=3", (2, 2), {}, 1),
    # -r takes a value: the script comes after it, and the script's --nnodes is its own
    ("torchrun -r 3 --nnodes=2 -m pkg.train --nnodes=9", (2, 2), {}, 1),
    ("torchrun -- train.py --max_restarts 3", (1, 1), {}, 1),  # no --nnodes: torchrun's 1:1
    ("torchrun train.py", (1, 1), {"PET_NNODES": "1"}, 1),
    ("torchrun --max-restarts=5000 --nnodes=2 train.py", (2, 2), {}, None),
    ("torchrun --max_restarts 5000 --nnodes=2 train.py", (2, 2), {}, None),
    ("torchrun --nnodes=2 train.py", (2, 2), {"PET_MAX_RESTARTS": "5000"}, None),
]


@pytest.mark.parametrize(("command", "nodes", "env", "at"), ADDED)
def test_max_restarts_is_added_as_torchruns_own_option_unless_the_user_gave_one(
        command: str, nodes: tuple[int, int], env: dict[str, str], at: int | None) -> None:
    """--max-restarts=1000000 goes right after the launcher, before the script, unless
    torchrun's own options (or PET_MAX_RESTARTS) already set it; the script's args are its own."""
    argv = _cmd(command)
    p = plan(argv, nodes, "h1", env)
    if at is None:
        assert list(p.argv) == argv and FLAG not in p.added
    else:
        assert list(p.argv) == [*argv[:at], FLAG, *argv[at:]]
        assert p.added[0] == FLAG
    assert p.warnings == ()
    assert p.env == {"TRAINWATCH_HOST": "h1"}
    assert p.env_defaults == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


# (command, job env, what the warning quotes)
LOW = [
    ("torchrun --max-restarts=3 --nnodes=2 train.py", {}, "--max-restarts=3"),
    ("torchrun --max_restarts 0 --nnodes=2 train.py", {}, "--max-restarts=0"),
    ("torchrun --max-r=2 --nnodes=2 train.py", {}, "--max-restarts=2"),  # argparse's prefix
    ("torchrun --nnodes=2 train.py", {"PET_MAX_RESTARTS": "10"}, "env PET_MAX_RESTARTS=10"),
]


@pytest.mark.parametrize(("command", "env", "quoted"), LOW)
def test_a_users_low_max_restarts_is_kept_with_one_warning(
        command: str, env: dict[str, str], quoted: str) -> None:
    """The user's own --max-restarts below 1000 is kept, and one warning line says why it
    ends the job on every host before trainwatch's budget does."""
    p = plan(_cmd(command), (2, 2), "h1", env)
    assert list(p.argv) == _cmd(command)
    assert len(p.warnings) == 1 and "\n" not in p.warnings[0]
    assert p.warnings[0].startswith(f"torchrun's {quoted} is kept")
    assert "every host" in p.warnings[0] and "1000" in p.warnings[0]


# (command, nodes, job env, the refusal's words)
REFUSED = [
    ("python train.py", (2, 2), {}, "nodes needs a torchrun command; got 'python'"),
    ("bash -c torchrun", (2, 2), {}, "nodes needs a torchrun command; got 'bash'"),
    ("python -c import", (2, 2), {}, "nodes needs a torchrun command"),
    ("python -m mypkg.train --nnodes=2", (2, 2), {}, "nodes needs a torchrun command"),
    ("python -m torch.distributed.launch --nnodes=2 t.py", (2, 2), {},
     "python -m torch.distributed.launch is not supported"),
    ("torchrun --nnodes=2 train.py", (2, 4), {},
     "nodes is 2:4 but the torchrun command has --nnodes=2"),
    ("torchrun --nnodes=1:4 train.py", (2, 4), {}, "has --nnodes=1:4"),
    ("torchrun train.py --nnodes=2:4", (2, 4), {}, "no --nnodes (torchrun's default 1:1)"),
    ("torchrun train.py", (2, 2), {"PET_NNODES": "3"}, "has env PET_NNODES=3"),
    ("torchrun --nnodes=two train.py", (2, 2), {}, "--nnodes: expected N or MIN:MAX"),
    ("torchrun --nnodes=2 --max-restarts=lots train.py", (2, 2), {},
     "--max-restarts: expected an integer, got 'lots'"),
    ("torchrun --standalone --nnodes=2 train.py", (2, 2), {}, "--standalone"),
]


@pytest.mark.parametrize(("command", "nodes", "env", "words"), REFUSED)
def test_a_command_that_cannot_span_the_hosts_is_refused_in_one_line(
        command: str, nodes: tuple[int, int], env: dict[str, str], words: str) -> None:
    """Not torchrun, torch.distributed.launch, --nnodes unlike nodes, a bad value, or
    --standalone: one line naming it."""
    with pytest.raises(SpanError) as e:
        plan(_cmd(command), nodes, "h1", env)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(("text", "nodes"), [
    ("2:4", (2, 4)), ("3", (3, 3)), ("1:1", (1, 1)), ("1:1048576", (1, 1 << 20)),
])
def test_nodes_read_as_torchrun_reads_nnodes(text: str, nodes: tuple[int, int]) -> None:
    """N is N:N; MIN:MAX is as written."""
    assert parse_nodes(text) == nodes


@pytest.mark.parametrize("text", ["0:2", "4:2", "0", "", ":", "2:", "a", "2:3:4", "-1",
                                  "1.5", "1:1048577", "9" * 5000, "\u0661:\u0662"])
def test_nodes_outside_one_to_max_are_refused(text: str) -> None:
    """MIN >= 1, MAX >= MIN, ASCII digits, within MAX_NODES."""
    with pytest.raises(ValueError):
        parse_nodes(text)


def test_a_users_own_shared_store_setting_is_kept_and_not_claimed() -> None:
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE from the job's env is not said to be added."""
    p = plan(["torchrun", "--nnodes=2", "t.py"], (2, 2), "h1",
             {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert p.added == (FLAG,)


def test_the_launch_line_says_what_was_added_and_why() -> None:
    """One line: the span, the flag with its reason, the shared-store setting."""
    p = plan(["torchrun", "--nnodes=2:4", *RDZV, "t.py"], (2, 4), "h1", {})
    assert said("J", (2, 4), p) == (
        "job J: spans 2:4 hosts; torchrun gets --max-restarts=1000000 (trainwatch's budget"
        " ends the job, not torchrun's) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    kept = plan(["torchrun", "--nnodes=2", "--max-restarts=9999", "t.py"], (2, 2), "h1",
                {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert said("J", (2, 2), kept) == "job J: spans 2 hosts; torchrun runs as the job wrote it"


@pytest.mark.parametrize(("job_env_", "ours", "foreground", "value"), [
    ({}, {}, False, "1"),
    ({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}, {}, False, "0"),
    ({}, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}, True, "0"),  # trainwatch run: the shell's
    ({}, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}, False, "1"),  # the daemon's is not the job's
])
def test_the_shared_store_setting_yields_to_the_jobs_own_environment(
        job_env_: dict[str, str], ours: dict[str, str], foreground: bool, value: str) -> None:
    """The job's env, or the environment it inherits, wins over trainwatch's default."""
    job = Job(name="j", command=("torchrun", "t.py"), env=job_env_, nodes=(1, 1))
    p = plan(job.command, (1, 1), "h1", job.env)
    env = job_env(job, "/run/s.sock", 0, None, ours, foreground=foreground,
                  defaults=p.env_defaults)
    assert env[torchrun.SHARED_STORE_OFF] == value
