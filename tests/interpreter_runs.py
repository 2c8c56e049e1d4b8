"""How the suite runs kernels under the Triton interpreter: faster, and under coverage without tracing the repeats.

* **One patch of triton.language per launch.** The interpreter replaces ``triton.language``'s builtins with its own
  when a launch starts (``GridExecutor.__call__``, through ``_patch_lang``) and restores them when it ends; it also
  calls ``_patch_lang`` again at every call of a ``@triton.jit`` helper inside the kernel, which rebuilds the same
  replacements of the same module objects (``inspect.getmembers`` over the language, thousands of times a launch:
  about half of a MaxSim launch's time). Inside a launch, a call whose language modules (``triton.language`` and
  ``triton.language.core``, those of its globals) the launch has patched already is skipped here, so every op runs
  as the interpreter runs it.
* **Coverage of the kernels' bodies.** Under coverage (``pytest --cov``), the tracer costs 2.5 times a launch's time,
  spent in the interpreter's own calls. Each kernel specialization (the kernel, its constexpr arguments and the
  runtime arguments it branches on, ``BRANCHES``) is traced on its first launch in a process; later launches of it
  pause the tracer (coverage's collector ``pause``/``resume``, which keeps its stack of frames) and record nothing.
  A line that ran in no traced launch counts as never executed, so the coverage gate can only be stricter for it,
  never looser.

API:
    interpreter_runs()     a context manager installing both for the run (a no-op without the interpreter).
"""

from __future__ import annotations

from collections.abc import Iterator
import inspect
from contextlib import contextmanager

import triton.language as tl
from triton.runtime import interpreter

#: The launch running (``depth``) and the language modules it patched (``patched``).
_STATE: dict = {"depth": 0, "patched": set()}
#: The language modules each ``@triton.jit`` function sees, as ``_patch_lang`` finds them.
_LANGS: dict = {}
#: The runtime arguments the kernels branch on (kernels/gist.py: ``if (rules & ...)``, ``if count``): a
#: specialization is traced once per value of each, beside its constexprs.
BRANCHES = ("rules", "count")
#: The kernel specializations traced once in this process: (kernel, constexpr and branch arguments).
_TRACED: set[tuple[int, str]] = set()


def _active_collector():
    """Coverage's running collector in this process, or None."""
    try:
        from coverage.collector import Collector
    except ImportError:
        return None
    return Collector._collectors[-1] if Collector._collectors else None


@contextmanager
def interpreter_runs() -> Iterator[None]:
    """Install the launch wrapper and the once-per-launch patch of triton.language inside."""
    launch, patch_lang = interpreter.GridExecutor.__call__, interpreter._patch_lang

    def once_per_launch(fn):
        if not _STATE["depth"]:
            return patch_lang(fn)
        langs = _LANGS.get(fn)
        if langs is None:
            langs = _LANGS[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                           if inspect.ismodule(value) and value in (tl, tl.core))
        if langs <= _STATE["patched"]:  # the scope is dropped, as the interpreter drops a helper's
            return interpreter._LangPatchScope()
        _STATE["patched"] |= langs
        return patch_lang(fn)

    def run(self, *args, **kwargs):
        key = (id(self.fn), repr(sorted((name, kwargs[name]) for name in (*self.constexprs, *BRANCHES)
                                        if name in kwargs)))
        collector = None if key not in _TRACED else _active_collector()
        _TRACED.add(key)
        _STATE["depth"] += 1
        _STATE["patched"] = set()
        if collector is not None:
            collector.pause()
        try:
            return launch(self, *args, **kwargs)
        finally:
            if collector is not None:
                collector.resume()
            _STATE["depth"] -= 1

    interpreter.GridExecutor.__call__, interpreter._patch_lang = run, once_per_launch
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__, interpreter._patch_lang = launch, patch_lang
