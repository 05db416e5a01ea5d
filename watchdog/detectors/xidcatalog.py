"""NVIDIA's Xid catalog as a data table: each Xid's mnemonic, description and
immediate action ("Resolution Bucket"), and the action trainwatch takes for each
class. Source of every row: NVIDIA, "Analyzing Xid Errors with the Xid Catalog",
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html (the
catalog for Ampere and newer GPUs; spreadsheet https://docs.nvidia.com/Xid-Catalog.xlsx):
the "Xids" sheet gives each row's Code, Mnemonic, Description and
"Resolution Bucket (Immediate Action)". The reading of the message-dependent
("workflow") Xids is xid.py's."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from trainwatch.types import Action


class Immediate(str, enum.Enum):
    """The catalog's "Resolution Bucket (Immediate Action)" values."""

    RESTART_APP = "RESTART_APP"  # restart the application; no reset or reboot needed
    RESTART_VM = "RESTART_VM"  # restart the VM that owns the GPU
    RESET_GPU = "RESET_GPU"
    DRAIN_P2P = "DRAIN_P2P"  # Xid 154 / NVML recovery action 3
    DRAIN_AND_RESET = "DRAIN_AND_RESET"  # Xid 154 / action 4; WORKFLOW_XID_48 with 63/64
    RESTART_BM = "RESTART_BM"  # reboot the machine
    IGNORE = "IGNORE"  # no action required
    CONTACT_SUPPORT = "CONTACT_SUPPORT"
    CHECK_MECHANICALS = "CHECK_MECHANICALS"  # seating and connectors
    CHECK_UVM = "CHECK_UVM"  # RESET_GPU if UVM/vGPU is in use, else IGNORE
    UPDATE_SWFW = "UPDATE_SWFW"  # update driver/firmware
    WORKFLOW = "WORKFLOW"  # read from the message: 45, 48, 74, 144-150, 154
    UNKNOWN = "UNKNOWN"  # not in the catalog, or no immediate action given


# trainwatch's default action per class (config may override per class and per Xid).
CLASS_ACTIONS: Mapping[Immediate, Action] = MappingProxyType({
    Immediate.RESTART_APP: Action.RESTART,
    # The GPU cannot serve a relaunch until someone resets, drains or reboots it:
    Immediate.RESTART_VM: Action.RESTART_EXCLUDE_GPU,
    Immediate.RESET_GPU: Action.RESTART_EXCLUDE_GPU,
    Immediate.DRAIN_P2P: Action.RESTART_EXCLUDE_GPU,
    Immediate.DRAIN_AND_RESET: Action.RESTART_EXCLUDE_GPU,
    Immediate.RESTART_BM: Action.RESTART_EXCLUDE_GPU,
    Immediate.CONTACT_SUPPORT: Action.RESTART_EXCLUDE_GPU,
    Immediate.IGNORE: Action.ALERT,
    # Not faults of the running job; only a person (or a config change) fixes them:
    Immediate.CHECK_MECHANICALS: Action.ALERT,
    Immediate.CHECK_UVM: Action.ALERT,  # training jobs rarely use UVM/vGPU; override if yours do
    Immediate.UPDATE_SWFW: Action.ALERT,
    # A workflow Xid whose text could not be read falls back to its row's action.
    Immediate.WORKFLOW: Action.RESTART_EXCLUDE_GPU,
    # Unknown code: alert only. If it killed the job the crash/hang detectors restart it
    # and repeats escalate at the caller; excluding a GPU on a code nobody can read is a guess.
    Immediate.UNKNOWN: Action.ALERT,
})


@dataclass(frozen=True)
class XidInfo:
    xid: int
    name: str  # the catalog's mnemonic
    immediate: Immediate
    action: Action  # trainwatch's default
    description: str = ""  # the catalog's description ("Unused": not seen on Ampere+)
    reason: str = ""  # for a workflow Xid: what in the message decided it


_APP = Immediate.RESTART_APP


_VM = Immediate.RESTART_VM


_GPU = Immediate.RESET_GPU


_BM = Immediate.RESTART_BM


_IGN = Immediate.IGNORE


_SUP = Immediate.CONTACT_SUPPORT


_MECH = Immediate.CHECK_MECHANICALS


_UVM = Immediate.CHECK_UVM


_SWFW = Immediate.UPDATE_SWFW


_WF = Immediate.WORKFLOW


_NONE = Immediate.UNKNOWN  # the catalog lists the Xid but gives no immediate action


_U = "Unused"


_RC = "ROBUST_CHANNEL_"
_NVL5 = "NVLINK: {} Error"


# (code, mnemonic, description, immediate action), in the catalog's order.
_ROWS: tuple[tuple[int, str, str, Immediate], ...] = (
    (1, _RC + "FIFO_ERROR_FIFO_METHOD", _U, _SUP),
    (2, _RC + "FIFO_ERROR_SW_METHOD", _U, _SUP),
    (3, _RC + "FIFO_ERROR_UNK_METHOD", _U, _SUP),
    (4, _RC + "FIFO_ERROR_CHANNEL_BUSY", _U, _SUP),
    (5, _RC + "FIFO_ERROR_RUNOUT_OVERFLOW", _U, _SUP),
    (6, _RC + "FIFO_ERROR_PARSE_ERR", _U, _SUP),
    (7, _RC + "FIFO_ERROR_PTE_ERR", _U, _SUP),
    (8, _RC + "FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing", _APP),
    (9, _RC + "GR_ERROR_INSTANCE", _U, _SUP),
    (10, _RC + "GR_ERROR_SINGLE_STEP", _U, _SUP),
    (11, _RC + "GR_ERROR_MISSING_HW", "Invalid or corrupted push buffer stream", _APP),
    (12, _RC + "GR_ERROR_SW_METHOD", _U, _SUP),
    (13, _RC + "GR_EXCEPTION / " + _RC + "GR_ERROR_SW_NOTIFY", "Graphics Engine Exception",
     _APP),
    (14, _RC + "FAKE_ERROR", "Unused (fake or injected error from userspace)", _IGN),
    (15, _RC + "SCANLINE_TIMEOUT", _U, _SUP),
    (16, _RC + "VBLANK_CALLBACK_TIMEOUT", _U, _SUP),
    (17, _RC + "PARAMETER_ERROR", _U, _SUP),
    (18, _RC + "BUS_MASTER_TIMEOUT_ERROR", _U, _SUP),
    (19, _RC + "DISP_MISSED_NOTIFIER", _U, _SUP),
    (20, _RC + "MPEG_ERROR_SW_METHOD", _U, _SUP),
    (21, _RC + "ME_ERROR_SW_METHOD", _U, _SUP),
    (22, _RC + "VP_ERROR_SW_METHOD", _U, _SUP),
    (23, _RC + "RC_LOGGING_ENABLED", _U, _SUP),
    (24, _RC + "GR_SEMAPHORE_TIMEOUT", _U, _SUP),
    (25, _RC + "GR_ILLEGAL_NOTIFY", "Invalid or illegal push buffer stream", _APP),
    (26, _RC + "FIFO_ERROR_FBISTATE_TIMEOUT", _U, _SUP),
    (27, _RC + "VP_ERROR", _U, _SUP),
    (28, _RC + "VP2_ERROR", _U, _SUP),
    (29, _RC + "BSP_ERROR", _U, _SUP),
    (30, _RC + "BAD_ADDR_ACCESS", _U, _SUP),
    (31, _RC + "FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault", _APP),
    (32, _RC + "PBDMA_ERROR", "Invalid or corrupted push buffer stream", _APP),
    (33, _RC + "SEC_ERROR", _U, _SUP),
    (34, _RC + "MSVLD_ERROR", _U, _SUP),
    (35, _RC + "MSPDEC_ERROR", _U, _SUP),
    (36, _RC + "MSPPP_ERROR", _U, _SUP),
    (37, _RC + "FECS_ERR_UNIMP_FIRMWARE_METHOD", "Driver firmware error", _IGN),
    (38, _RC + "FECS_ERR_WATCHDOG_TIMEOUT", "Driver firmware error", _IGN),
    (39, _RC + "CE0_ERROR", "Copy Engine Exception", _APP),
    (40, _RC + "CE1_ERROR", "Copy Engine Exception", _APP),
    (41, _RC + "CE2_ERROR", "Copy Engine Exception", _APP),
    (42, _RC + "VIC_ERROR", _U, _SUP),
    (43, _RC + "RESETCHANNEL_VERIF_ERROR", "GPU stopped processing", _IGN),
    (44, _RC + "GR_FAULT_DURING_CTXSW", "Graphics Engine fault during context switch", _IGN),
    (45, _RC + "PREEMPTIVE_REMOVAL", "Preemptive cleanup, due to previous errors", _WF),
    (46, _RC + "GPU_TIMEOUT_ERROR", "GPU stopped processing", _GPU),
    (47, _RC + "NVENC0_ERROR", _U, _SUP),
    (48, _RC + "GPU_ECC_DBE", "Double Bit ECC Error", _WF),
    (49, "SILENT_RUNNING_CONSTANT_LEVEL_SET_BY_REGISTRY", _U, _SUP),
    (50, "SILENT_RUNNING_LEVEL_TRANSITION_DUE_TO_RC_ERROR", _U, _SUP),
    (51, "SILENT_RUNNING_STRESS_TEST_FAILURE", _U, _SUP),
    (52, "SILENT_RUNNING_LEVEL_TRANS_DUE_TO_TEMP_RISE", _U, _SUP),
    (53, "SILENT_RUNNING_TEMP_REDUCED_CLOCKING", _U, _SUP),
    (54, "SILENT_RUNNING_PWR_REDUCED_CLOCKING",
     "Auxiliary power is not connected to the GPU board", _MECH),
    (55, "SILENT_RUNNING_TEMPERATURE_READ_ERROR", _U, _SUP),
    (56, "DISPLAY_CHANNEL_EXCEPTION", _U, _SUP),
    (57, "FB_LINK_TRAINING_FAILURE_ERROR", _U, _SUP),
    (58, "FB_MEMORY_ERROR", _U, _SUP),
    (59, "PMU_ERROR", _U, _SUP),
    (60, _RC + "SEC2_ERROR", "Video processor exception", _APP),
    (61, "PMU_BREAKPOINT", _U, _SUP),
    (62, "PMU_HALT_ERROR", "Internal micro-controller halt (newer drivers)", _GPU),
    (63, "INFOROM_DRAM_RETIREMENT_EVENT", "GPU memory remapping event", _IGN),
    (64, "INFOROM_DRAM_RETIREMENT_FAILURE", "GPU memory remapping failure", _GPU),
    (65, _RC + "NVENC1_ERROR", _U, _SUP),
    (66, _RC + "FECS_ERR_REG_ACCESS_VIOLATION", "Illegal access by driver", _IGN),
    (67, _RC + "FECS_ERR_VERIF_VIOLATION", "Illegal access by driver", _IGN),
    (68, _RC + "NVDEC0_ERROR", "NVDEC0 Exception", _APP),
    (69, _RC + "GR_CLASS_ERROR", "Graphics Engine class error", _APP),
    (70, _RC + "CE3_ERROR", "CE3: Unknown Error", _APP),
    (71, _RC + "CE4_ERROR", "CE4: Unknown Error", _APP),
    (72, _RC + "CE5_ERROR", "CE5: Unknown Error", _APP),
    (73, _RC + "NVENC2_ERROR", _U, _SUP),
    (74, "NVLINK_ERROR", "NVLINK Error", _WF),
    (75, _RC + "CE6_ERROR", "CE6: Unknown Error", _APP),
    (76, _RC + "CE7_ERROR", "CE7: Unknown Error", _APP),
    (77, _RC + "CE8_ERROR", "CE8: Unknown Error", _APP),
    (78, "VGPU_START_ERROR", "vGPU Start Error", _SWFW),
    (79, _RC + "GPU_HAS_FALLEN_OFF_THE_BUS", "GPU has fallen off the bus", _BM),
    (80, "PBDMA_PUSHBUFFER_CRC_MISMATCH", "Corrupted data sent to GPU", _APP),
    (81, _RC + "VGA_SUBSYSTEM_ERROR", _U, _SUP),
    (82, _RC + "NVJPG0_ERROR", "NVJPG0 Error", _APP),
    (83, _RC + "NVDEC1_ERROR", "NVDEC1 Error", _APP),
    (84, _RC + "NVDEC2_ERROR", "NVDEC2 Error", _APP),
    (85, _RC + "CE9_ERROR", "CE9: Unknown Error", _APP),
    (86, _RC + "OFA0_ERROR", "OFA Exception", _APP),
    (87, "NVTELEMETRY_DRIVER_REPORT", _U, _SUP),
    (88, _RC + "NVDEC3_ERROR", "NVDEC3 Error", _APP),
    (89, _RC + "NVDEC4_ERROR", "NVDEC4 Error", _APP),
    (90, "LTC_ERROR", _U, _SUP),
    (91, "RESERVED_XID", _U, _SUP),
    (92, "EXCESSIVE_SBE_INTERRUPTS", "High single-bit ECC error rate", _IGN),
    (93, "INFOROM_ERASE_LIMIT_EXCEEDED",
     "Non-fatal violation of provisioned InfoROM wear limit", _IGN),
    (94, _RC + "CONTAINED_ERROR", "Contained memory error", _APP),
    (95, _RC + "UNCONTAINED_ERROR", "Uncontained memory error", _GPU),
    (96, _RC + "NVDEC5_ERROR", "NVDEC5 Error", _APP),
    (97, _RC + "NVDEC6_ERROR", "NVDEC6 Error", _APP),
    (98, _RC + "NVDEC7_ERROR", "NVDEC7 Error", _APP),
    (99, _RC + "NVJPG1_ERROR", "NVJPG1 Error", _APP),
    (100, _RC + "NVJPG2_ERROR", "NVJPG2 Error", _APP),
    (101, _RC + "NVJPG3_ERROR", "NVJPG3 Error", _APP),
    (102, _RC + "NVJPG4_ERROR", "NVJPG4 Error", _APP),
    (103, _RC + "NVJPG5_ERROR", "NVJPG5 Error", _APP),
    (104, _RC + "NVJPG6_ERROR", "NVJPG6 Error", _APP),
    (105, _RC + "NVJPG7_ERROR", "NVJPG7 Error", _APP),
    (106, "SMBPBI_TEST_MESSAGE", "SMBPBI Test Message", _IGN),
    (107, "SMBPBI_TEST_MESSAGE_SILENT", "SMBPBI Test Message Silent", _IGN),
    (108, "NVLINK_REMOTE_TRANSLATION_ERROR", _U, _IGN),
    (109, _RC + "CTXSW_TIMEOUT_ERROR", "Context Switch Timeout Error", _GPU),
    (110, "SEC_FAULT_ERROR", "Security Fault Error", _GPU),
    (111, "BUNDLE_ERROR_EVENT", _U, _SUP),
    (112, "DISP_SUPERVISOR_ERROR", _U, _SUP),
    (113, "DP_LT_FAILURE", _U, _SUP),
    (114, "HEAD_RG_UNDERFLOW", _U, _SUP),
    (115, "CORE_CHANNEL_REGS", _U, _SUP),
    (116, "WINDOW_CHANNEL_REGS", _U, _SUP),
    (117, "CURSOR_CHANNEL_REGS", _U, _SUP),
    (118, "HEAD_REGS", _U, _SUP),
    (119, "GSP_RPC_TIMEOUT", "GSP RPC Timeout", _GPU),
    (120, "GSP_ERROR", "GSP Error", _GPU),
    (121, "C2C_ERROR", "C2C Error", _IGN),
    (122, "SPI_PMU_RPC_READ_FAIL", _U, _SUP),
    (123, "SPI_PMU_RPC_WRITE_FAIL", _U, _SUP),
    (124, "SPI_PMU_RPC_ERASE_FAIL", _U, _SUP),
    (125, "INFOROM_FS_ERROR", _U, _SUP),
    (126, _RC + "CE10_ERROR", "CE10: Unknown Error", _APP),
    (127, _RC + "CE11_ERROR", "CE11: Unknown Error", _APP),
    (128, _RC + "CE12_ERROR", "CE12: Unknown Error", _APP),
    (129, _RC + "CE13_ERROR", "CE13: Unknown Error", _APP),
    (130, _RC + "CE14_ERROR", "CE14: Unknown Error", _APP),
    (131, _RC + "CE15_ERROR", "CE15: Unknown Error", _APP),
    (132, _RC + "CE16_ERROR", "CE16: Unknown Error", _APP),
    (133, _RC + "CE17_ERROR", "CE17: Unknown Error", _APP),
    (134, _RC + "CE18_ERROR", "CE18: Unknown Error", _APP),
    (135, _RC + "CE19_ERROR", "CE19: Unknown Error", _APP),
    (136, "ALI_TRAINING_FAIL", "Link Training Failed", _GPU),
    (137, "NVLINK_PRIV_ERR", "NVLink Privilege Error", _IGN),
    (138, _RC + "DLA_ERROR", _U, _SUP),
    (139, _RC + "OFA1_ERROR", "OFA1 Error", _APP),
    (140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "ECC Unrecovered Error", _GPU),
    (141, _RC + "FAST_PATH_ERROR", "CUDA Fast Path Error", _IGN),
    (142, _RC + "NVENC3_ERROR", "NVENC3 Error", _SUP),
    (143, "GPU_INIT_ERROR", "GPU Initialization Error", _GPU),
    (144, "NVLINK_SAW_ERROR", _NVL5.format("SAW"), _WF),
    (145, "NVLINK_RLW_ERROR", _NVL5.format("RLW"), _WF),
    (146, "NVLINK_TLW_ERROR", _NVL5.format("TLW"), _WF),
    (147, "NVLINK_TREX_ERROR", _NVL5.format("TREX"), _WF),
    (148, "NVLINK_NVLPW_CTRL_ERROR", _NVL5.format("NVLPW_CTRL"), _WF),
    (149, "NVLINK_NETIR_ERROR", _NVL5.format("NETIR"), _WF),
    (150, "NVLINK_MSE_ERROR", _NVL5.format("MSE"), _WF),
    (151, _RC + "KEY_ROTATION_ERROR", "Key rotation Error", _VM),
    (152, _RC + "DLA_SMMU_ERROR", "DLA SMMU Error", _IGN),
    (153, _RC + "DLA_TIMEOUT", "DLA timeout Error", _IGN),
    (154, "GPU_RECOVERY_ACTION_CHANGED", "GPU Recovery Action Changed", _WF),
    (155, "NVLINK_SW_DEFINED_ERROR", "NVLINK: SW Defined Error", _GPU),
    (156, "RESOURCE_RETIREMENT_EVENT", "Resource Retirement Event", _GPU),
    (157, "RESOURCE_RETIREMENT_FAILURE", "Resource Retirement Failure", _IGN),
    (158, "GPU_FATAL_TIMEOUT", "GPU Fatal Timeout", _GPU),
    (159, _RC + "CHI_NON_DATA_ERROR", "CHI Non-Data Error", _UVM),
    (160, "CHANNEL_RETIREMENT_EVENT", "Channel Retirement Event", _IGN),
    (161, "CHANNEL_RETIREMENT_FAILURE", "Channel Retirement Failure", _IGN),
    (162, "PSHC_REENGAGED", "Power Smoothing HW Circuitry capability reengaged", _NONE),
    (163, "PSHC_DISENGAGED", "Power Smoothing HW Circuitry capability disengaged", _NONE),
    (164, "PSHC_LOW_LIFETIME", "Power Smoothing HW Circuitry low lifetime reached", _NONE),
    (165, "PSHC_ZERO_LIFETIME", "Power Smoothing HW Circuitry lifetime exhausted", _NONE),
    (166, "NVLINK_SECURE_CRYPTO_ERR",
     "CC traffic seen prior to link properly being configured for encrypted traffic", _NONE),
    (167, "PCIE_FATAL_TIMEOUT", "PCIE_FATAL_TIMEOUT", _NONE),
    (168, "REDUCED_GPU_MEMORY_CAPACITY", "Errors found in WPR (write protected region)", _NONE),
    (169, "SEC2_HALT_ERROR", "Internal micro-controller halt", _NONE),
    (170, "NVLINK_SECURE_OTHER", "Interrupt seen in CC mode", _NONE),
    (171, "UNCORRECTABLE_DRAM_ERROR", "Additional to Xid 48: the DRAM particulars", _NONE),
    (172, "UNCORRECTABLE_SRAM_ERROR", "Additional to Xid 48: the SRAM particulars", _NONE),
)


# trainwatch departs from the class default for these (config can still override).
_ACTION_OVERRIDES: Mapping[int, Action] = {
    # IGNORE for the GPU (it stays healthy), but the application "must terminate": relaunch it.
    43: Action.RESTART,
}


# What a workflow row falls back to when its message cannot be read.
_WORKFLOW_FALLBACK: Mapping[int, Action] = {
    45: Action.RESTART,  # never used: 45 always reads as solo or caused-by
    48: Action.RESTART_EXCLUDE_GPU,  # never used: 48 always reads as solo or with 63/64
    74: Action.RESTART_EXCLUDE_GPU,  # catalog: "A GPU reset or node reboot is needed to clear"
    # 144-150 and 154: Xid 154 reports the recovery action the driver derived for them
    # (the catalog's "Xid 154 linkage"), so an unreadable one only alerts.
    **dict.fromkeys(range(144, 151), Action.ALERT),
    154: Action.ALERT,  # "informational only regarding another Xid"
}


def _table(rows: tuple[tuple[int, str, str, Immediate], ...]) -> Mapping[int, XidInfo]:
    table: dict[int, XidInfo] = {}
    for xid, name, description, immediate in rows:
        if xid in table:
            raise ValueError(f"Xid {xid} listed twice")
        action = _ACTION_OVERRIDES.get(xid) or _WORKFLOW_FALLBACK.get(xid)
        table[xid] = XidInfo(xid, name, immediate, action or CLASS_ACTIONS[immediate],
                             description)
    return MappingProxyType(table)


CATALOG: Mapping[int, XidInfo] = _table(_ROWS)
