"""Chat templates rendered under a time limit and an output-size limit.

A chat template is a program: `{{ 'x' * 100000000 }}` builds 100 MB and two nested `range`
loops run for hours, on a server worker thread that nothing can interrupt. So templates (the
model's own and, when the server trusts them, the request's) render in Jinja's immutable
sandbox with a budget the rendering thread checks as it goes:

- a deadline, checked on every loop iteration (each `for` iterable is wrapped), call,
  attribute or item access, operator and output piece, so a template stops within a few
  Python operations of its time limit instead of pinning the thread;
- a size limit, checked *before* a value is built where its size follows from its operands
  (`*`, `+`, `%`, `**`, `~`, `str.format`, widths of `center`/`ljust`/`indent`, `replace`,
  `join`, `tojson`, stringifying a container), else right after; every piece of text the
  template emits (its output, a block `set` or a macro's body) counts against it once, so no
  buffer can outgrow it.

Either limit raises `TemplateLimitError` (a `ChatTemplateError`): the server answers 400 naming
the limit and its `kvtier serve` flag. `chat_template_kwargs` may set only variables the
template reads and none of the names the renderer passes itself (`RESERVED`).
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.meta import find_undeclared_variables
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

__all__ = ["RESERVED", "ChatTemplateError", "RenderLimits", "Renderer", "TemplateLimitError"]

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_CHARS = 32 * 2**20
_ITER = "__kvtier_iter"  # the guard every `for` iterable is wrapped in
_OUT = "__kvtier_out"  # the guard every emitted value goes through
_CONCAT = "__kvtier_concat"  # `~`
_GLOBALS = ("raise_exception", "strftime_now", "range", "dict", "cycler", "joiner", "namespace")
# what the renderer passes itself: a request's chat_template_kwargs cannot set these
RESERVED = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message", "documents", "tools",
     "bos_token", "eos_token", "chat_template", "tokenize", _ITER, _OUT, _CONCAT, *_GLOBALS}
)  # fmt: skip
_CACHED = 32  # compiled templates kept (the model's own, and trusted request templates)
_CACHED_SOURCE = 256 * 1024  # larger sources compile per render: the cache holds no megabytes
_TICK_EVERY = 1024  # nodes a size estimate visits between deadline checks
_SPEC_NUMBER = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


class ChatTemplateError(ValueError):
    """A chat request the template cannot render (no template, it raised, a bad kwarg);
    `param` names the request field to fix."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class TemplateLimitError(ChatTemplateError):
    """A template ran past its time limit or built more text than the size limit allows."""


@dataclass(frozen=True)
class RenderLimits:
    """How long one render may run and how many characters it may build."""

    timeout_s: float = DEFAULT_TIMEOUT_S  # kvtier serve --chat-template-timeout
    max_chars: int = DEFAULT_MAX_CHARS  # kvtier serve --max-chat-template-chars

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"chat template timeout {self.timeout_s} must be > 0 seconds")
        if self.max_chars < 1:
            raise ValueError(f"chat template size limit {self.max_chars} must be >= 1 character")


class _Budget:
    """One render's deadline and output count (the rendering thread's own)."""

    __slots__ = ("deadline", "emitted", "limits")

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.emitted = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(
                f"the chat template did not finish rendering within {self.limits.timeout_s:g} s "
                "(the server's limit, kvtier serve --chat-template-timeout); simplify the "
                "template or send fewer messages"
            )

    def size(self, n: int, what: str) -> None:
        if n > self.limits.max_chars:
            raise TemplateLimitError(
                f"the chat template would build {what} of more than {self.limits.max_chars} "
                "characters (the server's limit, kvtier serve --max-chat-template-chars); "
                "simplify the template or send shorter messages"
            )

    def emit(self, n: int) -> None:
        self.emitted += n
        self.size(self.emitted, "output")


_state = threading.local()


def _budget() -> _Budget:
    budget: _Budget | None = getattr(_state, "budget", None)
    if budget is None:  # a template must never run without its limits
        raise ChatTemplateError("a chat template was rendered outside Renderer.render")
    return budget


def _weight(value: Any, budget: _Budget) -> int:
    """About how many characters `str(value)` (or its JSON) takes; stops counting past the
    limit. A list repeating one big string weighs every repeat: printing it writes them all."""
    cap = budget.limits.max_chars
    total = 0
    stack = [value]
    visited = 0
    while stack:
        v = stack.pop()
        if isinstance(v, str | bytes):
            total += len(v) + 2
        elif isinstance(v, Mapping):
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple | set | frozenset):
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 1
        else:
            total += 16
        if total > cap:
            return total
        visited += 1
        if visited % _TICK_EVERY == 0:
            budget.tick()
    return total


def _check_sized(value: Any, budget: _Budget, what: str) -> None:
    if isinstance(value, str | bytes | list | tuple):
        budget.size(len(value), what)


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# ---- operators --------------------------------------------------------------------------------


def _check_binop(op: str, left: Any, right: Any, budget: _Budget) -> None:
    if op == "*":
        for seq, times in ((left, right), (right, left)):
            n = _as_int(times)
            if n is not None and isinstance(seq, str | bytes | list | tuple):
                budget.size(len(seq) * max(n, 0), "a repeated value")
                return
        a, b = _as_int(left), _as_int(right)
        if a is not None and b is not None:
            budget.size((a.bit_length() + b.bit_length()) // 3, "a number")
    elif op == "+":
        if isinstance(left, str | bytes | list | tuple) and isinstance(right, type(left)):
            budget.size(len(left) + len(right), "a concatenation")
    elif op == "**":
        base, exp = _as_int(left), _as_int(right)
        if base is not None and exp is not None and exp > 0 and abs(base) > 1:
            budget.size(exp * base.bit_length() // 3, "a number")
    elif op == "%" and isinstance(left, str):
        _check_percent(left, right, budget)


def _check_percent(fmt: str, args: Any, budget: _Budget) -> None:
    for width, precision in _PERCENT_SPEC.findall(fmt):
        for number in (width, precision):
            if number.isdigit():
                budget.size(int(number), "a formatted field")
    values = args if isinstance(args, tuple) else (args,)
    for v in values:
        n = _as_int(v)
        if n is not None and "*" in fmt:
            budget.size(abs(n), "a formatted field")
    budget.size(len(fmt) + _weight(args, budget), "a formatted string")


def _check_format(
    fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any], budget: _Budget
) -> None:
    # widths in format specs ("{:>1000000000}") and nested ones taken from the arguments
    for field in re.findall(r"\{[^{}]*:([^{}]*)\}", fmt):
        for number in _SPEC_NUMBER.findall(field):
            budget.size(int(number), "a formatted field")
    if re.search(r"\{[^{}]*:[^{}]*\{", fmt):
        for v in (*args, *kwargs.values()):
            n = _as_int(v)
            if n is not None:
                budget.size(abs(n), "a formatted field")
    budget.size(len(fmt) + _weight((tuple(args), dict(kwargs)), budget), "a formatted string")


# ---- calls and filters ------------------------------------------------------------------------


def _check_str_method(s: str, name: str, args: Sequence[Any], budget: _Budget) -> Sequence[Any]:
    """Refuse a str method call whose result would pass the limit; returns the arguments to
    call with (a `join` of a generator is materialized, so it can be measured first)."""
    if name in ("center", "ljust", "rjust", "zfill") and args:
        n = _as_int(args[0])
        if n is not None:
            budget.size(n, f"a str.{name} result")
    elif name == "expandtabs":
        n = _as_int(args[0]) if args else 8
        budget.size(len(s) + s.count("\t") * max(n or 0, 0), "a str.expandtabs result")
    elif name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str) and isinstance(new, str):
            count = s.count(old) if old else len(s) + 1
            budget.size(len(s) + count * max(len(new) - len(old), 0), "a str.replace result")
    elif name == "join" and args:
        items = list(_guarded_iter(args[0]))
        budget.size(_weight(items, budget) + len(s) * len(items), "a str.join result")
        return (items, *args[1:])
    elif name == "translate":
        budget.size(len(s) * max(_weight(args, budget), 1), "a str.translate result")
    return args


_STRINGIFYING = frozenset(
    {"string", "tojson", "pprint", "join", "sum", "format", "urlencode", "xmlattr", "escape",
     "e", "forceescape", "safe", "striptags", "title", "upper", "lower", "capitalize", "trim",
     "center", "indent", "wordwrap", "replace", "truncate", "urlize", "wordcount"}
)  # fmt: skip


def _check_filter(name: str, args: list[Any], kwargs: dict[str, Any], budget: _Budget) -> None:
    """Refuse a filter call whose result would pass the limit (args[0] is the filtered value;
    `join` and `sum` get their iterable materialized in place, so it is measured once)."""
    if not args:
        return
    value = args[0]
    if name in ("join", "sum") and not isinstance(value, str | Mapping):
        args[0] = value = list(_guarded_iter(value))
    if name in _STRINGIFYING and not isinstance(value, str):
        budget.size(_weight(value, budget), f"the input of the {name} filter")
    if name == "center":
        width = _as_int(args[1] if len(args) > 1 else kwargs.get("width", 80))
        budget.size(width or 0, "a center result")
    elif name == "indent" and isinstance(value, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        w = len(width) if isinstance(width, str) else (_as_int(width) or 0)
        budget.size(len(value) + (value.count("\n") + 1) * max(w, 0), "an indent result")
    elif name == "replace" and isinstance(value, str) and len(args) >= 3:
        _check_str_method(value, "replace", args[1:3], budget)
    elif name == "join":
        sep = args[1] if len(args) > 1 else kwargs.get("d", "")
        seps = len(sep) * len(value) if isinstance(sep, str) else 0
        budget.size(_weight(value, budget) + seps, "a join result")
    elif name == "format" and isinstance(value, str):
        _check_percent(value, tuple(args[1:]) or dict(kwargs), budget)
    elif name == "tojson":
        indent = _as_int(args[1] if len(args) > 1 else kwargs.get("indent")) or 0
        if indent > 16:
            raise ChatTemplateError(f"tojson(indent={indent}) is over the limit of 16")


def _guard_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    pass_arg = getattr(fn, "jinja_pass_arg", None)

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        lead = 1 if pass_arg is not None else 0  # the context or environment jinja passes
        rest = list(args[lead:])
        _check_filter(name, rest, kwargs, budget)
        result = fn(*args[:lead], *rest, **kwargs)
        _check_sized(result, budget, f"the result of the {name} filter")
        return result

    return guarded


# ---- the guards the template's own code calls -------------------------------------------------


def _guarded_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    budget = _budget()
    for item in iterable:
        budget.tick()
        yield item


def _guarded_out(value: Any) -> Any:
    budget = _budget()
    budget.tick()
    budget.emit(len(value) if isinstance(value, str) else _weight(value, budget))
    return value


def _guarded_concat(*parts: Any) -> str:
    budget = _budget()
    budget.tick()
    budget.size(sum(_weight(p, budget) for p in parts), "a ~ concatenation")
    return "".join(str(p) for p in parts)


class _Guard(NodeTransformer):
    """Rewrites a parsed template so its loops, output and `~` go through the guards."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name(_ITER, "load"), [node.iter], [], None, None)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        # literal text counts too: a loop repeating it into a block `set` builds a buffer
        node.nodes = [
            nodes.Call(
                nodes.Name(_OUT, "load"),
                [nodes.Const(child.data) if isinstance(child, nodes.TemplateData) else child],
                [], None, None,
            )  # fmt: skip
            for child in node.nodes
        ]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(nodes.Name(_CONCAT, "load"), list(node.nodes), [], None, None)


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with every operation the template runs on the budget."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.tick()
        _check_binop(operator, left, right, budget)
        result = super().call_binop(context, operator, left, right)
        _check_sized(result, budget, f"the result of {operator}")
        return result

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().tick()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            args = tuple(_check_str_method(owner, getattr(__obj, "__name__", ""), args, budget))
        result = super().call(__context, __obj, *args, **kwargs)
        _check_sized(result, budget, "a call's result")
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        inner = super().wrap_str_format(value)
        if inner is None:
            return None
        fmt: str = value.__self__
        is_map = value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            budget = _budget()
            budget.tick()
            mapping = args[0] if is_map and args and isinstance(args[0], Mapping) else kwargs
            _check_format(fmt, () if is_map else args, mapping, budget)
            return inner(*args, **kwargs)

        return checked


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value: object, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@dataclass(frozen=True)
class _Compiled:
    template: Any  # jinja2.Template
    variables: frozenset[str]  # what the template reads from its context


class Renderer:
    """Compiles (and caches) chat templates and renders them under `RenderLimits`."""

    def __init__(self) -> None:
        env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True)
        env.globals.pop("lipsum", None)  # lorem ipsum of any length is no chat prompt
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.globals[_ITER] = _guarded_iter
        env.globals[_OUT] = _guarded_out
        env.globals[_CONCAT] = _guarded_concat
        env.filters["tojson"] = _tojson
        for name, fn in list(env.filters.items()):
            env.filters[name] = _guard_filter(name, fn)
        self._env = env
        self._cache: OrderedDict[str, _Compiled] = OrderedDict()
        self._lock = threading.Lock()

    def _compile(self, source: str) -> _Compiled:
        with self._lock:
            hit = self._cache.get(source)
            if hit is not None:
                self._cache.move_to_end(source)
                return hit
        try:
            tree = self._env.parse(source)
            variables = frozenset(find_undeclared_variables(tree))
            compiled = _Compiled(self._env.from_string(_Guard().visit(tree)), variables)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        if len(source) <= _CACHED_SOURCE:
            with self._lock:
                self._cache[source] = compiled
                while len(self._cache) > _CACHED:
                    self._cache.popitem(last=False)
        return compiled

    def render(
        self,
        source: str,
        variables: Mapping[str, Any],
        extra: Mapping[str, Any] | None,
        limits: RenderLimits,
    ) -> str:
        """Render `source` with the renderer's `variables` and a request's `extra` ones
        (chat_template_kwargs: only names the template reads, none of `RESERVED`)."""
        compiled = self._compile(source)
        for key in extra or {}:
            shown = repr(key) if len(key) <= 64 else repr(key[:64]) + "..."
            if key in RESERVED or key in variables:
                raise ChatTemplateError(
                    f"chat_template_kwargs sets {shown}, which the server passes to the "
                    "template itself; remove it (add_generation_prompt, documents and "
                    "chat_template are request fields)", "chat_template_kwargs",
                )  # fmt: skip
            if key not in compiled.variables:
                reads = ", ".join(sorted(compiled.variables - RESERVED)) or "none"
                raise ChatTemplateError(
                    f"chat_template_kwargs sets {shown}, which the chat template does not read "
                    f"(it reads: {reads}); remove it", "chat_template_kwargs",
                )  # fmt: skip
        budget = _Budget(limits)
        _state.budget = budget
        try:
            return compiled.template.render({**variables, **(extra or {})})
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed to render: {exc}") from None
        except RecursionError:
            raise ChatTemplateError("the chat template recursed too deeply") from None
        except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as exc:
            # a template's own bug (e.g. int + str): its kind, never a server path
            raise ChatTemplateError(
                f"the chat template failed to render: {type(exc).__name__}"
            ) from None
        finally:
            _state.budget = None
