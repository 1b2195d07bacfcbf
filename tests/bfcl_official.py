"""BFCL's official verdicts, for tests/demo/test_bfcl_check.py to hold our checker against: run as a
process of its own (`python tests/bfcl_official.py < answers.jsonl`), it decodes and checks each
answer with bfcl_eval's own code, exactly as its eval runner does for a prompting model
(`_evaluate_single_ast_entry`: `default_decode_ast_prompting`, `is_function_calling_format_output`,
`ast_checker`), and prints one JSON verdict a line.

bfcl_eval is installed without its dependencies (packages-nodeps.txt). The parts of it the
Python AST check never reaches are stubs here, in this process only: the tree-sitter parsers of
Java and JavaScript answers, and the model table (`constants/model_config.py`, which imports every
provider's SDK) whose one use on this path says whether a model's function names had their dots
turned into underscores (not ours: the prompt asks for the names as given).

Each input line: {"functions": [...], "possible": [...], "category": "...", "text": "..."}, or
{"prompt": {a BFCL test entry}} for the messages BFCL sends a prompting model for that entry
(`system_prompt_pre_processing_chat_model`, as its OSS handler does before the chat template).
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from typing import Any

MODEL = "flywheel-bfcl-prompting"


@dataclass(frozen=True)
class _ModelConfig:
    underscore_to_dot: bool = False


def _stub(name: str, **attributes: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module


class _Unused:
    """Built and configured at import by the Java/JS parsers; never called on this path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_language(self, *args: Any) -> None:
        pass


def _stubs() -> None:
    _stub("tree_sitter", Language=_Unused, Parser=_Unused)
    _stub("tree_sitter_java", language=lambda: None)
    _stub("tree_sitter_javascript", language=lambda: None)
    _stub("bfcl_eval.constants.model_config", MODEL_CONFIG_MAPPING={MODEL: _ModelConfig()})


def verdict(item: dict[str, Any]) -> dict[str, Any]:
    from bfcl_eval.constants.enums import Language, ReturnFormat
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.model_handler.utils import default_decode_ast_prompting
    from bfcl_eval.utils import is_function_calling_format_output

    try:
        decoded = default_decode_ast_prompting(item["text"], ReturnFormat.PYTHON, False)
    except Exception:
        return {"valid": False, "parsable": False, "error_type": "ast_decoder:decoder_failed"}
    if not is_function_calling_format_output(decoded):
        return {
            "valid": False,
            "parsable": False,
            "error_type": "ast_decoder:decoder_wrong_output_format",
        }
    result = ast_checker(
        item["functions"], decoded, item["possible"], Language.PYTHON, item["category"], MODEL
    )
    return {
        "valid": result["valid"],
        "parsable": True,
        "error_type": "" if result["valid"] else result["error_type"],
    }


def messages(entry: dict[str, Any]) -> list[dict[str, Any]]:
    from bfcl_eval.model_handler.utils import system_prompt_pre_processing_chat_model

    return system_prompt_pre_processing_chat_model(
        entry["question"][0], entry["function"], entry["id"]
    )


def main() -> None:
    _stubs()
    for line in sys.stdin:
        if line.strip():
            item = json.loads(line)
            out = messages(item["prompt"]) if "prompt" in item else verdict(item)
            print(json.dumps(out), flush=False)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
