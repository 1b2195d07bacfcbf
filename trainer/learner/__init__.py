"""The trainer's learner wing, on torch: the model, its gradients and their exchange.

`engine` holds the base model with its LoRA and takes a GRPO step (TRL's loss) or, with `sft`, a
supervised one; `logprobs` scores completion tokens under each call's sampling distribution;
`correction` is the off-policy mask and weights for stale or late-rewarded rows; `microbatch`
cuts a batch into pieces that fit; `distributed` and `ranks` spread a step over processes
(DDP/FSDP2); `shared_prompts` and `scoring` score many completions of one prompt at once. It
stands on the data wing (`trainer/data/`) and never on the loop above it.
"""
