"""How many jobs of the eeg-physionet study, as this tree plans them, an earlier start already finished.

::

    python scripts/eeg_physionet_reuse.py OUT     # OUT: the study's out= folder (search/, runs/)

A study reuses a finished run when its override list is byte-identical (the run directory is named
by a digest of the list, :func:`rfedray.studies.base.job_directory_name`), so a change of a grid, a
configuration file or :meth:`EEGPhysionet.job` reruns exactly the jobs it touches. This prints, per
model, the search jobs and the test runs that are already finished under ``OUT`` and those that would
run. Test runs need the search's choice: they are planned for the settings whose search jobs are all
finished, and counted apart for the others.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from rfedray.studies.base import _finished_summary, job_directory_name
from rfedray.studies.eeg_physionet import SCALES, EEGPhysionet, HyperparameterSearch


def main(out: Path) -> None:
    study, scale = EEGPhysionet(), SCALES["full"]
    search = HyperparameterSearch(study, scale)
    settings = study.settings(scale)
    jobs = search.jobs(settings)
    found = {key: _finished_summary(out / "search" / job_directory_name(overrides)) for key, overrides in jobs.items()}
    model = {arm.label: arm.model for _, arm, _ in settings}
    counts = Counter((model[key[1]], "search", summary is not None) for key, summary in found.items())
    ready = [s for s in settings if all(found[k] is not None for k in jobs if k[:3] == (s[0], s[1].label, s[2]))]
    chosen = search.choose(ready, found)
    # settings without a finished search get their first candidate to make the plan; their runs are not looked up
    unknown = {(n, arm.label, column): {"candidate": search.candidates(arm, column)[0]} for n, arm, column in settings if (n, arm, column) not in ready}
    for (n, _, arm, column, _, _), overrides in study.plan(scale, {**unknown, **chosen}).items():
        state = None if (n, arm, column) in unknown else _finished_summary(out / "runs" / job_directory_name(overrides)) is not None
        counts[(model[arm], "test runs", state)] += 1
    labels = {True: "finished", False: "to run", None: "to run once its search has run (choice unknown)"}
    for (name, kind, state), count in sorted(counts.items(), key=str):
        print(f"{name:7s} {kind:9s} {labels[state]}: {count}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/eeg_physionet_reuse.py OUT")
    main(Path(sys.argv[1]))
