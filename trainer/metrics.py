"""Prometheus metrics of the trainer (served on `metrics_port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

steps = Counter("flywheel_trainer_steps_total", "Training steps published as a new version.")
step_failures = Counter(
    "flywheel_trainer_step_failures_total", "Steps that did not publish.", ["reason"]
)
trained = Counter("flywheel_trainer_transitions_trained_total", "Transitions trained on.")
skipped = Counter(
    "flywheel_trainer_transitions_skipped_total", "Transitions set aside.", ["reason"]
)
reward_mean = Gauge("flywheel_trainer_batch_reward_mean", "Mean return of the last batch.")
loss = Gauge("flywheel_trainer_loss", "Loss of the last step.")
clip_fraction = Gauge("flywheel_trainer_clip_fraction", "PPO clip fraction of the last step.")
is_ratio = Gauge(
    "flywheel_trainer_is_ratio", "Importance-sampling ratio of the last step.", ["stat"]
)
staleness = Gauge(
    "flywheel_trainer_staleness_versions", "Mean versions between sampling and training."
)
queue = Gauge("flywheel_trainer_queue_transitions", "Credited, untrained transitions waiting.")
current_version = Gauge("flywheel_trainer_current_version", "The version the alias serves.")
step_seconds = Histogram(
    "flywheel_trainer_step_seconds", "Time to train one batch.", buckets=(0.1, 0.5, 1, 5, 30, 120)
)
swap_seconds = Histogram(
    "flywheel_trainer_swap_seconds",
    "Time to load a new adapter into every vLLM.",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5),
)
