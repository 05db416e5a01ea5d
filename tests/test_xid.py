"""Xid classification: the catalog table and the workflow Xids' message readings."""

from __future__ import annotations

import pytest
from trainwatch.detectors import xidcatalog as xidmod
from trainwatch.detectors.xid import CATALOG, CLASS_ACTIONS, RECOVERY_ACTIONS, Immediate, classify
from trainwatch.types import Action

I = Immediate  # noqa: E741 (short alias keeps the tables on one line each)
ALERT, RESTART, EXCLUDE = Action.ALERT, Action.RESTART, Action.RESTART_EXCLUDE_GPU


@pytest.mark.parametrize(
    ("xid", "immediate", "action"),
    [
        (8, I.RESTART_APP, RESTART),  # GPU stopped processing
        (13, I.RESTART_APP, RESTART),  # graphics engine exception: application fault
        (14, I.IGNORE, ALERT),  # fake or injected error
        (31, I.RESTART_APP, RESTART),  # MMU fault
        (43, I.IGNORE, RESTART),  # GPU healthy, but the application must terminate
        (54, I.CHECK_MECHANICALS, ALERT),  # aux power not connected
        (61, I.CONTACT_SUPPORT, EXCLUDE),  # PMU breakpoint ("Unused" on Ampere+)
        (62, I.RESET_GPU, EXCLUDE),  # micro-controller halt
        (63, I.IGNORE, ALERT),  # row remap event
        (64, I.RESET_GPU, EXCLUDE),  # row remap failure
        (68, I.RESTART_APP, RESTART),  # NVDEC0 exception
        (69, I.RESTART_APP, RESTART),  # graphics engine class error
        (79, I.RESTART_BM, EXCLUDE),  # fallen off the bus
        (92, I.IGNORE, ALERT),  # high single-bit ECC rate
        (94, I.RESTART_APP, RESTART),  # contained memory error
        (95, I.RESET_GPU, EXCLUDE),  # uncontained memory error
        (109, I.RESET_GPU, EXCLUDE),  # context switch timeout
        (119, I.RESET_GPU, EXCLUDE),  # GSP RPC timeout
        (120, I.RESET_GPU, EXCLUDE),  # GSP error
        (121, I.IGNORE, ALERT),  # corrected C2C errors
        (140, I.RESET_GPU, EXCLUDE),  # ECC unrecovered error
        (143, I.RESET_GPU, EXCLUDE),  # GPU initialization error
        (151, I.RESTART_VM, EXCLUDE),  # key rotation error
        (159, I.CHECK_UVM, ALERT),  # CHI non-data error
        (171, I.UNKNOWN, ALERT),  # listed, but with no immediate action
    ],
)
def test_catalog_row_has_the_catalogs_immediate_action_and_trainwatchs_default(
    xid: int, immediate: Immediate, action: Action
) -> None:
    """Each important Xid maps to the catalog's immediate action and the issue's default."""
    info = classify(xid, "any text")
    assert (info.immediate, info.action) == (immediate, action)
    assert info == CATALOG[xid]  # a non-workflow Xid does not read its message


@pytest.mark.parametrize("xid", [45, 48, 74, 144, 145, 146, 147, 148, 149, 150, 154])
def test_workflow_xids_are_marked_workflow_in_the_table(xid: int) -> None:
    """The catalog's message-dependent Xids are WORKFLOW rows, resolved only by classify."""
    assert CATALOG[xid].immediate is I.WORKFLOW


FROM = "GPU recovery action changed from 0x0 (None) to "


@pytest.mark.parametrize(
    ("message", "immediate", "action"),
    [
        (FROM + "0x0 (None)", I.IGNORE, ALERT),
        (FROM + "0x1 (GPU Reset Required)", I.RESET_GPU, EXCLUDE),
        (FROM + "0x2 (Node Reboot Required)", I.RESTART_BM, EXCLUDE),
        (FROM + "0x3 (Drain P2P)", I.DRAIN_P2P, EXCLUDE),
        (FROM + "0x4 (Drain and Reset)", I.DRAIN_AND_RESET, EXCLUDE),
        ("GPU recovery action changed from 0x4 (Drain and Reset) to 0x1 (GPU Reset Required)",
         I.RESET_GPU, EXCLUDE),
        ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)",
         I.IGNORE, ALERT),
        (FROM + "0x2", I.RESTART_BM, EXCLUDE),  # number only
        (FROM + "0x7 (System Reboot)", I.CONTACT_SUPPORT, EXCLUDE),  # not a catalog value
        ("", I.WORKFLOW, ALERT),  # unreadable: the accompanying Xid carries the action
    ],
    ids=["none", "gpu-reset", "node-reboot", "drain-p2p", "drain-and-reset", "from-drain",
         "cleared", "number-only", "unlisted", "unreadable"],
)
def test_xid_154_reads_the_recovery_action_it_changed_to(
    message: str, immediate: Immediate, action: Action
) -> None:
    """Xid 154 takes the action named after "to"; None only alerts."""
    info = classify(154, message)
    assert (info.immediate, info.action) == (immediate, action)


@pytest.mark.parametrize(
    ("companions", "immediate"),
    [
        ((), I.RESET_GPU),  # solo
        ((63,), I.DRAIN_AND_RESET),  # with a row remap
        ((64,), I.DRAIN_AND_RESET),  # with a failed remap
        ((94,), I.RESET_GPU),  # neither 63 nor 64
    ],
)
def test_xid_48_is_a_gpu_reset_solo_or_drain_and_reset_with_63_or_64(
    companions: tuple[int, ...], immediate: Immediate
) -> None:
    """A DBE always takes the GPU out; a row remap/retirement with it makes it drain-and-reset."""
    info = classify(48, "pid=1234, name=python, Ch 00000002", companions=companions)
    assert (info.immediate, info.action) == (immediate, EXCLUDE)


LINK = "NVLink: fatal error detected on link 6"


def regs(*values: int) -> str:
    """A real-format Xid 74 text with seven registers (missing ones 0x0)."""
    padded = list(values) + [0] * (7 - len(values))
    return LINK + "(" + ", ".join(hex(v) for v in padded) + ")"


@pytest.mark.parametrize(
    ("message", "companions", "immediate", "action"),
    [
        (regs(0x10000), (), I.RESET_GPU, EXCLUDE),  # reg0 bit 16: possibly HW
        (regs(0, 0, 0x10000), (), I.RESET_GPU, EXCLUDE),  # reg2 bit 16
        (regs(0x30), (), I.RESET_GPU, EXCLUDE),  # reg0 bits 4, 5: ECC/parity
        (regs(0x1 | 1 << 23 | 1 << 30), (), I.IGNORE, ALERT),  # reg0 ignorable bits
        (regs(0, 0, 0, 0, 1 << 20), (), I.IGNORE, ALERT),  # reg4 ECC threshold only
        (regs(0x2), (), I.CONTACT_SUPPORT, EXCLUDE),  # sympathetic bit seen solo
        (regs(0x2), (79,), I.IGNORE, ALERT),  # sympathetic with another Xid: follow it
        (regs(0x2), (45,), I.CONTACT_SUPPORT, EXCLUDE),  # a 45 is fallout, not a cause
        (regs(0, 0, 0, 1 << 18), (), I.CONTACT_SUPPORT, EXCLUDE),  # reg3 sympathetic, solo
        (regs(0x2 | 0x10000), (), I.RESET_GPU, EXCLUDE),  # sympathetic follows the HW bit
        (regs(0x1 | 1 << 20), (), I.IGNORE, ALERT),  # sympathetic follows an ignorable bit
        (regs(0x4), (), I.CONTACT_SUPPORT, EXCLUDE),  # undocumented bit: report a bug
        (regs(0, 0, 1 << 13), (), I.CONTACT_SUPPORT, EXCLUDE),  # not expected in production
        (regs(0, 0x1), (), I.WORKFLOW, EXCLUDE),  # only an undefined register: unreadable
        ("NVLink: Fatal error detected on link 4", (), I.WORKFLOW, EXCLUDE),  # no registers
    ],
    ids=["reg0-hw", "reg2-hw", "reg0-ecc", "reg0-ignorable", "reg4-threshold",
         "sympathetic-solo", "sympathetic-with-xid", "sympathetic-with-45",
         "reg3-sympathetic-solo",
         "sympathetic-with-hw", "sympathetic-with-ignorable", "undocumented-bit",
         "reg2-bit13", "undefined-register", "no-registers"],
)
def test_xid_74_reads_the_nvlink_error_bits(
    message: str, companions: tuple[int, ...], immediate: Immediate, action: Action
) -> None:
    """Xid 74 is decided by the bits set in its first, third, fourth and fifth registers."""
    info = classify(74, "pid='<unknown>', name=<unknown>, " + message, companions=companions)
    assert (info.immediate, info.action) == (immediate, action)


@pytest.mark.parametrize(
    ("message", "companions", "immediate", "action"),
    [
        ("pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149", (),
         I.IGNORE, ALERT),
        ("pid=11317, name=python, Ch 00000008", (), I.RESTART_APP, RESTART),
        ("pid=11317, name=python, Ch 00000008", (45,), I.RESTART_APP, RESTART),  # itself
        ("pid=11317, name=python, Ch 00000008", (13,), I.IGNORE, ALERT),
    ],
    ids=["caused-by", "solo", "only-more-45s", "with-13"],
)
def test_xid_45_follows_its_cause_and_restarts_the_app_when_solo(
    message: str, companions: tuple[int, ...], immediate: Immediate, action: Action
) -> None:
    """Preemptive cleanup defers to the Xid that caused it; solo, the app was torn down."""
    info = classify(45, message, companions=companions)
    assert (info.immediate, info.action) == (immediate, action)


ZEROS = " 0x00000000 0x00000000 0x00000000 0x00000000)"


@pytest.mark.parametrize(
    ("xid", "message", "companions", "immediate", "action"),
    [
        (149, "NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 0x00000000" + ZEROS, (),
         I.RESET_GPU, EXCLUDE),
        (149, "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x026001c6 0x00000000" + ZEROS, (),
         I.IGNORE, ALERT),  # link-down reason 0b100110: IGNORE in the decode sheet
        (144, "SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008" + ZEROS, (),
         I.IGNORE, ALERT),
        (145, "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001"
         " 0x00000000 0x00100000 0x00000004)", (), I.IGNORE, ALERT),
        (145, "RLW_REMAP Nonfatal XC0 i0 Link 3 (0x00000082 0x00000004" + ZEROS, (),
         I.RESTART_APP, RESTART),  # XID_154_EVAL without a 154
        (145, "RLW_REMAP Nonfatal XC0 i0 Link 3 (0x00000082 0x00000004" + ZEROS, (154,),
         I.IGNORE, ALERT),  # XID_154_EVAL: the 154 carries the action
        (150, "MSE_WATCHDOG Fatal XC0 i0 Link -1 (0x00000000 0x00000000" + ZEROS, (),
         I.RESET_GPU, EXCLUDE),
        (146, "something new", (), I.WORKFLOW, ALERT),  # unreadable: Xid 154 will say
    ],
    ids=["149-fatal", "149-fatal-sw", "144-nonfatal", "145-rxpipe-nonfatal",
         "145-remap-solo", "145-remap-with-154", "150-fatal", "unreadable"],
)
def test_nvlink5_xids_read_fatality_and_the_decode_sheet(
    xid: int, message: str, companions: tuple[int, ...], immediate: Immediate, action: Action
) -> None:
    """Xids 144-150: fatal resets the GPU, non-fatal is ignored, except the decode sheet's rows."""
    info = classify(xid, message, companions=companions)
    assert (info.immediate, info.action) == (immediate, action)


@pytest.mark.parametrize("xid", [0, 173, 999, -1])
def test_unknown_xid_only_alerts(xid: int) -> None:
    """An Xid the catalog does not list is UNKNOWN and only alerts."""
    info = classify(xid, "whatever")
    assert (info.xid, info.immediate, info.action) == (xid, I.UNKNOWN, ALERT)
    assert info.name


def test_table_has_no_duplicates_and_every_row_is_named() -> None:
    """One row per Xid, keyed by its own number, each with a mnemonic and a description."""
    assert len(CATALOG) == len(xidmod._ROWS)
    with pytest.raises(ValueError, match="Xid 13 listed twice"):
        xidmod._table((xidmod._ROWS[12], xidmod._ROWS[12]))
    for key, info in CATALOG.items():
        assert key == info.xid and info.name.strip() and info.description.strip()


def test_table_covers_the_xids_the_issue_names() -> None:
    """Every Xid the issue and the brief name is in the table."""
    named = {13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 119, 120,
             121, 140, 143, 154, *range(144, 151)}
    assert named <= CATALOG.keys()


def test_row_actions_follow_the_class_defaults_except_documented_exceptions() -> None:
    """A row's action is its class default, bar the override (43) and the workflow rows."""
    exceptions = {43} | {x for x, info in CATALOG.items() if info.immediate is I.WORKFLOW}
    for x, info in CATALOG.items():
        if x not in exceptions:
            assert info.action is CLASS_ACTIONS[info.immediate], x
    assert set(CLASS_ACTIONS) == set(Immediate)


def test_recovery_actions_are_nvmls_values() -> None:
    """RECOVERY_ACTIONS uses nvmlDeviceGpuRecoveryAction_t's numbering (0 none .. 4 drain+reset)."""
    assert {n: text for n, (text, _) in RECOVERY_ACTIONS.items()} == {
        0: "None", 1: "GPU Reset Required", 2: "Node Reboot Required", 3: "Drain P2P",
        4: "Drain and Reset"}
