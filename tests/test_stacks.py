"""The verdict from stacks (trainwatch.detectors.stacks): py-spy-shaped dumps in,
suspects and the rule that decided out. Table-driven; the dumps follow
py-spy 0.4's JSON (innermost frame first), the DDP ones copy what py-spy read
from a real gloo DDP rank blocked on a stopped peer."""

from __future__ import annotations

from typing import Any

import pytest
from trainwatch.detectors.stacks import Verdict, in_collective, signature, verdict


def frame(spec: str) -> dict[str, Any]:
    """"name@short/file.py:line" (line optional) as py-spy prints a frame."""
    name, _, where = spec.partition("@")
    short, _, line = where.partition(":")
    return {"name": name, "filename": f"/venv/lib/python3.11/site-packages/{short}",
            "short_filename": short, "line": int(line) if line else 0, "module": None,
            "locals": None, "is_entry": False, "is_shim_entry": False}


def thread(*specs: str, name: str = "MainThread", tid: int = 100) -> dict[str, Any]:
    return {"pid": 100, "thread_id": tid * 7, "thread_name": name, "os_thread_id": tid,
            "active": False, "owns_gil": False, "frames": [frame(s) for s in specs],
            "process_info": None}


def dump(*specs: str) -> list[dict[str, Any]]:
    """A process: a loader thread listed first (as py-spy does), then the main thread."""
    return [thread("worker@loader.py:12", "Thread.run@threading.py:982", name="loader", tid=101),
            thread(*specs)]


TRAIN = dump("train_step@train.py:10", "main@train.py:50", "<module>@train.py:61")
ALLREDUCE = dump("all_reduce@torch/distributed/distributed_c10d.py:2500",
                 "wrapper@torch/distributed/c10d_logger.py:81", "main@train.py:44",
                 "<module>@train.py:61")
ALLREDUCE_L = dump("all_reduce@torch/distributed/distributed_c10d.py:2511",
                   "wrapper@torch/distributed/c10d_logger.py:83", "main@train.py:47",
                   "<module>@train.py:61")
BARRIER = dump("barrier@mylib/sync.py:3", "main@train.py:52", "<module>@train.py:61")
BACKWARD = dump("_engine_run_backward@torch/autograd/graph.py:979",
                "backward@torch/autograd/__init__.py:395", "Tensor.backward@torch/_tensor.py:623",
                "main@ddp.py:45", "<module>@ddp.py:61")
DDP_STOPPED = dump("main@ddp.py:54", "<module>@ddp.py:61")


def native(addr: str) -> list[dict[str, Any]]:
    return dump(f"{addr}@libc.so.6", "pthread_cond_wait@libc.so.6",
                "c10d::Reducer::finalize_backward@libtorch_cpu.so",
                "_engine_run_backward@torch/autograd/graph.py:979", "main@ddp.py:45")


COND_WAIT = dump("Condition.wait@threading.py:327", "Queue.get@queue.py:171",
                 "main@train.py:30")
TORCH_WAIT = dump("wait@torch/futures/__init__.py:90", "main@train.py:30")
RECV_PIPE = dump("Connection.recv@multiprocessing/connection.py:250", "main@train.py:30")


def ranks(n: int, stack: Any, **odd: Any) -> dict[int, Any]:
    """n ranks with ``stack``, except those given as r<N>=other."""
    out = {r: stack for r in range(n)}
    out.update({int(k[1:]): v for k, v in odd.items()})
    return out


# id, stacks, states, named, suspects, decided_by, agrees
CASES: list[tuple[str, dict[int, Any], dict[int, str] | None, int | None,
                  tuple[int, ...], str, bool | None]] = [
    ("8 ranks, one odd out: named", ranks(8, ALLREDUCE, r5=TRAIN), None, 5, (5,), "majority",
     True),
    ("8 ranks, two odd out", ranks(8, ALLREDUCE, r3=TRAIN, r6=BARRIER), None, None, (3, 6),
     "majority", None),
    ("the step evidence named another rank: disagree", ranks(8, ALLREDUCE, r5=TRAIN), None, 2,
     (5,), "majority", False),
    ("all identical: no suspect", ranks(8, ALLREDUCE), None, 1, (), "none", None),
    ("line numbers differ only: one group", ranks(4, ALLREDUCE, r2=ALLREDUCE_L), None, None, (),
     "none", None),
    ("native addresses differ only: one group",
     {0: native("0x7f2936ca3f16"), 1: native("0x7f11aa000010"), 2: native("0x5599")}, None,
     None, (), "none", None),
    ("2 ranks: the one outside the collective", {0: ALLREDUCE, 1: TRAIN}, None, 1, (1,),
     "outside_collective", True),
    ("2 ranks, the other way round", {0: TRAIN, 1: ALLREDUCE}, None, 1, (0,),
     "outside_collective", False),
    ("2+2 tie: the pair outside the collective", {0: ALLREDUCE, 1: TRAIN, 2: ALLREDUCE,
                                                   3: TRAIN}, None, None, (1, 3),
     "outside_collective", None),
    ("2+2 tie, both outside any collective: no one", {0: COND_WAIT, 1: TRAIN, 2: COND_WAIT,
                                                      3: TRAIN}, None, None, (), "none", None),
    ("3 ranks all different, two inside (DDP's backward is one)",
     {0: ALLREDUCE, 1: TRAIN, 2: BACKWARD}, None, None, (1,), "outside_collective", None),
    ("2 ranks both inside, different call sites: no one",
     {0: ALLREDUCE, 1: dump("all_gather@torch/distributed/distributed_c10d.py:3000",
                            "main@train.py:70")}, None, None, (), "none", None),
    ("a rank without a stack is no evidence", {0: ALLREDUCE, 1: None, 2: ALLREDUCE, 3: TRAIN},
     None, 1, (3,), "majority", False),
    ("a single stack: nothing to compare", {0: TRAIN, 1: None}, None, None, (), "none", None),
    ("no stacks at all", {0: None, 1: None}, None, None, (), "none", None),
    ("empty dump counts as none", {0: [], 1: ALLREDUCE, 2: TRAIN}, None, None, (2,),
     "outside_collective", None),
    ("DDP python frames only: the rank outside backward", {0: BACKWARD, 1: DDP_STOPPED},
     {0: "S", 1: "T"}, 1, (1,), "outside_collective", True),
    ("DDP python frames only, no states: the rank outside backward",
     {0: BACKWARD, 1: DDP_STOPPED}, None, 1, (1,), "outside_collective", True),
    ("every rank in DDP's backward: the stopped process decides", ranks(2, BACKWARD),
     {0: "S", 1: "T"}, 1, (1,), "process_state", True),
    ("DDP native frames: c10d:: is a collective", {0: native("0x1"), 1: DDP_STOPPED},
     {0: "S", 1: "T"}, 1, (1,), "outside_collective", True),
    ("all stopped: the state names no one", ranks(2, TRAIN), {0: "T", 1: "T"}, None, (), "none",
     None),
    ("a D-state rank among sleepers", ranks(3, TRAIN), {0: "S", 1: "D", 2: "R"}, None, (1,),
     "process_state", None),
    ("the stacks win over the state", ranks(4, ALLREDUCE, r2=TRAIN), {0: "S", 1: "T", 2: "S",
                                                                      3: "S"}, None, (2,),
     "majority", None),
    ("Condition.wait is no collective", {0: COND_WAIT, 1: TRAIN}, None, None, (), "none", None),
    ("Connection.recv is no collective", {0: RECV_PIPE, 1: TRAIN}, None, None, (), "none", None),
    ("wait in torch's files is one", {0: TORCH_WAIT, 1: TRAIN}, None, None, (1,),
     "outside_collective", None),
    ("a barrier function anywhere is one", {0: BARRIER, 1: TRAIN}, None, None, (1,),
     "outside_collective", None),
    ("a dump that is not a list is no stack", {0: {"x": 1}, 1: ALLREDUCE, 2: ALLREDUCE,
                                               3: TRAIN}, None, None, (3,), "majority", None),
]


@pytest.mark.parametrize(("stacks", "states", "named", "suspects", "decided", "agrees"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_verdict_names_the_odd_ranks_and_the_rule(
        stacks: dict[int, Any], states: dict[int, str] | None, named: int | None,
        suspects: tuple[int, ...], decided: str, agrees: bool | None) -> None:
    """Each case: the suspects, the rule that decided, and the cross-check with `named`."""
    v = verdict(stacks, states, named)
    assert isinstance(v, Verdict)
    assert (v.suspects, v.decided_by, v.agrees) == (suspects, decided, agrees), v.why
    assert v.why and "\n" not in v.why


def test_groups_are_largest_first_and_leave_out_ranks_without_a_stack() -> None:
    """Groups list the ranks with a stack by signature, the dominant group first."""
    v = verdict({0: TRAIN, 1: ALLREDUCE, 2: None, 3: ALLREDUCE_L, 4: ALLREDUCE})
    assert v.groups == ((1, 3, 4), (0,))
    assert v.in_collective == (1, 3, 4)
    assert "no stack for rank 2" in v.why


def test_signature_keeps_function_and_file_only() -> None:
    """Line numbers and native addresses are not part of a signature."""
    assert signature(ALLREDUCE) == signature(ALLREDUCE_L)
    assert signature(native("0x7f0001")) == signature(native("0x55aa02"))
    assert signature(ALLREDUCE)[0] == ("all_reduce", "torch/distributed/distributed_c10d.py")


def test_main_thread_is_judged_not_helpers() -> None:
    """Ranks differing only in a helper thread share a signature; the main thread is
    found by its name, else by its OS thread id being the pid, else first."""
    other_loader = [thread("fetch@loader.py:99", name="loader", tid=101), *ALLREDUCE[1:]]
    assert verdict(ranks(3, ALLREDUCE, r1=other_loader)).suspects == ()
    renamed = [thread("worker@loader.py:1", name="loader", tid=101),
               thread("all_reduce@torch/distributed/distributed_c10d.py:1", name="main", tid=100)]
    assert in_collective(renamed)
    first = [thread("all_reduce@torch/distributed/distributed_c10d.py:1", name="a", tid=5),
             thread("train_step@train.py:1", name="b", tid=6)]
    assert in_collective(first)


def test_as_dict_is_json_ready() -> None:
    """The verdict stores as plain values (it goes into evidence.json)."""
    import json

    d = verdict(ranks(3, ALLREDUCE, r2=TRAIN), named=2).as_dict()
    assert json.loads(json.dumps(d))["suspects"] == [2]
    assert set(d) == {"suspects", "groups", "in_collective", "decided_by", "why", "agrees"}
