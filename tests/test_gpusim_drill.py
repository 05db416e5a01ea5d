"""The simulated backend and drill overlays feed the same detectors as real GPUs."""

from __future__ import annotations

from trainwatch.detectors.gpu import detect_ecc, detect_lost, detect_thermal
from trainwatch.lifecycle.drill import Overlay
from trainwatch.sources.gpusim import SimGpus
from trainwatch.types import FaultKind


def test_simulated_gpus_are_healthy_and_distinct() -> None:
    """sim: N GPUs with distinct UUIDs and bus ids, and no detector fires on them."""
    samples = SimGpus(4, clock=lambda: 1.0).poll()
    assert [g.index for g in samples] == [0, 1, 2, 3]
    assert len({g.uuid for g in samples}) == 4 and len(SimGpus(4).bus_ids()) == 4
    for g in samples:
        assert detect_lost(g) is None and detect_ecc(g, g) is None
        assert detect_thermal([g], sustain=5.0) is None


def test_overlay_drills_reach_the_detectors_and_clear() -> None:
    """An ECC, thermal or lost drill on GPU 2 changes only GPU 2's samples until cleared."""
    t = [0.0]
    sim, overlay = SimGpus(4, clock=lambda: t[0]), Overlay()
    before = overlay.apply(sim.poll())
    overlay.ecc(2, uncorrected=True)
    overlay.thermal(2)
    hot = overlay.apply(sim.poll())
    t[0] = 6.0
    after = overlay.apply(sim.poll())
    ecc = detect_ecc(before[2], after[2])
    assert ecc is not None and ecc.kind is FaultKind.GPU_ECC
    assert ecc.evidence["uncorrected_new"] == 1
    assert detect_ecc(before[1], after[1]) is None
    thermal = detect_thermal([hot[2], after[2]], sustain=5.0)
    assert thermal is not None and thermal.gpu == 2
    assert detect_thermal([hot[1], after[1]], sustain=5.0) is None
    overlay.lost(2)
    lost = detect_lost(overlay.apply(sim.poll())[2])
    assert lost is not None and lost.kind is FaultKind.GPU_LOST
    overlay.clear(2)
    assert overlay.apply(sim.poll())[2] == sim.poll()[2]
