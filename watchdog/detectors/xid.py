"""Xid classification: NVIDIA's Xid catalog (xidcatalog.py, a data table), and the
reading of the catalog's message-dependent ("workflow") Xids.

Source: NVIDIA, "Analyzing Xid Errors with the Xid Catalog",
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html
(spreadsheet https://docs.nvidia.com/Xid-Catalog.xlsx): the "Fault Resolution Buckets" sheet
gives WORKFLOW_XID_45, WORKFLOW_XID_48 and WORKFLOW_NVLINK_ERR (Xid 74); the
"XID 144-150 Decode" sheet gives the NVLink5 rows; Xid 154's trigger text gives
its recovery-action strings. The recovery-action numbers are NVML's
``nvmlDeviceGpuRecoveryAction_t`` (the same values as field 230,
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION). The " caused by previous Xid N" suffix of
Xid 45 is printed by the driver (open-gpu-kernel-modules,
``src/nvidia/src/kernel/gpu/rc/kernel_rc.c``).

``classify`` is pure: a number, the driver's text, optionally the other Xids
seen with it -> an ``XidInfo``. Escalation of repeats is the caller's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import TypeAlias

from trainwatch.detectors.xidcatalog import CATALOG, CLASS_ACTIONS, Immediate, XidInfo

# --- workflow readings ---------------------------------------------------------
# Each returns the resolved immediate action and why, or None when the text
# cannot be read (the row's fallback action then stands).

_Reading: TypeAlias = "tuple[Immediate, str] | None"

# Xid 154's recovery actions: (catalog text, immediate action) by NVML value.
RECOVERY_ACTIONS: Mapping[int, tuple[str, Immediate]] = MappingProxyType({
    0: ("None", Immediate.IGNORE),
    1: ("GPU Reset Required", Immediate.RESET_GPU),
    2: ("Node Reboot Required", Immediate.RESTART_BM),
    3: ("Drain P2P", Immediate.DRAIN_P2P),
    4: ("Drain and Reset", Immediate.DRAIN_AND_RESET),
})
_RECOVERY_BY_TEXT = {text.casefold(): imm for text, imm in RECOVERY_ACTIONS.values()}
# "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
_RE_154 = re.compile(r"\bto\s+(?:0x([0-9a-f]+)\s*)?(?:\(([^)]*)\))?", re.IGNORECASE)


def _read_154(message: str, others: frozenset[int]) -> _Reading:
    m = _RE_154.search(message)
    if m is None or not (m.group(1) or m.group(2)):
        return None
    number, text = m.group(1), (m.group(2) or "").strip()
    imm = _RECOVERY_BY_TEXT.get(text.casefold())
    if imm is None and number is not None and int(number, 16) in RECOVERY_ACTIONS:
        imm = RECOVERY_ACTIONS[int(number, 16)][1]
    shown = text or f"0x{number}"
    if imm is None:  # a recovery action is required, but not one the catalog names
        return Immediate.CONTACT_SUPPORT, f"recovery action -> {shown} (not in the catalog)"
    return imm, f"recovery action -> {shown}"


_RE_CAUSED_BY = re.compile(r"caused by previous Xid (\d+)", re.IGNORECASE)


def _read_45(message: str, others: frozenset[int]) -> _Reading:
    # WORKFLOW_XID_45: "Solo: RESTART_FM; Not Solo: IGNORE (follow other Xid)". The catalog
    # never defines RESTART_FM; its trigger text says the application was torn down, so
    # solo means restart the application.
    m = _RE_CAUSED_BY.search(message)
    if m is not None:
        return Immediate.IGNORE, f"caused by previous Xid {m.group(1)}: follow that one"
    if others:
        return Immediate.IGNORE, f"seen with Xid {sorted(others)}: follow those"
    return Immediate.RESTART_APP, "solo: the application was torn down"


def _read_48(message: str, others: frozenset[int]) -> _Reading:
    # WORKFLOW_XID_48: "Solo: RESET_GPU; w/ 63 or 64: DRAIN_AND_RESET". The text names the
    # unit (framebuffer or SRAM), which matters to the investigation, not to the action.
    if others & {63, 64}:
        return Immediate.DRAIN_AND_RESET, "DBE with a row remap/page retirement (63/64)"
    return Immediate.RESET_GPU, "solo DBE"


# WORKFLOW_NVLINK_ERR (Xid 74): (register, bits, class, note). The registers are the
# seven hex fields of "... link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"; only the
# first, third, fourth and fifth are defined. Class None: sympathetic ("follow the
# resolution for the other bits or Xids; if seen solo, report a bug"). Any bit not
# listed: "report a bug". A link error needs a GPU reset or reboot to clear (row text),
# so the bits not marked ignorable read as RESET_GPU.
_NVLINK_BITS: tuple[tuple[int, tuple[int, ...], Immediate | None, str], ...] = (
    (0, (0, 23, 30), Immediate.IGNORE, "can be safely ignored"),
    (0, (1, 20), None, "sympathetic"),
    (0, (4, 5), Immediate.RESET_GPU, "ECC/parity, likely HW"),
    (0, (8, 9, 12, 16, 17, 24, 28), Immediate.RESET_GPU, "possibly HW: check link mechanicals"),
    (0, (21, 22), Immediate.RESET_GPU, "marginal channel SI"),
    (0, (27, 29), Immediate.RESET_GPU, "report a bug if repeated"),
    (2, (0, 1, 2, 6), Immediate.RESET_GPU, "ECC/parity, likely HW"),
    (2, (13,), Immediate.CONTACT_SUPPORT, "not expected in production"),
    (2, (16, 19), Immediate.RESET_GPU, "field diags if repeated"),
    (2, (17, 18), Immediate.RESET_GPU, "report a bug if repeated"),
    (3, (16, 17), None, "sympathetic"),
    (3, (18,), None, "sympathetic; fabric reset required"),
    (4, (18, 19, 21, 22, 24, 25, 27, 28), Immediate.RESET_GPU, "ECC/parity, likely HW"),
    (4, (20, 23, 26, 29), Immediate.IGNORE, "ECC threshold exceeded, no uncorrectable error"),
)
_NVLINK_BIT_CLASS = {(reg, bit): (cls, note)
                     for reg, bits, cls, note in _NVLINK_BITS for bit in bits}
_NVLINK_REGISTERS = (0, 2, 3, 4)
_NVLINK_SEVERITY = (Immediate.IGNORE, Immediate.CONTACT_SUPPORT, Immediate.RESET_GPU)
_RE_74 = re.compile(r"\(\s*(0x[0-9a-f]+(?:\s*,\s*0x[0-9a-f]+)*)\s*\)", re.IGNORECASE)


def _read_74(message: str, others: frozenset[int]) -> _Reading:
    m = _RE_74.search(message)
    if m is None:
        return None
    regs = [int(v, 16) for v in m.group(1).split(",")]
    decided: list[tuple[Immediate, str]] = []
    sympathetic: list[str] = []
    for reg in _NVLINK_REGISTERS:
        value = regs[reg] if reg < len(regs) else 0
        for bit in range(32):
            if value >> bit & 1:
                cls, note = _NVLINK_BIT_CLASS.get((reg, bit),
                                                  (Immediate.CONTACT_SUPPORT, "undocumented bit"))
                why = f"reg{reg} bit {bit}: {note}"
                if cls is None:
                    sympathetic.append(why)
                else:
                    decided.append((cls, why))
    if not decided and not sympathetic:
        return None
    if sympathetic and not decided and not others - {45}:  # a 45 is this Xid's fallout
        return Immediate.CONTACT_SUPPORT, "solo " + "; ".join(sympathetic)
    if not decided:
        return Immediate.IGNORE, "; ".join(sympathetic) + f"; follow Xid {sorted(others)}"
    worst = max((cls for cls, _ in decided), key=_NVLINK_SEVERITY.index)
    return worst, "; ".join(why for cls, why in decided if cls is worst)


# WORKFLOW_NVLINK5_ERR (Xids 144-150), from the "XID 144-150 Decode" sheet:
# "Xid (PCI:..): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 01 (0x021425c6 0x00000000 ...)".
# Fatal rows are RESET_GPU, non-fatal rows IGNORE, except these.
_NVLINK5_FATAL_IGNORED = {  # (xid, link-down reason: intrInfo bits 20-25)
    (149, 0b100110),  # INVESTIGATE_SW/USER
    (149, 0b101000),  # INVESTIGATE_HOST
}
_NVLINK5_LINK_DOWN_UNITS = frozenset({"NETIR_LINK_EVT", "NETIR_LINK_DOWN"})
_NVLINK5_154_EVAL = {  # XID_154_EVAL: "If an XID 154 is seen along, take that action;
    # if no XID 154 present, RESTART_APP" -- (xid, unit, error status)
    *((145, "RLW_REMAP", s) for s in (0x1, 0x2, 0x4, 0x8, 0x10, 0x20)),
    (145, "RLW_SRC_TRACK", 0x4),
    (145, "RLW_SRC_TRACK", 0x8),
}
_RE_NVLINK5 = re.compile(
    r"\b([A-Z][A-Z0-9_]*(?:/[A-Z0-9_]+)?)\s+(Fatal|Non-?fatal)\b"
    r"(?:[^(]*\(\s*(0x[0-9a-f]+)(?:\s+(0x[0-9a-f]+))?)?",
    re.IGNORECASE,
)


def _nvlink5(xid: int) -> Callable[[str, frozenset[int]], _Reading]:
    def read(message: str, others: frozenset[int]) -> _Reading:
        m = _RE_NVLINK5.search(message)
        if m is None:
            return None
        unit, severity = m.group(1).upper(), m.group(2).casefold()
        intr = int(m.group(3), 16) if m.group(3) else None
        status = int(m.group(4), 16) if m.group(4) else None
        if severity == "fatal":
            reason = intr >> 20 & 0x3F if intr is not None else None
            if unit in _NVLINK5_LINK_DOWN_UNITS and (xid, reason) in _NVLINK5_FATAL_IGNORED:
                return Immediate.IGNORE, f"{unit} fatal, link-down reason {reason:#08b}"
            return Immediate.RESET_GPU, f"{unit} fatal"
        if (xid, unit, status) in _NVLINK5_154_EVAL:
            if 154 in others:
                return Immediate.IGNORE, f"{unit} non-fatal: follow Xid 154"
            return Immediate.RESTART_APP, f"{unit} non-fatal, no Xid 154"
        return Immediate.IGNORE, f"{unit} non-fatal"

    return read


_WORKFLOWS: Mapping[int, Callable[[str, frozenset[int]], _Reading]] = {
    45: _read_45,
    48: _read_48,
    74: _read_74,
    **{x: _nvlink5(x) for x in range(144, 151)},
    154: _read_154,
}


def classify(xid: int, message: str = "", *, companions: Collection[int] = ()) -> XidInfo:
    """The catalog's row for ``xid``; for a workflow Xid, resolved from ``message``.

    ``message`` is the driver's text after the Xid number. ``companions`` are the other
    Xids seen with this one (same host, the caller's correlation window): the catalog's
    "solo" means there are none.
    """
    row = CATALOG.get(xid)
    if row is None:
        return XidInfo(xid, "UNKNOWN", Immediate.UNKNOWN, CLASS_ACTIONS[Immediate.UNKNOWN])
    read = _WORKFLOWS.get(xid)
    if read is None:
        return row
    reading = read(message, frozenset(companions) - {xid})
    if reading is None:
        return replace(row, reason="message not understood")
    immediate, reason = reading
    return replace(row, immediate=immediate, action=CLASS_ACTIONS[immediate], reason=reason)
