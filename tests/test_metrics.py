"""rfedray.metrics (the run's Prometheus endpoint) and rfedray.progress (the console line)."""

from __future__ import annotations

import io
import math
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prometheus_server import prometheus  # noqa: F401  (pytest fixture)
from rfedray.config import ConfigError
from rfedray.metrics import INFO_LABELS, LABELS, METRIC_NAMES, ROUND_METRIC_GAUGES, RunMetrics
from rfedray.progress import Progress

RUN = dict(run_id="run-1", scheme="projavg", dataset="synthetic_pca", model="fedpca")


def make(**overrides) -> RunMetrics:
    kwargs = dict(RUN, epsilon_target=2.0, delta=1e-5, sigma=0.8, seeded=False)
    kwargs.update(overrides)
    return RunMetrics(**kwargs)


def scrape(port: int) -> dict[str, list]:
    """``/metrics`` of the endpoint on ``port``: sample name -> [(labels, value)]."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def one(samples: dict, name: str, **labels) -> float:
    matching = [v for lab, v in samples[name] if all(lab.get(k) == v2 for k, v2 in labels.items())]
    assert len(matching) == 1, (name, labels, samples.get(name))
    return matching[0]


ROUNDS = [
    dict(round=0, epsilon_spent=0.5, cohort_size=5, answered=5, round_seconds=0.2, aggregation_seconds=0.001,
         local_train_seconds=[0.05, 0.07, 0.09, 0.11, 0.13], metrics={"loss": -3.5, "gap": 0.4, "distance": 0.3}),
    dict(round=1, epsilon_spent=0.9, cohort_size=5, answered=4, round_seconds=3.0, aggregation_seconds=0.004,
         local_train_seconds=[0.2, 0.3, 0.6, 2.0], metrics={"loss": -3.8, "gap": 0.1, "distance": 0.2}),
    dict(round=2, epsilon_spent=1.2, cohort_size=5, answered=5, round_seconds=0.7, aggregation_seconds=0.0003,
         local_train_seconds=[0.1] * 5, metrics={"loss": -3.9, "gap": 0.05, "accuracy": 0.75}),
]


def feed(metrics: RunMetrics, rounds=ROUNDS) -> None:
    for kwargs in rounds:
        metrics.observe_round(**kwargs)


def test_endpoint_serves_what_was_observed():
    with make() as metrics:
        port = metrics.start_server(0)
        assert port > 0 and metrics.port == port
        feed(metrics)
        metrics.client_failure()
        metrics.client_failure(2)
        metrics.submission_rejected()
        samples = scrape(port)

    assert one(samples, "rfedray_current_round") == 3
    assert one(samples, "rfedray_epsilon_spent") == 1.2
    assert one(samples, "rfedray_epsilon_target") == 2.0
    assert one(samples, "rfedray_delta") == 1e-5
    assert one(samples, "rfedray_noise_sigma") == 0.8
    assert one(samples, "rfedray_cohort_size") == 5
    assert one(samples, "rfedray_clients_answered") == 5
    assert one(samples, "rfedray_rounds_completed_total") == 3
    assert one(samples, "rfedray_clients_selected_total") == 15
    assert one(samples, "rfedray_client_failures_total") == 3
    assert one(samples, "rfedray_submissions_rejected_total") == 1
    assert one(samples, "rfedray_halted") == 0
    assert one(samples, "rfedray_not_for_production") == 0
    # Gauges hold the last value reported for each key (accuracy only came in the last round).
    assert one(samples, "rfedray_training_loss") == -3.9
    assert one(samples, "rfedray_optimality_gap") == 0.05
    assert one(samples, "rfedray_distance_to_optimum") == 0.2
    assert one(samples, "rfedray_test_accuracy") == 0.75
    assert abs(one(samples, "rfedray_last_round_completed_timestamp_seconds") - time.time()) < 60

    assert one(samples, "rfedray_round_duration_seconds_count") == 3
    assert math.isclose(one(samples, "rfedray_round_duration_seconds_sum"), 3.9)
    assert one(samples, "rfedray_round_duration_seconds_bucket", le="1.0") == 2
    assert one(samples, "rfedray_round_duration_seconds_bucket", le="+Inf") == 3
    local = [s for r in ROUNDS for s in r["local_train_seconds"]]
    assert one(samples, "rfedray_local_train_duration_seconds_count") == len(local)
    assert math.isclose(one(samples, "rfedray_local_train_duration_seconds_sum"), sum(local))
    assert one(samples, "rfedray_local_train_duration_seconds_bucket", le="0.1") == sum(s <= 0.1 for s in local)
    assert one(samples, "rfedray_aggregation_duration_seconds_count") == 3


def test_halted_and_seeded_flags():
    metrics = make(seeded=True)
    metrics.set_halted(True)
    text = {f.name: f for f in text_string_to_metric_families(_exposition(metrics))}
    assert text["rfedray_not_for_production"].samples[0].value == 1
    assert text["rfedray_halted"].samples[0].value == 1
    metrics.set_halted(False)
    assert "rfedray_halted" in _exposition(metrics) and _value(metrics, "rfedray_halted") == 0


def _exposition(metrics: RunMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


def _value(metrics: RunMetrics, name: str):
    return metrics.registry.get_sample_value(name, metrics.labels)


def test_metric_names_are_exactly_the_exposed_ones():
    metrics = make()
    feed(metrics)
    metrics.observe_round(**dict(ROUNDS[-1], round=len(ROUNDS),
                                 metrics={"oracle_loss": -3.9, "oracle_gap": 0.05, "oracle_distance": 0.1}))
    metrics.client_failure()
    metrics.submission_rejected()
    metrics.set_halted(True)
    metrics.set_client_actors(ACTORS)
    exposed = {s.name for f in text_string_to_metric_families(_exposition(metrics)) for s in f.samples}
    assert exposed == set(METRIC_NAMES)
    assert all(name.startswith("rfedray_") for name in METRIC_NAMES)
    assert set(ROUND_METRIC_GAUGES.values()) <= METRIC_NAMES


def test_no_client_label_and_label_values_do_not_depend_on_data():
    a, b = make(), make()
    feed(a)
    feed(b, [dict(r, epsilon_spent=r["epsilon_spent"] / 3, answered=2, local_train_seconds=[9.0, 0.001],
                  metrics={k: v * 7 for k, v in r["metrics"].items()}) for r in ROUNDS])
    b.client_failure(5)
    a.client_failure(1)
    a.set_client_actors(ACTORS)
    b.set_client_actors(ACTORS)

    def series(metrics):
        return {(s.name, tuple(sorted(s.labels.items())))
                for f in text_string_to_metric_families(_exposition(metrics)) for s in f.samples}

    assert series(a) == series(b)
    for name, labels in series(a):
        names = dict(labels)
        assert not any(key.lower().startswith("client") for key in names), (name, names)
        assert set(names) - {"le"} == set(LABELS) | set(INFO_LABELS.get(name, ())), (name, names)
        assert {k: names[k] for k in LABELS} == RUN


ACTORS = [{"node_id": "a" * 56, "device": "cuda:0", "gpu_ids": ["0"]},
          {"node_id": "b" * 56, "device": "cuda:0", "gpu_ids": ["0"]},
          {"node_id": "b" * 56, "device": "cpu", "gpu_ids": []}]


def info_series(metrics: RunMetrics, name: str) -> list[dict]:
    """The extra labels of every series of an info gauge (their values are all 1)."""
    samples = [s for f in metrics.registry.collect() for s in f.samples if s.name == name]
    assert all(sample.value == 1 for sample in samples)
    return [{k: v for k, v in sample.labels.items() if k not in LABELS} for sample in samples]


def test_run_info_has_one_series_for_the_runs_state():
    metrics = make(version="0.1.0", config_digest="0123456789abcdef")
    assert info_series(metrics, "rfedray_run_info") == [
        {"version": "0.1.0", "config_digest": "0123456789abcdef", "state": "running"}]
    for state in ("halted", "finished", "failed"):
        metrics.set_state(state)
        assert [s["state"] for s in info_series(metrics, "rfedray_run_info")] == [state]
    with pytest.raises(ValueError, match="state='done': must be one of running, finished, halted, failed"):
        metrics.set_state("done")


def test_client_actor_devices_one_series_each():
    metrics = make()
    metrics.set_client_actors(ACTORS)
    assert info_series(metrics, "rfedray_client_actor_device") == [
        {"actor": "0", "node_id": "a" * 56, "device": "cuda:0", "gpu_ids": "0"},
        {"actor": "1", "node_id": "b" * 56, "device": "cuda:0", "gpu_ids": "0"},
        {"actor": "2", "node_id": "b" * 56, "device": "cpu", "gpu_ids": ""},
    ]
    metrics.set_client_actors(ACTORS[:1])  # a new placement replaces the old one
    assert len(info_series(metrics, "rfedray_client_actor_device")) == 1


def test_optional_values_are_absent_not_zero():
    metrics = make(epsilon_target=None, sigma=None)
    for name in ("rfedray_epsilon_target", "rfedray_noise_sigma", "rfedray_current_round", "rfedray_epsilon_spent",
                 "rfedray_training_loss", "rfedray_last_round_completed_timestamp_seconds"):
        assert _value(metrics, name) is None, name
    assert _value(metrics, "rfedray_rounds_completed_total") == 0
    assert _value(metrics, "rfedray_delta") == 1e-5
    metrics.observe_round(**dict(ROUNDS[0], metrics={"loss": 1.0, "f1": 0.3}))
    assert _value(metrics, "rfedray_training_loss") == 1.0
    assert "f1" not in _exposition(metrics)


def test_two_runs_in_one_process_do_not_clash():
    a = make(run_id="a")
    b = make(run_id="b")
    a.observe_round(**ROUNDS[0])
    assert _value(a, "rfedray_rounds_completed_total") == 1
    assert _value(b, "rfedray_rounds_completed_total") == 0
    pa, pb = a.start_server(0), b.start_server(0)
    try:
        assert pa != pb
        assert one(scrape(pa), "rfedray_rounds_completed_total", run_id="a") == 1
        assert one(scrape(pb), "rfedray_rounds_completed_total", run_id="b") == 0
    finally:
        a.close()
        b.close()


def test_port_in_use_is_a_clear_error():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        metrics = make()
        with pytest.raises(ConfigError, match="monitoring.metrics_port") as info:
            metrics.start_server(port)
        assert str(port) in str(info.value) and "in use" in str(info.value)
        assert metrics.port is None


def test_close_frees_the_port_and_is_idempotent():
    metrics = make()
    port = metrics.start_server(0)
    with pytest.raises(ValueError, match="already listens"):
        metrics.start_server(0)
    metrics.close()
    metrics.close()
    assert metrics.port is None
    again = make()
    assert again.start_server(port) == port
    again.close()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(delta=0.0), "delta"),
        (dict(delta=1.0), "delta"),
        (dict(epsilon_target=-1.0), "epsilon_target"),
        (dict(epsilon_target=math.inf), "epsilon_target"),
        (dict(sigma=0.0), "sigma"),
        (dict(run_id=""), "run_id"),
        (dict(model=None), "model"),
        (dict(seeded="yes"), "seeded"),
    ],
)
def test_constructor_rejects_out_of_range(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make(**kwargs)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(round=-1), "round"),
        (dict(epsilon_spent=-0.1), "epsilon_spent"),
        (dict(epsilon_spent=math.nan), "epsilon_spent"),
        (dict(answered=6), "answered"),
        (dict(cohort_size=-1), "cohort_size"),
        (dict(round_seconds=math.inf), "round_seconds"),
        (dict(aggregation_seconds=-1.0), "aggregation_seconds"),
        (dict(local_train_seconds=[0.1, -0.2]), r"local_train_seconds\[1\]"),
        (dict(metrics={"loss": "high"}), "loss"),
    ],
)
def test_observe_round_rejects_out_of_range(change, field):
    metrics = make()
    with pytest.raises(ValueError, match=field):
        metrics.observe_round(**dict(ROUNDS[0], **change))
    assert _value(metrics, "rfedray_rounds_completed_total") == 0


def test_other_arguments_are_checked():
    metrics = make()
    for call, field in ((lambda: metrics.client_failure(-1), "count"), (lambda: metrics.submission_rejected(1.5), "count"),
                        (lambda: metrics.set_halted(1), "halted"), (lambda: metrics.start_server(70000), "metrics_port"),
                        (lambda: metrics.start_server(0, host=""), "metrics_host")):
        with pytest.raises(ValueError, match=field):
            call()
    metrics.observe_round(**dict(ROUNDS[0], epsilon_spent=math.inf))
    assert _value(metrics, "rfedray_epsilon_spent") == math.inf


def test_prometheus_stores_what_was_observed(prometheus):  # noqa: F811  (the fixture)
    """A real Prometheus scrapes a RunMetrics fed by a fake loop of rounds; the next round comes once
    Prometheus has stored the current one (a fixed 1.6 s per round missed a round whenever a scrape
    came more than 0.6 s late on a loaded machine)."""
    metrics = make(run_id="scrape-test", seeded=True)
    port = metrics.start_server(0)
    try:
        server = prometheus(f"127.0.0.1:{port}", job="rfedray-test")
        server.wait_for_scrape()
        rounds = [dict(r, round=i) for i, r in enumerate(ROUNDS + [dict(ROUNDS[0], epsilon_spent=1.7)])]
        start = time.time()
        for kwargs in rounds:
            metrics.observe_round(**kwargs)
            if kwargs["round"] == 1:
                metrics.client_failure(1)
                metrics.submission_rejected(2)
            server.wait_until('rfedray_current_round{run_id="scrape-test"}', lambda v: v == kwargs["round"] + 1, timeout=60)
            server.wait_until('rfedray_epsilon_spent{run_id="scrape-test"}', lambda v: v == kwargs["epsilon_spent"], timeout=60)
        metrics.set_halted(True)
        done = time.time()
        server.wait_until("timestamp(rfedray_halted)", lambda t: t > done + 0.05)
        server.wait_until("rfedray_halted", lambda v: v == 1)

        def stored(name):
            return server.value(f'{name}{{run_id="scrape-test"}}')

        assert stored("rfedray_current_round") == 4
        assert stored("rfedray_epsilon_spent") == 1.7
        assert stored("rfedray_epsilon_target") == 2.0
        assert stored("rfedray_delta") == 1e-5
        assert stored("rfedray_noise_sigma") == 0.8
        assert stored("rfedray_not_for_production") == 1
        assert stored("rfedray_rounds_completed_total") == 4
        assert stored("rfedray_clients_selected_total") == 20
        assert stored("rfedray_client_failures_total") == 1
        assert stored("rfedray_submissions_rejected_total") == 2
        assert stored("rfedray_cohort_size") == 5
        assert stored("rfedray_clients_answered") == 5
        assert stored("rfedray_training_loss") == -3.5
        assert stored("rfedray_test_accuracy") == 0.75
        assert stored("rfedray_round_duration_seconds_count") == 4
        assert math.isclose(stored("rfedray_round_duration_seconds_sum"), sum(r["round_seconds"] for r in rounds))
        assert server.value('rfedray_round_duration_seconds_bucket{run_id="scrape-test",le="1.0"}') == 3
        local = [s for r in rounds for s in r["local_train_seconds"]]
        assert stored("rfedray_local_train_duration_seconds_count") == len(local)
        assert math.isclose(stored("rfedray_local_train_duration_seconds_sum"), sum(local))
        assert start - 1 < stored("rfedray_last_round_completed_timestamp_seconds") < done + 1

        # Every round's value was scraped, in order (consecutive duplicates are repeated scrapes).
        window = int(time.time() - start) + 5
        for name, observed in (("rfedray_current_round", [r["round"] + 1 for r in rounds]),
                               ("rfedray_epsilon_spent", [r["epsilon_spent"] for r in rounds])):
            (series,) = server.query(f'{name}{{run_id="scrape-test"}}[{window}s]')
            values = [float(v) for _, v in series["values"]]
            deduped = [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]
            assert deduped == [float(v) for v in observed], (name, values)

        (sample,) = server.query('rfedray_rounds_completed_total{run_id="scrape-test"}')
        assert {k: sample["metric"][k] for k in LABELS} == dict(RUN, run_id="scrape-test")
        assert sample["metric"]["job"] == "rfedray-test"
        assert not any(k.startswith("client") for k in sample["metric"])
    finally:
        metrics.close()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_in_place_on_a_terminal():
    stream = _Terminal()
    progress = Progress(3, stream=stream, epsilon_target=1.0)
    assert progress.live
    progress.update(0, 0.25, {"loss": -3.14159, "gap": 0.0123}, 2.0)
    progress.update(1, 0.5, {"loss": -3.2}, 2.0)
    progress.update(2, 0.75, {}, 2.0)
    progress.close("run finished")
    out = stream.getvalue()
    assert out.count("\r") == 3 and out.count("\n") == 2 and out.endswith("\nrun finished\n")
    first, second, third = out.split("\n")[0].split("\r")[1:]
    assert first.startswith("round 1/3") and "eps 0.25/1 (25%)" in first
    assert "loss -3.142" in first and "gap 0.0123" in first and "2 s/round" in first
    assert "ETA 0:00:04" in first and "ETA 0:00:02" in second
    assert third.startswith("round 3/3") and "ETA" not in third
    # A shorter line blanks what is left of the longer one it overwrites.
    assert len(third) >= len(second.rstrip())


def test_progress_writes_plain_lines_when_not_a_terminal_or_quiet():
    for stream, quiet in ((io.StringIO(), False), (_Terminal(), True)):
        progress = Progress(2, stream=stream, quiet=quiet)
        assert not progress.live
        progress.update(0, 0.4, {"accuracy": 0.5}, 1.0)
        progress.update(1, 0.8, {"accuracy": 0.625}, 3.0)
        progress.close()
        progress.close("ignored after close")
        lines = stream.getvalue().split("\n")
        assert "\r" not in stream.getvalue() and lines[-1] == ""
        assert lines[0] == "round 1/2 | eps 0.4 | accuracy 0.5 | 1 s/round | ETA 0:00:01"
        assert lines[1] == "round 2/2 | eps 0.8 | accuracy 0.625 | 3 s/round"


def test_progress_eta_uses_recent_round_times():
    progress = Progress(100, stream=io.StringIO())
    for i in range(30):
        progress.update(i, 0.0, {}, 100.0 if i < 20 else 1.0)
    assert progress.format_line(29, 0.0, {}, 1.0).endswith("ETA 0:01:10")


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: Progress(0), "total_rounds"),
        (lambda: Progress(5, epsilon_target=0.0), "epsilon_target"),
        (lambda: Progress(5, stream=io.StringIO()).update(-1, 0.1, {}, 1.0), "round"),
        (lambda: Progress(5, stream=io.StringIO()).update(5, 0.1, {}, 1.0), "round"),
        (lambda: Progress(5, stream=io.StringIO()).update(1, -1.0, {}, 1.0), "epsilon_spent"),
        (lambda: Progress(5, stream=io.StringIO()).update(1, 0.1, {}, -1.0), "round_seconds"),
        (lambda: Progress(5, stream=io.StringIO()).update(1, 0.1, {"loss": "x"}, 1.0), "loss"),
    ],
)
def test_progress_rejects_out_of_range(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_progress_refuses_updates_after_close():
    progress = Progress(2, stream=io.StringIO())
    progress.close()
    with pytest.raises(ValueError, match="closed"):
        progress.update(0, 0.1, {}, 1.0)


def test_non_private_runs_show_and_export_no_epsilon():
    stream = io.StringIO()
    progress = Progress(2, stream=stream, epsilon_target=None)
    progress.update(0, None, {"gap": 0.5}, 1.0)
    assert stream.getvalue() == "round 1/2 | non-private | gap 0.5 | 1 s/round | ETA 0:00:01\n"
    metrics = make(epsilon_target=None, sigma=None)
    metrics.observe_round(**dict(ROUNDS[0], epsilon_spent=None))
    assert _value(metrics, "rfedray_epsilon_spent") is None
    assert _value(metrics, "rfedray_current_round") == 1
