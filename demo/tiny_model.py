"""A tiny random Qwen2 model with its own tokenizer, for tests and the local demo.

No model hub is reachable here, so tests and `flywheel up` build their model locally: a byte-level
BPE tokenizer trained in about a second on a few hundred built-in strings, a ChatML chat template
that also renders tools (Qwen2 style, so vLLM accepts `tools` and its `hermes` parser applies), and
a 2-layer Qwen2 with random weights (head size 64, which vLLM's CPU attention supports).

Run: `.venv/bin/python -m demo.tiny_model [OUT_DIR]` (default `.cache/demo-model`).
"""

import fcntl
import functools
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

if TYPE_CHECKING:  # transformers takes seconds to import; the CLI imports this module
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added as ordinary (non-special) tokens, as in Qwen2: they must survive detokenisation so that
# vLLM's hermes tool parser sees them, and the parser looks them up in the vocabulary.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB_SIZE = 1024

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}\
{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools>:' }}
{{- '\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}\
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def training_corpus() -> list[str]:
    """A few hundred strings like those tests and the demo send: digits, arithmetic, chat, JSON."""
    texts = [f"What is {a} + {b}? {a + b}" for a in range(10) for b in range(10)]
    texts += [
        f"What is {a} * {b}? The answer is {a * b}." for a in range(10) for b in range(0, 10, 2)
    ]
    texts += [str(n) for n in range(200)]
    texts += [
        "Hello! How can I help you today?",
        "The quick brown fox jumps over the lazy dog.",
        "Please answer with a single number.",
        "You are a helpful assistant.",
        "Say hello in one short sentence.",
        "I think the answer is correct, thank you.",
        "Tell me a story about a small robot who learns to count.",
    ]
    for city in ["Paris", "London", "Tokyo", "Berlin", "Madrid"]:
        call = {"name": "get_weather", "arguments": {"city": city, "unit": "celsius"}}
        texts.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
        texts.append(json.dumps({"city": city, "temperature": len(city) * 3, "sky": "clear"}))
    texts.append(
        json.dumps(
            {
                "type": "function",
                "function": {
                    "name": "add",
                    "parameters": {
                        "type": "object",
                        "properties": {"a": {"type": "integer"}},
                        "required": ["a"],
                    },
                },
            }
        )
    )
    return texts


def is_complete(out_dir: Path) -> bool:
    names = ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"]
    return all((out_dir / name).is_file() for name in names)


def build_tokenizer(
    *, split_digits: bool = False, extra_corpus: tuple[str, ...] = ()
) -> "PreTrainedTokenizerFast":
    """Train the byte-level BPE and wrap it with special tokens and the chat template.

    `split_digits`: every digit its own token (as in Qwen2), so numbers are learnable.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(training_corpus() + list(extra_corpus), trainer=trainer)
    bpe.add_tokens(TOOL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def random_model(tokenizer: "PreTrainedTokenizerFast", *, seed: int) -> Any:
    """The tiny Qwen2 (head size 64, which vLLM's CPU attention supports), randomly initialised."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos_ids = [tokenizer.get_vocab()[t] for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    # Only eos and pad: vLLM then samples plainly (no top-k/top-p from the model's defaults).
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=eos_ids, pad_token_id=eos_ids[1]
    )
    return model


P = ParamSpec("P")
R = TypeVar("R")


def one_build_at_a_time(
    build: Callable[Concatenate[Path, P], R],
) -> Callable[Concatenate[Path, P], R]:
    """Run `build(out_dir, ...)` holding an exclusive lock on `out_dir`'s sibling `.lock` file, so
    that a second builder of the same model (another process: the tests' background build, or
    another thread) waits for the first and then finds the model built instead of building it
    over the first one's files. The builder's own is-it-built check runs under the lock."""

    def locked(out_dir: Path, /, *args: P.args, **kwargs: P.kwargs) -> R:
        out_dir = Path(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(out_dir.with_name(out_dir.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            return build(out_dir, *args, **kwargs)

    functools.update_wrapper(locked, build)
    return locked


def save_atomically(out_dir: Path, tokenizer: "PreTrainedTokenizerFast", model: Any) -> Path:
    """Build next to the target and rename at the end: an interrupted build never looks complete."""
    tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tokenizer.save_pretrained(tmp_dir)
    model.save_pretrained(tmp_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    return out_dir


@one_build_at_a_time
def build_demo_model(out_dir: Path, *, seed: int = 0) -> Path:
    """Write tokenizer, config, random weights and generation config to `out_dir` (idempotent)."""
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        return out_dir
    tokenizer = build_tokenizer()
    return save_atomically(out_dir, tokenizer, random_model(tokenizer, seed=seed))


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/demo-model")
    print(build_demo_model(target))
