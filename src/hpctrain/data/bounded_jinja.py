"""A Jinja sandbox that bounds work as well as code: chat templates are untrusted text.

Jinja's sandbox stops a template from reaching Python internals, not from working forever or
allocating without end: nested ``range()`` loops hang, ``"x" * 10**10`` takes 10 GB, a macro
that calls itself twice per level never returns. Here every render has a budget:

- time: loop iterations and calls are counted, and the clock is read every few hundred;
- size: ``*``, ``+``, ``%``, ``~`` (concatenation), method calls and filters are checked before
  they build a string or list (their arguments bound what they can make), their results after,
  and every character they make is charged to the render's budget; the output is bounded too.

A template over budget raises ``TemplateBudgetError``; what a render may spend is ample for real
chat templates (they render a conversation in microseconds and a few times its size).
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

# Characters one render may make in all (strings and list items built by its operations).
MAX_WORK = 64 << 20
# Characters of any one value or of the output.
MAX_VALUE = 16 << 20
# Wall-clock seconds of one render.
MAX_SECONDS = 2.0
# Items of one range().
MAX_RANGE = 100_000
_CHECK_EVERY = 256  # counted steps between reads of the clock
_ITER = "hpctrain_bounded_iter__"
_CONCAT = "hpctrain_bounded_concat__"
_WIDE = re.compile(r"\d{7,}")  # a format width or precision of a million or more
# str methods whose result can be much larger than the string and their arguments.
_GROWING = {"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "format",
            "format_map", "__mul__", "__rmul__", "__mod__"}


class TemplateBudgetError(SecurityError):
    """A render went over its time or size budget."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, str | bytes | list | tuple | dict) else 0


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with a time and size budget per render (see the module doc)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.globals["range"] = self._range
        self.globals[_ITER] = self._iterate
        self.globals[_CONCAT] = self._concat
        self.filters = {name: self.bounded(f) for name, f in self.filters.items()}
        self._deadline = self._work = self._steps = 0

    # -- compiling: loops and ~ go through the budget ------------------------------------------

    def from_source(self, source: str):
        """Compile ``source`` with every loop's iterable and every ``~`` made countable."""
        tree = self.parse(source)
        if any(n.name in (_ITER, _CONCAT) for n in tree.find_all(nodes.Name)):
            raise SecurityError("the template uses a name reserved by hpctrain")
        tree = _Bound(self).visit(tree)
        return self.from_string(tree)

    def render(self, template, **context: Any) -> str:
        """``template`` rendered within the budget (TemplateBudgetError when over)."""
        self._deadline = time.monotonic() + MAX_SECONDS
        self._work = self._steps = 0
        out: list[str] = []
        total = 0
        for chunk in template.generate(**context):
            total += len(chunk)
            if total > MAX_VALUE:
                raise TemplateBudgetError(f"the output is over {MAX_VALUE:,} characters")
            self._step()
            out.append(chunk)
        return "".join(out)

    # -- the budget ---------------------------------------------------------------------------

    def _step(self) -> None:
        self._steps += 1
        if self._steps % _CHECK_EVERY == 0 and time.monotonic() > self._deadline:
            raise TemplateBudgetError(f"rendering took over {MAX_SECONDS:g} s")

    def _spend(self, chars: int, what: str) -> None:
        """Charge a value of ``chars`` characters about to be made (refused before it is)."""
        if chars > MAX_VALUE:
            raise TemplateBudgetError(f"{what} would make {chars:,} characters (at most "
                                      f"{MAX_VALUE:,})")
        self._work += chars
        if self._work > MAX_WORK:
            raise TemplateBudgetError(f"the render made over {MAX_WORK:,} characters")
        self._step()

    def _check_args(self, args: Iterable[Any], what: str) -> None:
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_VALUE:
                raise TemplateBudgetError(f"{what} with the argument {a} (at most {MAX_VALUE:,})")
            if isinstance(a, str) and _WIDE.search(a) and what.endswith(("format", "format_map",
                                                                        "__mod__")):
                raise TemplateBudgetError(f"{what} with a width of a million or more")

    # -- the intercepted operations -----------------------------------------------------------

    def _range(self, *args: int) -> range:
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise TemplateBudgetError(f"range of {len(r):,} items (at most {MAX_RANGE:,})")
        return r

    def _iterate(self, iterable: Any) -> Iterator[Any]:
        for item in iterable:
            self._step()
            yield item

    def _concat(self, *parts: Any) -> str:
        texts = [str(p) for p in parts]
        self._spend(sum(map(len, texts)), "~")
        return "".join(texts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """``*``, ``**``, ``+``, ``%`` with their results' sizes checked first."""
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int):
                    self._spend(_size(seq) * max(n, 0), "*")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right > 4096:
                raise TemplateBudgetError(f"** with an exponent of {right} (at most 4096)")
        elif operator == "+":
            if _size(left) and _size(right):
                self._spend(_size(left) + _size(right), "+")
        elif operator == "%" and isinstance(left, str):
            self._check_args([left], "__mod__")
            args = right if isinstance(right, tuple) else (right,)
            self._spend(len(left) + sum(len(str(a)) for a in args), "%")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        """A call from the template: counted, its arguments and result sized."""
        name = getattr(__obj, "__name__", "a call")
        __self._step()
        __self._check_args([*args, *kwargs.values()], name)
        # str.format comes wrapped by the sandbox (its formatter); the string is the wrapped's.
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(owner, str) and name in _GROWING:
            if name.startswith("format"):
                __self._check_args([owner], name)
            __self._spend(_estimate(owner, name, args), f"str.{name}")
        result = super().call(__context, __obj, *args, **kwargs)
        __self._spend(_size(result), name)
        return result

    def bounded(self, f: Callable[..., Any]) -> Callable[..., Any]:
        """Filter ``f`` with its arguments and result sized (for filters added later too)."""

        @functools.wraps(f)  # keeps the pass_context/pass_environment marks
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self._check_args([*args, *kwargs.values()], f"the filter {f.__name__}")
            if f.__name__ == "do_replace":
                texts = [a for a in args if isinstance(a, str)]
                if len(texts) >= 3:
                    self._spend(_estimate(texts[-3], "replace", texts[-2:]), "replace")
            result = f(*args, **kwargs)
            self._spend(_size(result), f"the filter {f.__name__}")
            return result

        return bounded


def _estimate(text: str, method: str, args: tuple | list) -> int:
    """An upper bound on the size of ``text.<method>(*args)``."""
    ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    strs = [a for a in args if isinstance(a, str)]
    if method == "replace" and len(strs) >= 2:
        return len(text) + (len(text) + 1) * len(strs[1])
    if method == "expandtabs":
        return len(text) * max(ints or [8])
    if method == "join" and args and isinstance(args[0], list | tuple):
        items = args[0]
        return sum(len(str(i)) for i in items) + len(text) * len(items)
    return len(text) + max([0, *ints]) + sum(len(str(a)) for a in args)


class _Bound(NodeTransformer):
    """Rewrites ``for x in it`` as ``for x in <bounded>(it)`` and ``a ~ b`` as a counted call."""

    def __init__(self, env: BoundedSandbox):
        self.env = env

    def _call(self, name: str, args: list[nodes.Expr], like: nodes.Node) -> nodes.Call:
        call = nodes.Call(nodes.Name(name, "load"), args, [], None, None)
        call.set_lineno(like.lineno)
        call.set_environment(self.env)
        return call

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = self._call(_ITER, [node.iter], node)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return self._call(_CONCAT, list(node.nodes), node)
