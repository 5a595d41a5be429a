"""Chat templates: jinja2 in a sandbox, parsed once, rendered under a time and size budget.

A chat template comes from the model file, so it is untrusted code. jinja2's immutable
sandbox already blocks attribute escapes and caps `range()`; on top of it:

- every loop's iterable passes through a metered iterator (a `{% for %}` over a list makes
  no call the sandbox could see), and every call goes through `call`, so each checks the
  deadline;
- `*`, `**`, `+` and `%` are intercepted (which also keeps them out of jinja's
  compile-time constant folding) and refused when the result would exceed the size budget,
  as are padding methods, width filters and format widths that would; anything a call or
  filter returns is measured, and so is the output as it streams;
- any failure while rendering (the template's own `raise_exception`, RecursionError,
  MemoryError, a TypeError...) becomes a RequestError naming the chat template: a 400 at
  the server, never a 500.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from vkrt.errors import ModelFormatError, RequestError

# Names the renderer passes itself; chat_template_kwargs may not set them.
RESERVED_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                            "raise_exception", "strftime_now"})


@dataclass(frozen=True)
class TemplateBudget:
    """Bounds on one rendering: wall-clock seconds, and the length of any string or list it
    builds (the output included)."""

    seconds: float = 2.0
    max_chars: int = 1 << 22


class BudgetExceeded(Exception):
    """Raised inside a rendering that went over its TemplateBudget."""


class _Meter:
    def __init__(self, budget: TemplateBudget) -> None:
        self.budget = budget
        self.deadline = time.monotonic() + budget.seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise BudgetExceeded(f"rendering took longer than {self.budget.seconds:g} s")

    def allow(self, size: int, what: str = "a value") -> None:
        if size > self.budget.max_chars:
            raise BudgetExceeded(f"it would build {what} of {size} items, over the limit of "
                                 f"{self.budget.max_chars}")

    def measure(self, value: Any) -> Any:
        if isinstance(value, (str, bytes, list, tuple, dict)):
            self.allow(len(value))
        return value


_meter: contextvars.ContextVar[_Meter] = contextvars.ContextVar("vkrt_template_meter")


def _active() -> _Meter:
    meter = _meter.get(None)
    if meter is None:  # rendering outside ChatTemplate.render: apply the default budget
        meter = _Meter(TemplateBudget())
        _meter.set(meter)
    return meter


# %-format and str.format widths / precisions: a width of 10**9 allocates a gigabyte.
_PERCENT_WIDTH = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d+))?")
_BRACE_WIDTH = re.compile(r"\{[^{}]*?:[^{}]*?(\d+)(?:\.(\d+))?[^{}]*\}")
_PADDING_METHODS = frozenset({"ljust", "rjust", "center", "zfill"})
_WIDTH_FILTERS = frozenset({"center", "indent", "tojson", "wordwrap", "truncate"})


def _check_format(meter: _Meter, fmt: str, pattern: re.Pattern[str]) -> None:
    for match in pattern.finditer(fmt):
        for digits in match.groups():
            if digits:
                meter.allow(int(digits), "a formatted field")


def _sized(value: Any) -> bool:
    return isinstance(value, (str, bytes, list, tuple))


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        meter = _active()
        meter.tick()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if _sized(seq) and isinstance(times, int):
                    meter.allow(len(seq) * max(times, 0))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            meter.allow(int(right * math.log2(abs(left)) / 8), "a number of that many bytes")
        elif operator == "+" and _sized(left) and _sized(right):
            meter.allow(len(left) + len(right))
        elif operator == "%" and isinstance(left, str):
            _check_format(meter, left, _PERCENT_WIDTH)
        return meter.measure(super().call_binop(context, operator, left, right))

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        meter = _active()
        meter.tick()
        target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format at attribute access
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):
            name = getattr(target, "__name__", "")
            if name in _PADDING_METHODS and args and isinstance(args[0], int):
                meter.allow(args[0])
            elif name == "expandtabs":
                meter.allow(len(owner) + owner.count("\t") * int(args[0] if args else 8))
            elif name in ("format", "format_map"):
                _check_format(meter, owner, _BRACE_WIDTH)
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                hits = owner.count(args[0]) if args[0] else len(owner) + 1
                meter.allow(len(owner) + hits * max(len(args[1]) - len(args[0]), 0))
        return meter.measure(super().call(__context, __obj, *args, **kwargs))


def _metered_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)  # copies jinja's pass_context/pass_environment marker too
    def metered(*args: Any, **kwargs: Any) -> Any:
        meter = _active()
        meter.tick()
        if name in _WIDTH_FILTERS:
            for value in (*args, *kwargs.values()):
                if isinstance(value, int) and not isinstance(value, bool):
                    meter.allow(value, f"a {name} width")
        if name == "format" and args and isinstance(args[0], str):
            _check_format(meter, args[0], _PERCENT_WIDTH)
        return meter.measure(fn(*args, **kwargs))

    return metered


def _metered_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    meter = _active()
    for item in iterable:
        meter.tick()
        yield item


def _metered_concat(items: Sequence[Any]) -> str:
    """`a ~ b ~ ...`, measured before the join allocates."""
    parts = [str(item) for item in items]
    _active().allow(sum(map(len, parts)))
    return "".join(parts)


class _Metering(NodeTransformer):
    """Routes every loop's iterable and every `~` concatenation through the meter."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _METERED_ITER, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), _METERED_CONCAT, [], [], None, None,
                            lineno=node.lineno)


class _GenerationBlock(Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` markers (renders the body)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' tojson: unlike jinja's built-in, no HTML escaping and non-ASCII kept.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """transformers' `dict` global: builds dicts, but exposes no attributes to reach beyond them."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace`, refusing underscore-prefixed attributes (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace (got {name!r})")


# Names a message's reasoning arrives under; templates read `reasoning_content` (gpt-oss: `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: keys whose value is None dropped
    (templates test for a missing key, not for None), reasoning under each of its names."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict):
            out.append(message)
            continue
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


_METERED_ITER = "vkrt_metered_iter"
_METERED_CONCAT = "vkrt_metered_concat"


def _environment() -> _BudgetedEnvironment:
    # The environment transformers' apply_chat_template builds (utils/chat_template_utils.py).
    env = _BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True,
                               extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters = {name: _metered_filter(name, fn) for name, fn in env.filters.items()}
    env.filters[_METERED_ITER] = _metered_iter
    env.filters[_METERED_CONCAT] = _metered_concat
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = _environment()
    try:
        tree = env.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelFormatError(f"chat template does not parse (line {exc.lineno}: {exc.message}); "
                               "fix the template in the model file") from exc
    _Metering().visit(tree)
    try:
        return env.from_string(tree)
    except jinja2.TemplateError as exc:  # e.g. an unknown filter, found at compile time
        raise ModelFormatError(f"chat template does not compile ({exc})") from exc


class ChatTemplate:
    """A model's chat template, compiled on construction (ModelFormatError if it does not parse)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._template = _compile(source)

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, bos_token: str = "", eos_token: str = "",
               budget: TemplateBudget | None = None, template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The rendered prompt; RequestError (param `messages`, or `chat_template_kwargs` for a
        reserved name) if the template fails or goes over `budget`."""
        template_kwargs = template_kwargs or {}
        reserved = sorted(RESERVED_NAMES & template_kwargs.keys())
        if reserved:
            raise RequestError(f"chat_template_kwargs: {', '.join(map(repr, reserved))} "
                               f"{'is' if len(reserved) == 1 else 'are'} set by the server and cannot be "
                               "passed", param="chat_template_kwargs")
        meter = _Meter(budget or TemplateBudget())
        token = _meter.set(meter)
        try:
            chunks: list[str] = []
            size = 0
            for chunk in self._template.generate(
                messages=_template_messages(messages), tools=list(tools) if tools is not None else None,
                documents=None, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                eos_token=eos_token, **template_kwargs,
            ):
                size += len(chunk)
                meter.allow(size, "a prompt")
                meter.tick()
                chunks.append(chunk)
            return "".join(chunks)
        except BudgetExceeded as exc:
            raise RequestError(f"chat template stopped: {exc}", param="messages") from None
        except jinja2.TemplateError as exc:
            raise RequestError(f"chat template: {_cut(str(exc))}", param="messages") from None
        except RecursionError:
            raise RequestError("chat template failed: it recursed too deeply", param="messages") from None
        except MemoryError:
            raise RequestError("chat template failed: it ran out of memory", param="messages") from None
        except Exception as exc:  # the template is model-supplied code: any failure is the request's 400
            raise RequestError(f"chat template failed: {type(exc).__name__}: {_cut(str(exc))}",
                               param="messages") from None
        finally:
            _meter.reset(token)


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
