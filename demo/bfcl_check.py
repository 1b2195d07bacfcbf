"""BFCL's AST check, our own code: a model's text decoded into Python calls and each compared with
the possible answers, with the verdicts of `bfcl_eval`'s official checker (`eval_checker/ast_eval/
ast_checker.py` and the prompting models' decoder, `default_decode_ast_prompting`). The two agree
on every answer of the cross-check (tests/demo/test_bfcl_check.py runs the official code beside
this).

    verdict = score(text, question, answer, category="simple_python")
    verdict.valid, verdict.parsable, verdict.error_type, verdict.partial

One deliberate difference: where the official decoder runs a binary operation in the answer as
Python (`eval`), this one computes literal arithmetic only (`x=2*3`, `s="a"+"b"`) and refuses the
rest as undecodable, so no model text is ever executed; sizes are bounded (`9**9**9` is refused,
not computed for hours).

`partial`, beside BFCL's binary verdict: 0 undecodable, 0.25 decoded into calls, 0.5 the right
function, 0.75 the right parameter names too (every required one, none unexpected), 1 valid.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Calls = list[dict[str, dict[Any, Any]]]

# BFCL's Python types of a parameter's declared type ("any" is checked as a string).
PYTHON_TYPES: dict[str, type] = {
    "string": str,
    "integer": int,
    "float": float,
    "boolean": bool,
    "array": list,
    "tuple": list,
    "dict": dict,
    "any": str,
}
NESTED = ("array", "tuple")  # the declared types whose items are checked (one level)
MAX_LITERAL = 100_000  # the longest string/list a literal operation may make, the biggest power


class NotDecodable(ValueError):
    """The text is not a list of Python calls BFCL can read."""


@dataclass(frozen=True)
class Verdict:
    valid: bool
    parsable: bool
    error_type: str  # BFCL's own error_type ("" when valid)
    partial: float  # 0, 0.25, 0.5, 0.75, 1 (see the module's docstring)


# --- decoding (BFCL's `default_decode_ast_prompting` + `ast_parse`, Python) -------------------


def decode(text: str) -> Calls:
    """The calls in a model's answer, as BFCL reads them: `[f(a=1), g.h(b="x")]` (brackets
    optional) -> `[{"f": {"a": 1}}, {"g.h": {"b": "x"}}]`. Positional arguments are dropped,
    as BFCL drops them. Raises NotDecodable."""
    text = text.strip("`\n ")
    if not text.startswith("["):
        text = "[" + text
    if not text.endswith("]"):
        text = text + "]"
    try:
        body = ast.parse(text.strip().strip("'"), mode="eval").body
        if isinstance(body, ast.Call):
            return [_call(body)]
        if not isinstance(body, ast.List | ast.Tuple | ast.Set):
            raise NotDecodable(f"not a list of calls: {type(body).__name__}")
        calls = []
        for element in body.elts:
            if not isinstance(element, ast.Call):
                raise NotDecodable(f"not a call: {ast.unparse(element)[:80]}")
            calls.append(_call(element))
        return calls
    except NotDecodable:
        raise
    except (
        SyntaxError,
        ValueError,
        TypeError,
        AttributeError,
        ArithmeticError,
        RecursionError,
        MemoryError,
    ) as e:
        raise NotDecodable(str(e)) from e


def _call(node: ast.Call) -> dict[str, dict[Any, Any]]:
    parts = []
    func: ast.expr = node.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return {".".join(reversed(parts)): {k.arg: _value(k.value) for k in node.keywords}}


def _value(node: ast.expr) -> Any:
    """An argument's value, as BFCL's `resolve_ast_by_type` gives it (quirks included: a unary
    operator always negates a constant, a name is its own text, a call without keywords its
    source, a subscript its source)."""
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, ast.UnaryOp):
        if not isinstance(node.operand, ast.Constant):
            raise NotDecodable("a unary operator on something other than a constant")
        constant: Any = node.operand.value
        return -constant  # whatever the operator: BFCL's quirk (a TypeError for text)
    if isinstance(node, ast.List):
        return [_value(v) for v in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise NotDecodable("** in a dict")
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[arg-type]
    if isinstance(node, ast.BinOp):
        return _literal(node)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _call(node) if node.keywords else ast.unparse(node)
    if isinstance(node, ast.Tuple):
        return tuple(_value(v) for v in node.elts)
    if isinstance(node, ast.Subscript):
        return f"{ast.unparse(node.value)}[{ast.unparse(node.slice)}]"
    raise NotDecodable(f"unsupported value: {type(node).__name__}")


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
    ast.BitOr: operator.or_,
    ast.BitAnd: operator.and_,
    ast.BitXor: operator.xor,
}
_UNARY: dict[type, Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
    ast.Invert: operator.invert,
}


def _literal(node: ast.expr) -> Any:
    """What Python makes of literal arithmetic (the official decoder `eval`s a binary
    operation; here nothing but literals is computed)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        items = [_literal(v) for v in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[arg-type]
    if isinstance(node, ast.UnaryOp):
        if isinstance(node.op, ast.Not):
            return not _literal(node.operand)
        return _UNARY[type(node.op)](_literal(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _literal(node.left), _literal(node.right)
        _bounded(node.op, left, right)
        return _BINARY[type(node.op)](left, right)
    raise NotDecodable(f"not literal arithmetic: {ast.unparse(node)[:80]}")


def _bounded(op: ast.operator, left: Any, right: Any) -> None:
    numbers = all(isinstance(v, int | float | complex) for v in (left, right))
    if (
        isinstance(op, ast.Pow)
        and numbers
        and abs(right) * max(1, abs(left).bit_length() if isinstance(left, int) else 64)
        > MAX_LITERAL
    ):
        raise NotDecodable("a power too large to compute")
    if isinstance(op, ast.LShift) and isinstance(right, int) and right > MAX_LITERAL:
        raise NotDecodable("a shift too large to compute")
    if isinstance(op, ast.Mult) and not numbers:
        sizes = [len(v) for v in (left, right) if hasattr(v, "__len__")]
        counts = [v for v in (left, right) if isinstance(v, int)]
        if sizes and counts and sizes[0] * max(counts[0], 0) > MAX_LITERAL:
            raise NotDecodable("a repetition too large to make")


# --- checking (BFCL's `ast_checker`, Python) ---------------------------------------------------


def check(functions: list[dict[str, Any]], calls: Calls, possible: list[Any], category: str) -> str:
    """BFCL's error_type for these decoded calls ("" when valid), by the question's category:
    parallel (any order), multiple (one call, of several functions), or simple."""
    if "parallel" in category:
        return _parallel(functions, calls, possible)
    if len(calls) != len(possible if "multiple" in category else [None]):
        kind = "multiple_function_checker" if "multiple" in category else "simple_function_checker"
        return f"{kind}:wrong_count"
    expected = next(iter(possible[0])) if "multiple" in category else None
    function = _find(functions, expected) if expected is not None else functions[0]
    return _one(function, calls[0], possible[0])


def _find(functions: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((f for f in functions if f["name"] == name), None)


def _parallel(functions: list[dict[str, Any]], calls: Calls, possible: list[Any]) -> str:
    if len(calls) != len(possible):
        return "parallel_function_checker_no_order:wrong_count"
    matched: set[int] = set()
    for answer in possible:
        function = _find(functions, next(iter(answer)))
        error = "parallel_function_checker_no_order:cannot_find_match"
        for index, call in enumerate(calls):
            if index not in matched and not _one(function, call, answer):
                matched.add(index)
                error = ""
                break
        if error:
            return error
    return ""


def _one(function: dict[str, Any] | None, call: dict[str, dict[Any, Any]], answer: Any) -> str:
    """One call against one function's possible answer (BFCL's `simple_function_checker`)."""
    assert function is not None, "the possible answer names a function the question lacks"
    possible = next(iter(answer.values()))
    name, declared = function["name"], function["parameters"]["properties"]
    if name not in call:
        return "simple_function_checker:wrong_func_name"
    params = call[name]
    if any(p not in params for p in function["parameters"]["required"]):
        return "simple_function_checker:missing_required"
    for param, value in params.items():
        if param not in declared or param not in possible:
            return "simple_function_checker:unexpected_param"
        error = _param(declared[param]["type"], declared[param], value, possible[param])
        if error:
            return error
    if any(p not in params and "" not in values for p, values in possible.items()):
        return "simple_function_checker:missing_optional"
    return ""


def _param(kind: str, declared: dict[str, Any], value: Any, possible: list[Any]) -> str:
    expected = PYTHON_TYPES[kind]
    nested = PYTHON_TYPES[declared["items"]["type"]] if kind in NESTED else None
    if kind == "tuple" and type(value) is tuple:
        value = list(value)
    if kind == "float" and type(value) is int:
        value = float(value)
    ok, is_variable, error = _type(value, possible, expected, nested)
    if not ok:
        return error
    if not is_variable:
        if expected is dict:
            return _dict(value, possible)
        if expected is list and nested is dict:
            return _list_of_dicts(value, possible)
        if expected is str:
            return "" if _std(value) in _strings(possible) else "value_error:string"
        if expected is list:
            return (
                ""
                if _std_list(value) in [_std_list(p) for p in possible]
                else ("value_error:list/tuple")
            )
    return "" if value in possible else "value_error:others"


def _answer_type(possible: list[Any]) -> type | None:
    return next((type(p) for p in possible if p != ""), None)


def _type(
    value: Any, possible: list[Any], expected: type, nested: type | None
) -> tuple[bool, bool, str]:
    """(type ok, the value is a variable's name, error type): BFCL's `type_checker`. A value of
    the possible answers' type where another was declared is a variable, and passes (unless its
    items failed the nested check: BFCL then keeps the failure)."""
    answer_type = _answer_type(possible)
    ok, error = True, "type_error:simple"
    if type(value) is expected:
        is_variable = answer_type is not None and answer_type != expected
        if nested is None:
            return True, is_variable, ""
        items: Any = value  # a list (its type is `expected`)
        for item in possible:
            if type(item) is not list or all(_type(v, item, nested, None)[0] for v in items):
                return True, is_variable, ""
        ok, error = False, "type_error:nested"
    if answer_type is not None and type(value) is answer_type:
        return ok, True, "" if ok else error
    return False, False, "type_error:simple"


def _std(text: str) -> str:
    """BFCL's `standardize_string`: no spaces or ,./-_*^, lower case, ' as "."""
    return re.sub(r"[ \,\.\/\-\_\*\^]", "", text).lower().replace("'", '"')


def _strings(possible: list[Any]) -> list[str]:
    return [_std(p) for p in possible if type(p) is str]


def _std_list(values: list[Any]) -> list[Any]:
    return [_std(v) if type(v) is str else v for v in values]


def _dict(value: dict[Any, Any], possible: list[Any]) -> str:
    """BFCL's `dict_checker`: the dict equals one of the possible dicts (strings standardised;
    a key whose possible values include "" may be left out)."""
    error = "dict_checker:unclear"
    for answer in possible:
        if answer == "":
            continue
        error = _dict_against(value, answer)
        if not error:
            return ""
    return error


def _dict_against(value: dict[Any, Any], answer: dict[Any, Any]) -> str:
    error = ""
    for key, v in value.items():
        if key not in answer:
            error = "value_error:dict_key"
            break
        if (_std(v) if type(v) is str else v) not in _std_list(answer[key]):
            error = "value_error:dict_value"
            break
    if any(key not in value and "" not in values for key, values in answer.items()):
        error = "value_error:dict_key"  # BFCL looks for missing keys after a wrong value too
    return error


def _list_of_dicts(value: list[Any], possible: list[Any]) -> str:
    """BFCL's `list_dict_checker`: the dicts, in order, against one possible list of dicts."""
    error = "list_dict_checker:unclear"
    for answer in possible:
        if len(value) != len(answer):
            error = "value_error:list_dict_count"
            continue
        for item, expected in zip(value, answer, strict=True):
            error = _dict(item, [expected])
            if error:
                break
        else:
            return ""
    return error


# --- the verdict ---------------------------------------------------------------------------------


def score(
    text: str, functions: list[dict[str, Any]], possible: list[Any], category: str
) -> Verdict:
    """A model's answer to one question: BFCL's verdict and the partial credit."""
    try:
        calls = decode(text)
    except NotDecodable:
        return Verdict(False, False, "ast_decoder:decoder_failed", 0.0)
    error = check(functions, calls, possible, category)
    return Verdict(
        not error, True, error, 1.0 if not error else _partial(functions, calls, possible)
    )


def _partial(functions: list[dict[str, Any]], calls: Calls, possible: list[Any]) -> float:
    """0.25 for calls, 0.5 if one names an expected function, 0.75 if it also has every
    required parameter and none the function lacks."""
    best = 0.25
    names = {next(iter(answer)) for answer in possible}
    for call in calls:
        name = next(iter(call))
        function = _find(functions, name)
        if name not in names or function is None:
            continue
        params = function["parameters"]
        given = set(call[name])
        complete = set(params["required"]) <= given and given <= set(params["properties"])
        best = max(best, 0.75 if complete else 0.5)
    return best
