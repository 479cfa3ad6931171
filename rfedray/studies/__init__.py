"""Named studies that reproduce the paper's results: ``rfedray experiment NAME``."""

from __future__ import annotations

import importlib

STUDIES = {
    "fedpca-dimension": "rfedray.studies.fedpca:FedPCADimension",
    "fedpca-participation": "rfedray.studies.fedpca:FedPCAParticipation",
    "fedpca-accounting": "rfedray.studies.fedpca:FedPCAAccounting",
    "noise-ratio": "rfedray.studies.accounting:NoiseRatio",
    "aggregation-cost": "rfedray.studies.aggregation_cost:AggregationCost",
    "mestimation": "rfedray.studies.mestimation:MEstimationStudy",
    "eeg-centralised": "rfedray.studies.eeg:EEGCentralised",
    "eeg-federated": "rfedray.studies.eeg:EEGFederated",
    "eeg-prirfed": "rfedray.studies.eeg:EEGPriRFed",
    "eeg-curves": "rfedray.studies.eeg:EEGCurves",
    "eeg-physionet": "rfedray.studies.eeg_physionet:EEGPhysionet",
}


def get_study(name: str):
    from rfedray.errors import RfedrayError

    if name not in STUDIES:
        raise RfedrayError(f"experiment {name!r}: unknown study; `rfedray experiment --list` shows them")
    module, cls = STUDIES[name].split(":")
    return getattr(importlib.import_module(module), cls)()
