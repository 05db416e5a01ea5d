"""A nested training state as (skeleton JSON, leaves) and back, bit-identically.

Skeleton: a leaf is ``{"$leaf": i}``; a dict whose keys are all strings, none
starting with ``$``, is a JSON object; any other dict is ``{"$dict": [[k, v],
...]}`` (keys encoded like values: an optimizer's int parameter ids); a list
is an array, a tuple ``{"$tuple": [...]}``; int, str, bool and None are
themselves; a float too, unless nan or +-inf: ``{"$float": "nan"}``.

Leaves: a torch tensor (kind ``torch``: dtype name, shape, its bytes in C
order; restored on CPU), a numpy array (``numpy``), ``bytes``, and anything
else pickled (``pickle``). torch is imported only when a tensor is met (a
tensor exists only if torch was imported) or restored; numpy likewise.
"""

from __future__ import annotations

import math
import pickle
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Leaf", "allocate", "finish", "flatten", "unflatten"]

_PICKLE_PROTOCOL = 5


@dataclass
class Leaf:
    kind: str  # torch | numpy | bytes | pickle
    dtype: str | None
    shape: list[int] | None
    data: memoryview  # the raw bytes (C order), format "B"

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def _bytes_view(obj: Any) -> memoryview:
    return memoryview(obj).cast("B")


def _torch_leaf(t: Any) -> Leaf | None:
    import torch

    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return None  # pickled (torch's own reducer)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # staging normally did this already
    t = t.resolve_conj().resolve_neg().contiguous()
    arr = t.reshape(-1).view(torch.uint8).numpy()
    return Leaf("torch", str(t.dtype).removeprefix("torch."), list(t.shape), _bytes_view(arr))


def _numpy_leaf(a: Any) -> Leaf | None:
    import numpy as np

    dt = a.dtype
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
        return None
    try:  # "float32" where that names it exactly, else the exact form (">i4", "<U2")
        name = dt.name if np.dtype(dt.name) == dt else dt.str
    except TypeError:  # a name numpy does not take back ("str64")
        name = dt.str
    c = a if a.flags.c_contiguous else a.copy(order="C")
    return Leaf("numpy", name, list(a.shape), _bytes_view(c.reshape(-1).view(np.uint8)))


def _leaf(x: Any) -> Leaf:
    out: Leaf | None = None
    if "torch" in sys.modules and isinstance(x, sys.modules["torch"].Tensor):
        out = _torch_leaf(x)
    elif "numpy" in sys.modules and type(x) is sys.modules["numpy"].ndarray:  # subclasses
        # (a masked array, a matrix) carry more than their bytes: pickled
        out = _numpy_leaf(x)
    elif type(x) is bytes:
        out = Leaf("bytes", None, None, memoryview(x))
    if out is None:
        out = Leaf("pickle", None, None, memoryview(pickle.dumps(x, _PICKLE_PROTOCOL)))
    return out


def flatten(state: Any) -> tuple[Any, list[Leaf]]:
    """(skeleton, leaves) of ``state``; the leaves' ``data`` views keep their
    objects alive and must not change until written."""
    leaves: list[Leaf] = []

    def enc(x: Any) -> Any:
        t = type(x)
        if x is None or t is bool or t is int or t is str:
            return x
        if t is float:
            return x if math.isfinite(x) else {"$float": repr(x)}
        if t is list:
            return [enc(v) for v in x]
        if t is tuple:
            return {"$tuple": [enc(v) for v in x]}
        if isinstance(x, dict) and t.__module__ in ("builtins", "collections"):
            # dict, OrderedDict (a state_dict) and defaultdict come back as dict
            if all(type(k) is str and not k.startswith("$") for k in x):
                return {k: enc(v) for k, v in x.items()}
            return {"$dict": [[enc(k), enc(v)] for k, v in x.items()]}
        leaves.append(_leaf(x))
        return {"$leaf": len(leaves) - 1}

    return enc(state), leaves


def _special(d: dict[str, Any], objs: list[Any]) -> Any:
    if len(d) == 1:
        (k, v), = d.items()
        if k == "$leaf" and type(v) is int and 0 <= v < len(objs):
            return objs[v]
        if k == "$tuple" and isinstance(v, list):
            return tuple(_dec(x, objs) for x in v)
        if k == "$dict" and isinstance(v, list):
            return {_dec(kv[0], objs): _dec(kv[1], objs) for kv in _pairs(v)}
        if k == "$float" and v in ("nan", "inf", "-inf"):
            return float(v)
    raise ValueError(f"snapshot tree: unknown node {sorted(d)[:3]}")


def _pairs(v: Iterable[Any]) -> Iterable[list[Any]]:
    for kv in v:
        if not (isinstance(kv, list) and len(kv) == 2):
            raise ValueError("snapshot tree: a $dict entry is not a [key, value] pair")
        yield kv


def _dec(x: Any, objs: list[Any]) -> Any:
    if isinstance(x, dict):
        if any(k.startswith("$") for k in x):
            return _special(x, objs)
        return {k: _dec(v, objs) for k, v in x.items()}
    if isinstance(x, list):
        return [_dec(v, objs) for v in x]
    return x


def unflatten(skeleton: Any, objs: list[Any]) -> Any:
    """The state again, from the skeleton and the restored leaf objects."""
    return _dec(skeleton, objs)


def allocate(kind: str, dtype: str | None, shape: list[int] | None,
             nbytes: int) -> tuple[Any, memoryview]:
    """(holder, writable byte view of ``nbytes``) for a leaf to be read into;
    ``finish(kind, holder)`` gives the object. A tensor is allocated on CPU
    and its bytes read in place (a uint8 view, so bf16 and bool work)."""
    if kind == "torch":
        import torch

        dt = getattr(torch, dtype or "", None)
        if not isinstance(dt, torch.dtype) or shape is None:
            raise ValueError(f"snapshot: unknown torch dtype {dtype!r}")
        t = torch.empty(shape, dtype=dt)
        holder: Any = t
        view = _bytes_view(t.reshape(-1).view(torch.uint8).numpy())
    elif kind == "numpy":
        import numpy as np

        if dtype is None or shape is None:
            raise ValueError("snapshot: a numpy leaf without dtype or shape")
        try:
            a = np.empty(shape, dtype=np.dtype(dtype))
        except TypeError:
            raise ValueError(f"snapshot: unknown numpy dtype {dtype!r}") from None
        holder, view = a, _bytes_view(a.reshape(-1).view(np.uint8))
    elif kind in ("bytes", "pickle"):
        buf = bytearray(nbytes)
        holder, view = buf, memoryview(buf)
    else:
        raise ValueError(f"snapshot: unknown leaf kind {kind!r}")
    if view.nbytes != nbytes:
        raise ValueError(f"snapshot: a {kind} leaf of {dtype} {shape} is {view.nbytes} bytes, "
                         f"the manifest says {nbytes}")
    return holder, view


def finish(kind: str, holder: Any) -> Any:
    if kind == "bytes":
        return bytes(holder)
    if kind == "pickle":
        return pickle.loads(holder)
    return holder
