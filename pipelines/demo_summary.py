"""What the demo produced (`DemoResult`) and its summary: the figures, where they live in MLflow, and the PromQL
behind them."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field

from core import registry
from stack import lifecycle as stack, mlflow_auth


@dataclass
class DemoResult:
    """What the demo produced: the facts of its summary, with the ids that join the stages."""

    dataset_version: str
    manifest_uri: str
    counts: dict[str, int]
    data_run_id: str
    tune_parent_run_id: str
    best_trial: str
    tune_model_version: str
    """`<name>/<version>` the search registered its best trial as."""
    best_params: dict[str, str]
    train_run_id: str
    model_name: str
    model_version: str
    """The production version (`model_name`) the promoter copied the candidate into; it serves."""
    exact_match: dict[str, float]
    """base, fine-tuned, post-trained (GRPO) and adapter: the metrics of the batch eval's run over each version's
    bytes (what the gate reads)."""
    rollout_s: float
    question: str
    expected: str
    """The question's right answer."""
    answer: str
    served_by: str
    adapter_model: str = ""
    """The adapter's production model (`<model_name>-lora`)."""
    adapter_version: str = ""
    adapter_route: str = ""
    candidate_version: str = ""
    """The version in `<model_name>-candidates` the promoter copied (the post-trained one when it beat the
    fine-tune, else the fine-tune)."""
    fine_tuned_version: str = ""
    """The fine-tune's version in `<model_name>-candidates` (what the train stage registered)."""
    post_trained_version: str = ""
    """The GRPO version in `<model_name>-candidates` (its parent: the fine-tune)."""
    grpo_run_id: str = ""
    reward: tuple[float, float] = (float("nan"), float("nan"))
    """GRPO's mean reward at its first and last update."""
    adapter_answer: str = ""
    adapter_served_by: str = ""
    """The response's `model` field: `rayline:<adapter>@<name>/<version>`."""
    total_s: float = 0.0
    started_at: float = 0.0
    """Unix time the demo started: the window its metrics lie in."""
    train_run_name: str = ""
    usage: dict[str, float] = field(default_factory=dict)
    """CPU-seconds by stage the serving version carries (`rayline.usage.<stage>_cpu_s`: core/usage.py)."""

    @property
    def promoted_stage(self) -> str:
        return "post-trained" if self.candidate_version == self.post_trained_version else "fine-tuned"


def figure_queries(r: DemoResult) -> dict[str, str]:
    """The PromQL behind the summary's figures (names as Prometheus sees them: core/metrics.py)."""
    return {
        "records read": f'sum(ray_rayline_data_records_read_total{{version="{r.dataset_version}"}})',
        "training tok/s": f'max(ray_rayline_train_tokens_per_second{{run="{r.train_run_id}"}})',
        "training loss": f'max(ray_rayline_train_loss{{run="{r.train_run_id}"}})',
        "GRPO reward": f'max(ray_rayline_grpo_reward_mean{{run="{r.grpo_run_id}"}})',
        "eval rows": 'sum by (run, model) (ray_rayline_batch_rows_done_total{mode="eval"})',
        "rollout time": f'sum by (outcome) (ray_rayline_rollout_duration_seconds_sum{{model="{r.model_name}"}})',
        "served version": f'sum by (model, version) (ray_rayline_served_version{{model="{r.model_name}"}})',
        "TTFT p50": "histogram_quantile(0.5, sum by (le) (rate(ray_vllm_time_to_first_token_seconds_bucket[1m])))",
    }


def right_or_wrong(answer: str, expected: str) -> str:
    return "right" if answer.strip() == expected else f"wrong: {expected}"


def print_summary(r: DemoResult, scfg: stack.StackConfig) -> None:
    em = r.exact_match
    candidates = f"{r.model_name}{mlflow_auth.CANDIDATES_SUFFIX}"
    rows = {
        "dataset version": r.dataset_version,
        "dataset counts": ", ".join(f"{k} {v}" for k, v in r.counts.items()),
        "best trial": f"{r.best_trial} {r.best_params}",
        "exact match": f"base {em['base']:.3f} -> fine-tuned {em['fine-tuned']:.3f} -> post-trained (GRPO) "
                       f"{em['post-trained']:.3f}; LoRA adapter {em['adapter']:.3f}",
        "GRPO reward": f"{r.reward[0]:.3f} -> {r.reward[1]:.3f} (mean per update; curve: the query below)",
        "model version": f"models:/{r.model_name}/{r.model_version} (@{registry.DEFAULT_ALIAS}; the {r.promoted_stage} "
                         f"{candidates}/{r.candidate_version})",
        "roles": f"MLflow logins in {mlflow_auth.credentials_dir(scfg.state)}/<role>/ (trainer, evaluator, promoter, "
                 "rollout, reader, admin); the OpenAI client key is $OPENAI_API_KEY (`python -m pipelines.stack env`)",
        "rollout time": f"{r.rollout_s:.0f}s (alias set -> new version serving)",
        "chat": f"{r.question!r} -> {r.answer!r} ({right_or_wrong(r.answer, r.expected)}; served by {r.served_by})",
        "adapter": f"models:/{r.adapter_model}/{r.adapter_version} (@{registry.DEFAULT_ALIAS}), served as "
                   f"{r.adapter_served_by.split('@')[0]} at {r.adapter_route}/v1",
        "adapter chat": f"{r.question!r} -> {r.adapter_answer!r} ({right_or_wrong(r.adapter_answer, r.expected)}; "
                        f"{r.adapter_served_by})",
        "left running": "Serve apps rayline and the adapter's (0.5 CPU each); the batch configs' CPU defaults fit "
                        "beside them (engine 0.75 + tasks 0.25); train, tune and post-training are sized for the whole "
                        "stack: delete the apps first (docs/OPERATIONS.md, \"A job that waits\"); a job that waits "
                        "says why",
        "version cost": ", ".join(f"{k} {v:.1f}" for k, v in r.usage.items())
                        + f": {sum(r.usage.values()):.0f} CPU-seconds (rayline.usage.* tags on the version)",
        "total time": f"{r.total_s:.0f}s",
        "lineage (MLflow UI)": f"{registry.tracking_uri()}/#/models/{r.model_name}/versions/{r.model_version}",
    }
    print("\n== rayline demo summary ==")
    for k, v in {**rows, **stack.urls(scfg)}.items():
        print(f"  {k:18} {v}")
    print(f"\nLineage: MLflow UI -> Models -> {r.model_name} -> Version {r.model_version}: its tags name the dataset\n"
          f"version and manifest, the training run (source run), its parent version and the rollout record "
          f"(rollout.status, deployed_at).\n"
          f"Promote another version (logged in as the promoter): MLflow UI -> Models -> {candidates} -> a version -> "
          f"Promote model -> {r.model_name}, then on the copy Aliases -> add `{registry.DEFAULT_ALIAS}`;\n"
          f"then `python -m pipelines.rollout --config configs/rollout/tiny.yaml` rolls it out once, or add `--watch` "
          f"to follow the alias (polling, or MLflow webhooks with webhook_port set).")
    if "RAYLINE_PROMETHEUS_URL" in stack.env_vars(scfg):
        url = stack.env_vars(scfg)["RAYLINE_PROMETHEUS_URL"]
        print(f"\nMetrics (Prometheus at {url}; dashboards in observability/grafana/): the figures above as queries")
        for figure, expr in figure_queries(r).items():
            print(f"  {figure:18} {expr}\n  {'':18} {url}/graph?g0.expr={urllib.parse.quote(expr)}&g0.range_input=1h")
