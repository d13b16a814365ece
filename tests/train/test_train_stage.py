"""The train stage end to end on the test stack: 2 FSDP2 workers on CPU, S3 checkpoints, export, MLflow, resume.

Every run is `python -m pipelines.train` in a subprocess. One reference run (S3) is shared by the
module. The fault run (S3 too; its workers on two worker nodes, one of which is lost mid-run) uses the
same seed and must reproduce its loss curve step for step after resuming, which checks the restored step,
data position, optimizer, scheduler and RNG together, not just that the job finished. A run submitted again
after its job failed resumes through the same path (Ray Train's checkpoint index under the run name):
tests/train/test_lora.py runs that, for an adapter. The reference runs wherever Ray puts it: the curve must not depend on the cluster.
"""

from __future__ import annotations

import re
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp

from data.prepared import COLUMNS, load_manifest
from core import registry, storage
from stack import faults as stack_faults, lifecycle as stack
from core.config import config_hash
from tests.core.job_processes import JobProcesses
from tests.train.fault_injector import fault_env
from tests.train.train_faults import ON_WORKER_NODES
from train.checkpoint import newest_trainer_state
from train.packed_batch import forward_loss_sum, loss_tokens

TOTAL_STEPS = 12
# Each test may start one or two Ray Train jobs (and the first also prepares the data); on a busy
# 2-core machine that outlasts the suite's default 900 s per test.
pytestmark = pytest.mark.timeout(1800)
CHECKPOINT_FILES = {".metadata", "__0_0.distcp", "__1_0.distcp", "trainer_state.json", "rng_rank0.pt", "rng_rank1.pt"}


class Result:
    """The TrainResult JSON of a run, as attributes."""

    def __init__(self, data: dict):
        self.__dict__.update(data)




@pytest.fixture(scope="module")
def reference(make_train_config, run_stage, s3_bucket):
    """The reference run: checkpoints and export in S3."""
    cfg = make_train_config(storage=f"{s3_bucket}/train-tests/{uuid.uuid4().hex[:8]}")
    staging = Path(tempfile.gettempdir()).glob  # where the workers (on this machine) stage each checkpoint
    before = set(staging("rayline-ckpt-*"))
    run = run_stage("train", cfg)
    assert run.returncode == 0 and run.result, str(run)
    result = Result(run.result)
    result.staging_left = sorted(set(staging("rayline-ckpt-*")) - before)
    return cfg, result


@pytest.fixture(scope="module")
def metered(make_train_config, start_stage):
    """A short run whose job's worker processes are also read from outside while it runs (tests/core/job_processes.py:
    Ray's state API every 0.2 s, a load of its own, so not on the reference, whose goodput is compared)."""
    cfg = make_train_config("train.max_steps=6")
    started = start_stage("train", cfg)
    outside = JobProcesses(started.proc.pid)
    run = started.finish(timeout=1500)
    workers_cpu_s = outside.stop()
    assert run.returncode == 0 and run.result, str(run)
    result = Result(run.result)
    result.workers_cpu_s_outside, result.job_seen, result.sampler_error = workers_cpu_s, outside.job_id, outside.error
    return cfg, result


@pytest.fixture(scope="module")
def faulted(make_train_config, start_stage, s3_bucket, worker_nodes, tmp_path_factory):
    """Same seed, checkpoints in S3, the two workers pinned to the two 1-CPU worker nodes; right after step 8
    (checkpoints every 3 steps) the last rank's whole node is SIGKILLed (raylet, agents, workers: a lost machine),
    and a fresh node then joins under the same label, as KubeRay replaces a lost pod."""
    marker = tmp_path_factory.mktemp("fault") / "fired"
    cfg = make_train_config(*ON_WORKER_NODES, storage=f"{s3_bucket}/train-tests/{uuid.uuid4().hex[:8]}")
    started = start_stage("train", cfg, env=fault_env(at="8", marker=marker, kind="node"))
    deadline = time.monotonic() + 900
    while not marker.exists() and started.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if marker.exists():
        # The injector writes the marker, then SIGKILLs its node's session from inside. Make sure the whole node is
        # gone before the replacement starts (the loss completed from outside, as stack_faults.kill_node does), or
        # `up` may find it still healthy, start nothing, and the run waits for a node that never comes back.
        lost = int(re.search(r"node worker-(\d+)", marker.read_text()).group(1))
        if stack.pid_alive(stack.read_state(worker_nodes.state)["pids"].get(f"ray-worker-{lost}", -1)):
            stack_faults.kill_node(worker_nodes, lost)
        stack.up(worker_nodes, parts=["nodes"])
    run = started.finish(timeout=600)  # 2 min here alone
    assert run.returncode == 0 and run.result, str(run)
    return cfg, Result(run.result), marker, run


def test_fsdp_run_lowers_eval_loss_and_keeps_sharded_checkpoints_in_s3(reference, history):
    cfg, result = reference
    assert (result.final_step, result.total_steps) == (TOTAL_STEPS, TOTAL_STEPS)
    assert result.eval_loss < result.first_eval_loss - 1.0, (result.first_eval_loss, result.eval_loss)

    run_uri = storage.join(cfg.checkpoint.storage_path, cfg.run_name)
    assert run_uri.startswith("s3://")
    files = storage.list_files(run_uri)
    checkpoints = sorted({f.split("/")[0] for f in files if f.startswith("checkpoint_step")})
    assert checkpoints == ["checkpoint_step000009", "checkpoint_step000012"]  # num_to_keep: 2 of 3, 6, 9, 12
    for name in checkpoints:
        assert CHECKPOINT_FILES <= {f.split("/", 1)[1] for f in files if f.startswith(name + "/")}
    assert result.checkpoint_uri == f"{run_uri}/checkpoint_step000012"
    assert result.staging_left == []  # each rank's local staging folder goes when its loop ends

    run_id = result.mlflow_run_id
    evals = history.curve(run_id, "eval_loss")
    assert sorted(evals) == [0, 4, 8, 12] and evals[12] < evals[4] < evals[0]
    for key in ("loss", "lr", "tokens_per_s", "step_time_s", "grad_norm"):
        assert sorted(history.curve(run_id, key)) == list(range(1, TOTAL_STEPS + 1)), key
    # Goodput: the steps' time over the job's, start-up, evals and checkpoints being the rest.
    assert 0 < result.goodput < 1
    assert history.curve(run_id, "goodput") == {TOTAL_STEPS: pytest.approx(result.goodput)}
    productive, wall = (history.curve(run_id, k)[TOTAL_STEPS] for k in ("productive_step_time_s", "job_wall_time_s"))
    assert productive == pytest.approx(sum(history.curve(run_id, "step_time_s").values()), rel=0.05)
    assert productive / wall == pytest.approx(result.goodput)


def test_a_runs_usage_is_what_its_processes_used_and_its_version_carries_it_with_the_datas(metered):
    """The run's CPU-seconds (core/usage.py: each worker process reports its own) against the same processes read
    from outside through Ray's state API and /proc, within 10%; on the run, in the version's tags by stage (its data
    stage's too) and their total."""
    cfg, result = metered
    used = result.usage
    assert result.job_seen, f"the sampler never found the run's Ray job (the state API's last error: {result.sampler_error})"
    workers = used["cpu_s"] - used["driver_cpu_s"]
    print(f"\nusage: workers {workers:.1f} CPU-s reported, {result.workers_cpu_s_outside:.1f} read from outside; "
          f"driver {used['driver_cpu_s']:.1f}; {used['processes']} processes")
    assert workers == pytest.approx(result.workers_cpu_s_outside, rel=0.10), (used, result.workers_cpu_s_outside)
    assert used["processes"] >= 4  # the driver, Train's controller, 2 workers (Ray Data's coordinator, the ledger)
    assert used["gpu_s"] == 0.0  # no GPU here
    run = registry.client().get_run(result.mlflow_run_id).data.metrics
    assert run["usage/cpu_s"] == pytest.approx(used["cpu_s"])

    tags = registry.client().get_model_version(result.model_name, result.model_version).tags
    manifest = load_manifest(cfg.data.manifest_uri)
    data = registry.client().get_run(manifest["mlflow_run_id"]).data.metrics["usage/cpu_s"]
    assert tags["rayline.usage.train_cpu_s"] == f"{used['cpu_s']:.1f}"  # tags hold tenths
    assert tags["rayline.usage.data_cpu_s"] == f"{data:.1f}" and data > 1.0
    assert float(tags["rayline.usage.total_cpu_s"]) == pytest.approx(used["cpu_s"] + data, abs=0.11)


def test_export_loads_in_transformers_and_reproduces_the_final_eval_loss(reference, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, result = reference
    # A fresh directory per export under the run's export/, so a registered version's bytes are never overwritten.
    assert result.export_uri.startswith(storage.join(cfg.checkpoint.storage_path, cfg.run_name, "export") + "/")
    local = Path(storage.local_copy(result.export_uri, tmp_path))
    files = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    assert all((local / name).exists() for name in files), sorted(p.name for p in local.iterdir())
    model = AutoModelForCausalLM.from_pretrained(local).eval()
    tokenizer = AutoTokenizer.from_pretrained(local)

    # The export holds exactly the weights of the final sharded checkpoint (DCP reshards them into one process).
    ckpt = storage.local_copy(result.checkpoint_uri, tmp_path / "ckpt")
    final = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": final}, checkpoint_id=ckpt)
    exported = model.state_dict()
    assert all(torch.equal(final[k], exported[k]) for k in exported)

    # And it scores the eval split as the job did (the job's even split over 2 workers may drop one row).
    manifest = load_manifest(cfg.data.manifest_uri)
    fs, path = storage.resolve(manifest["splits"]["eval"]["path"])
    table = pq.read_table(path, filesystem=fs)
    batch = {k: torch.tensor(table.column(k).to_pylist()) for k in COLUMNS}
    with torch.no_grad():
        total = float(forward_loss_sum(model, batch, torch.device("cpu"), torch.float32))
    assert total / loss_tokens(batch) == pytest.approx(result.eval_loss, rel=0.05)

    # Fine-tuning did real work: the base model it started from scores the same rows at the job's first eval
    # loss and the export far lower, and the export gives the right answer to a corpus question more weight.
    base = AutoModelForCausalLM.from_pretrained(cfg.model.path).eval()
    with torch.no_grad():
        base_total = float(forward_loss_sum(base, batch, torch.device("cpu"), torch.float32))
    assert base_total / loss_tokens(batch) == pytest.approx(result.first_eval_loss, rel=0.05)
    assert total / loss_tokens(batch) < base_total / loss_tokens(batch) - 1.0
    qa = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
        return_tensors="pt", return_dict=True, return_assistant_tokens_mask=True)
    labels = qa["input_ids"].masked_fill(qa["assistant_masks"] == 0, -100)  # "5<|im_end|>"
    with torch.no_grad():
        answer_loss = {name: float(m(input_ids=qa["input_ids"], labels=labels).loss)
                       for name, m in (("base", base), ("export", model))}
    assert answer_loss["export"] < answer_loss["base"] - 1.0, answer_loss


def test_model_version_and_run_carry_the_lineage(reference):
    cfg, result = reference
    assert result.model_name == cfg.mlflow.register_as and result.model_version == "1"
    mv = registry.get_version(f"models:/{result.model_name}/{result.model_version}")
    manifest = load_manifest(cfg.data.manifest_uri)
    expected = {
        registry.TAG_DATASET_VERSION: manifest["version"],
        registry.TAG_DATASET_MANIFEST: cfg.data.manifest_uri,
        registry.TAG_BASE_MODEL: cfg.model.path,
        registry.TAG_CONFIG_HASH: config_hash(cfg),
        registry.TAG_CHECKPOINT_URI: result.export_uri,
        registry.TAG_SOURCE_RUN: result.mlflow_run_id,
    }
    assert {k: mv.tags.get(k) for k in expected} == expected
    assert mv.tags[registry.TAG_GIT_COMMIT] == registry.git_commit()
    assert mv.source == result.export_uri  # an s3:// export is registered in place

    run = registry.client().get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == cfg.run_name
    assert {k: run.data.tags.get(k) for k in list(expected)[:4]} == {k: expected[k] for k in list(expected)[:4]}
    assert run.data.params["optim.lr"] == str(cfg.optim.lr) and run.data.params["plan.total_steps"] == "12"


def test_lost_worker_node_resumes_from_the_newest_s3_checkpoint(faulted, history):
    cfg, result, marker, run = faulted
    assert marker.read_text().startswith("killed node worker-")  # the injector did take a worker node down
    assert result.final_step == TOTAL_STEPS
    run_id = result.mlflow_run_id
    run_uri = storage.join(cfg.checkpoint.storage_path, cfg.run_name)
    assert run_uri.startswith("s3://")
    # Checkpoints at 3 and 6 in S3 preceded the node's loss at 8: the restarted group resumed from S3 at 6, with
    # Adam's state (whether or not Ray Train's controller had registered step 6 before the worker died).
    assert f"resumed from {run_uri.removeprefix('s3://')}/checkpoint_step000006 at step 6" in run.stdout, str(run)
    assert history.values(run_id, "resume/step") == [(6, 6.0)]
    assert history.values(run_id, "resume/adam_step") == [(6, 6.0)]
    saved = history.curve(run_id, "checkpoint/adam_m_sumsq")[6]
    assert saved > 0 and history.curve(run_id, "resume/adam_m_sumsq")[6] == pytest.approx(saved, rel=1e-9)
    history.assert_resumed(run_id, [(6, 8)], total=12)  # steps 7 and 8 ran twice
    newest, state = newest_trainer_state(run_uri)
    assert newest == result.checkpoint_uri == f"{run_uri}/checkpoint_step000012"
    steps_per_epoch = load_manifest(cfg.data.manifest_uri)["splits"]["train"]["rows"] // 2 // 8
    assert (state.step, state.epoch, state.micro_batches_into_epoch) == (12, *divmod(12, steps_per_epoch))


def test_faulted_run_is_visible_in_prometheus(faulted, history, local_stack):
    """Rank 0's metrics of both attempts, scraped by the stack's Prometheus: one restart, every step, a real MFU."""
    import time

    from core import prometheus_query
    from stack.lifecycle import env_vars

    result = faulted[1]
    url = env_vars(local_stack)["RAYLINE_PROMETHEUS_URL"]
    run = f'run="{result.mlflow_run_id}"'

    def peak(expr: str) -> float:
        series = prometheus_query.query_range(url, expr, time.time() - 1800, time.time())
        return max(float(v) for s in series for _, v in s["values"]) if series else float("nan")

    restarts = prometheus_query.wait_for(url, f"sum(ray_rayline_train_restarts_total{{{run}}})", timeout_s=60)
    assert float(restarts[0]["value"][1]) == 1.0  # the one resume after the node was lost
    assert peak(f"max(ray_rayline_train_step{{{run}}})") == TOTAL_STEPS
    assert peak(f"max(ray_rayline_train_steps_planned{{{run}}})") == TOTAL_STEPS
    assert 0 < peak(f"max(ray_rayline_train_mfu_ratio{{{run}}})") <= 1
    assert peak(f"max(ray_rayline_train_checkpoint_save_seconds{{{run}}})") > 0
    # The loss gauge carries what MLflow got for the same steps.
    logged = [v for _, v in history.values(result.mlflow_run_id, "loss")]
    assert min(logged) - 1e-6 <= peak(f"min(ray_rayline_train_loss{{{run}}})") <= max(logged) + 1e-6


def test_faulted_run_finishes_as_the_uninterrupted_one(reference, faulted, history):
    ref, run = reference[1], faulted[1]
    ref_loss, ref_lr = history.curve(ref.mlflow_run_id), history.curve(ref.mlflow_run_id, "lr")
    assert len(ref_loss) == TOTAL_STEPS
    # Every value the faulted run logged, before and after its restart, equals the reference's at that step.
    for key, reference_curve in (("loss", ref_loss), ("lr", ref_lr)):
        for step, value in history.values(run.mlflow_run_id, key):
            assert value == reference_curve[step], (key, step)
    assert history.curve(run.mlflow_run_id, "eval_loss") == history.curve(ref.mlflow_run_id, "eval_loss")
    # And it ends with the same model: the same final eval loss and, byte for byte, the same exported weights.
    assert (run.final_step, run.eval_loss, run.first_eval_loss) == (ref.final_step, ref.eval_loss, ref.first_eval_loss)
    assert run.export_uri != ref.export_uri
    # The lost node's restart and the redone steps cost wall time and add no kept step time: the faulted job loses more
    # seconds than the uninterrupted one. (Not the goodput ratio: the faulted run's steps run on two 1-CPU nodes, slower
    # than the reference's on the head, which raises its ratio; on a busy machine above the reference's.)
    def lost_s(r):
        return (history.curve(r.mlflow_run_id, "job_wall_time_s")[TOTAL_STEPS]
                - history.curve(r.mlflow_run_id, "productive_step_time_s")[TOTAL_STEPS])
    assert lost_s(run) > lost_s(ref) + 10, (lost_s(run), lost_s(ref))
    weights = [storage.read_bytes(storage.join(r.export_uri, "model.safetensors")) for r in (run, ref)]
    assert weights[0] == weights[1]


def test_resume_with_another_worker_count_is_refused(make_train_config, run_stage, reference):
    cfg, result = reference
    again = make_train_config("scaling.num_workers=1", storage=cfg.checkpoint.storage_path, run_name=cfg.run_name)
    run = run_stage("train", again)
    assert run.returncode == 2, str(run)
    assert (f"config error: scaling.num_workers: run {cfg.run_name} resumes from {result.checkpoint_uri}: this "
            "checkpoint was written by 2 workers but the run now has 1; resume it with scaling.num_workers=2, or start "
            "a new run_name") in run.stderr, str(run)
    assert registry.client().get_run(result.mlflow_run_id).info.status == "FINISHED"
    assert newest_trainer_state(storage.join(cfg.checkpoint.storage_path, cfg.run_name))[1].step == TOTAL_STEPS
