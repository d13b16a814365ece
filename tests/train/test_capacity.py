"""The arithmetic that sizes runs and Tune trials against the cluster."""

from train.capacity import runs_that_fit


def test_two_half_cpu_workers_fit_once_on_two_cpus():
    fit = runs_that_fit({"CPU": 2.0}, 2, {"CPU": 0.5}, data_cpus=1.0)
    assert fit.runs == 1
    assert fit.explain() == ("1 run(s) x (2 workers x 0.5 CPU) = 1 CPU needed; cluster has 2 CPU - 1 kept for "
                             "Ray Data ingest (scaling.data_cpus) = 1 CPU usable: fits")


def test_trial_driver_cpu_is_counted_and_too_many_trials_is_spelled_out():
    fit = runs_that_fit({"CPU": 2.0}, 2, {"CPU": 0.49}, data_cpus=1.0, per_run_cpus=0.01)
    assert fit.runs == 1
    text = fit.explain(3)
    assert text.startswith("3 run(s) x (2 workers x 0.49 CPU + 0.01 CPU trial driver) = 2.97 CPU needed")
    assert text.endswith("= 1 CPU usable: does not fit")


def test_gpus_limit_before_cpus():
    fit = runs_that_fit({"CPU": 64.0, "GPU": 8.0}, 4, {"CPU": 2.0, "GPU": 1.0}, data_cpus=8.0)
    assert (fit.resource, fit.runs) == ("GPU", 2)
    assert "4 workers x 1 GPU" in fit.explain()


def test_nothing_fits_when_a_worker_is_bigger_than_the_cluster():
    assert runs_that_fit({"CPU": 2.0}, 2, {"CPU": 2.0}, data_cpus=1.0).runs == 0
