"""What a run's privacy guarantee says, and what it does not cover, as every private run's summary
states it.

The accountants bound epsilon for neighbouring datasets under the replace-one relation at the record
level (one record of one client replaced by any other), against an honest-but-curious server that
sees every submission and everything the run exports. Some of what a run exports is outside that
bound; :data:`NOT_COVERED` lists it.
"""

from __future__ import annotations

NEIGHBOURING_RELATION = (
    "replace-one, record-level: two datasets are neighbours when one record of one client is replaced by another"
)
THREAT_MODEL = (
    "honest-but-curious server: it follows the protocol and sees every submission and everything the run "
    "exports (metrics, logs, error messages, files)"
)
NOT_COVERED = (
    "timing: the clients' local-training times",
    "test-split evaluation: metrics of the clients' or the server's test records",
    "oracle metrics: metrics computed from the training records (named oracle_*)",
    "uncovered variants: a run whose summary says covered: false (DDP-SA's median clipping)",
    "seeded noise: a run with privacy.noise_seed (not_for_production: true)",
)


def statement() -> dict:
    """The summary fields ``neighbouring_relation``, ``threat_model`` and ``not_covered``."""
    return {"neighbouring_relation": NEIGHBOURING_RELATION, "threat_model": THREAT_MODEL,
            "not_covered": list(NOT_COVERED)}


__all__ = ["NEIGHBOURING_RELATION", "THREAT_MODEL", "NOT_COVERED", "statement"]
