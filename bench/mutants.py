"""The mutation check: does the test suite catch known bugs? Each mutant (a deliberate bug, ``MUTANTS``) is applied,
one at a time, to a fresh copy of the project, and the tests run against that copy; a mutant is killed when some
test fails, and survives when every test passes.

    python bench/mutants.py [--quick] [--only NAME ...] [--list] [--baseline] [--keep] [--pytest-args ARGS]
    python bench/mutants.py --quick --only row-block-offset --pytest-args="-q -p no:xdist"

A mutant is a name, the bug in one line, a file, the exact source text it replaces (found exactly once, or the check
fails loudly: a refactor cannot turn a mutant into a silent no-op; ``tests/test_mutants.py`` checks the table
against the tree) and the test files most likely to kill it. The copy holds the working tree as it is (tracked files
and untracked ones git does not ignore, ``git ls-files -co --exclude-standard``), is installed with ``pip install
--no-deps --target COPY/_site`` (not editable, so ``cgist.kernels`` is the copy's ``kernels/``) and tested from its own
directory with the venv's ``pytest`` and ``PYTHONPATH=COPY/_site``, offline; a check before the run and a plugin
inside it stop the run unless ``cgist`` and ``cgist.kernels`` are imported from the copy. By default the whole
suite runs (``-q -n auto --maxprocesses 4``, every failure collected, no early stop); ``--quick`` runs only each
mutant's test files. ``--baseline`` first runs the same tests on an unmodified copy: tests that fail there kill
nothing. ``--pytest-args`` replaces the runner's options (``"-q -p no:xdist"`` runs in one process).

One line per mutant (killed or survived, seconds, the first failing test ids), then a summary. The exit status is 0
when every mutant was killed, 1 when one survived or its run failed (a gate for a release check), 2 when a mutant's
source text is not found exactly once. docs/correctness.md#mutation-check says what the check is for.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The runner's options by default (``--pytest-args`` replaces them): every failure is wanted, so no ``-x``.
DEFAULT_PYTEST_ARGS = "-q -n auto --maxprocesses 4"
#: Where the copy is installed, inside the copy.
SITE = "_site"
#: Seconds one test run may take before it is stopped (and the mutant reported as timed out).
DEFAULT_TIMEOUT = 3600.0
#: Failing test ids shown on a mutant's line.
SHOWN = 3
#: The pytest plugin (written into the copy's site folder, loaded with ``-p``) that stops a run, in the controller and
#: in every xdist worker, unless cgist and its kernels are the copy's. At session start the tests' conftest has
#: been loaded (it sets the Triton interpreter up before the kernels are imported), so importing cgist is safe.
GUARD_MODULE = "_cgist_mutant_guard"
GUARD_SOURCE = '''"""Stops a mutation run whose cgist is not the mutated copy's (written by bench/mutants.py)."""
import importlib.util
import os

import pytest


def pytest_sessionstart(session):
    import cgist

    site = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    found = [os.path.realpath(cgist.__file__), os.path.realpath(importlib.util.find_spec("cgist.kernels").origin)]
    if not all(path.startswith(site + os.sep) for path in found):
        pytest.exit(f"mutation run imports cgist from {found}, not from the copy's {site}", returncode=3)
'''
#: The same check as one line of Python before the run; ``sys.path[0]`` (the current folder, which holds the copy's
#: sources without ``cgist.kernels``) is dropped, as the ``pytest`` executable does not have it.
CHECK_SOURCE = (
    "import importlib.util, os, sys; sys.path.pop(0); import cgist; site = os.path.realpath(sys.argv[1]); "
    "found = [os.path.realpath(cgist.__file__), os.path.realpath(importlib.util.find_spec('cgist.kernels').origin)]; "
    "sys.exit(0 if all(p.startswith(site + os.sep) for p in found) else "
    "'cgist imported from %s, not %s' % (found, site))"
)


@dataclass(frozen=True)
class Mutant:
    """A deliberate bug: ``old`` (found exactly once in ``path``) becomes ``new``; ``tests`` are the test files most
    likely to kill it (``--quick``)."""

    name: str
    bug: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "row-block-offset",
        "every row block after the first takes the first block's positives and thresholds",
        "cgist/stage/pytorch/dense.py",
        "lo, hi = options.offset + start, options.offset + stop",
        "lo, hi = options.offset, options.offset + (stop - start)",
        ("tests/test_blocks.py", "tests/test_streaming.py", "tests/test_properties.py"),
    ),
    Mutant(
        "ranking-hardness-fallback",
        "the ranking drop-ins fall back to sentence-transformers' own code whenever hardness_mode is set",
        "cgist/losses/ranking.py",
        "        return GistOptions(\n            temperature=1.0 / scale, contrast_anchors=False,",
        "        if self.hardness_mode is not None:\n"
        "            return None, f\"hardness_mode={self.hardness_mode!r} (left to sentence-transformers)\"\n"
        "        return GistOptions(\n            temperature=1.0 / scale, contrast_anchors=False,",
        ("tests/test_plain.py", "tests/test_dropin.py"),
    ),
    Mutant(
        "plain-gist-negatives",
        "the plain drop-ins score the student's negative 1 in place of negatives 2..k (k > 1 only)",
        "cgist/losses/columns.py",
        "return [[e] for e in embed_columns(model, features)], None",
        "embeddings = embed_columns(model, features)\n"
        "        return [[e] for e in [*embeddings[:3], *embeddings[2:3] * max(len(embeddings) - 3, 0)]], None",
        ("tests/test_plain.py",),
    ),
    Mutant(
        "protocol-unchecked",
        "a drop-in class is not checked against the protocol when it is defined (only abc's check at instantiation)",
        "cgist/losses/base.py",
        "        check_hooks(cls)\n",
        "",
        ("tests/test_dropin.py",),
    ),
    Mutant(
        "stage-batch-drops-text-ids",
        "the loss stage's batch leaves out the texts' ids the step read (ties decided by equal guide vectors instead)",
        "cgist/losses/base.py",
        "guide=guide, text_ids=inputs.text_ids,",
        "guide=guide, text_ids=None,",
        ("tests/test_guide_sources.py", "tests/test_multi_vector_guide.py"),
    ),
    Mutant(
        "guide-mask-ge",
        "the guide masks a candidate whose score equals the threshold (>= in place of the strict >)",
        "cgist/stage/numerics.py",
        "mask = torch.gt(guide, limit) if out is None else torch.gt(guide, limit, out=out)",
        "mask = torch.ge(guide, limit) if out is None else torch.ge(guide, limit, out=out)",
        ("tests/test_reference.py", "tests/test_numerics.py", "tests/test_kernels_guides.py"),
    ),
    Mutant(
        "relative-margin-abs",
        "the relative margin scales by theta instead of |theta|: a negative theta's threshold moves up",
        "cgist/stage/numerics.py",
        "return theta - theta.abs() * margin if relative else theta - margin",
        "return theta - theta * margin if relative else theta - margin",
        ("tests/test_reference.py", "tests/test_numerics.py", "tests/test_kernels.py"),
    ),
    Mutant(
        "matryoshka-weight-ignored",
        "MatryoshkaLoss's weights are dropped by the fused takeover: every dimension weighs 1",
        "cgist/losses/matryoshka.py",
        "chosen = tuple((dims[i], float(weights[i])) for i in indices)",
        "chosen = tuple((dims[i], 1.0) for i in indices)",
        ("tests/test_matryoshka.py",),
    ),
    Mutant(
        "own-option-unkeyed",
        "the options cache key leaves out one of cgist's own options: hardness_strength assigned is ignored",
        "cgist/losses/base.py",
        "*(option.name for option in self.own_options())])",
        '*(option.name for option in self.own_options() if option.name != "hardness_strength")])',
        ("tests/test_dropin.py",),
    ),
    Mutant(
        "positive-only-off-by-label",
        "the statistics count as positive-only the anchors left with one candidate besides the label",
        "cgist/stage/pytorch/dense.py",
        'call.count("positive_only", (unmasked == 0).sum())',
        'call.count("positive_only", (unmasked == 1).sum())',
        ("tests/test_stats.py",),
    ),
    Mutant(
        "dq-pair-not-spared",
        "doc_to_query's pair (positive i, anchor i) is no longer exempt from the guide's mask",
        "cgist/stage/spec/options.py",
        'groups.append(ColumnGroup("dq", p_part, "p", everyone, unmasked_offset=own_anchor))',
        'groups.append(ColumnGroup("dq", p_part, "p", everyone))',
        ("tests/test_directions.py", "tests/test_stats.py"),
    ),
    Mutant(
        "mask-duplicates-anchor-only",
        "mask_duplicates on the PyTorch path compares a candidate's text with the anchor's only, not the positive's",
        "cgist/stage/pytorch/dense.py",
        "self.texts = (anchor.text[start:stop], positive.text[lo:hi]) if options.mask_duplicates else None",
        "self.texts = (anchor.text[start:stop],) if options.mask_duplicates else None",
        ("tests/test_stats.py", "tests/test_guide_sources.py"),
    ),
    Mutant(
        "hard-negatives-unshifted",
        "hardness_mode='hard_negatives' scales a row's own negatives' shifted logits without the shift's share",
        "cgist/stage/pytorch/dense.py",
        "t[own_rows, own_cols] = t[own_rows, own_cols] * factor + lift[own_rows, 0]",
        "t[own_rows, own_cols] = t[own_rows, own_cols] * factor",
        ("tests/test_directions.py",),
    ),
    Mutant(
        "tile-column-gradients",
        "the PyTorch path adds every column tile's column gradients at the first tile's columns (one dimension)",
        "cgist/stage/pytorch/dense.py",
        "cols.grad[lo:hi].addmm_(tile.T, rows.weighted)",
        "cols.grad[0:hi - lo].addmm_(tile.T, rows.weighted)",
        ("tests/test_blocks.py", "tests/test_streaming.py"),
    ),
    Mutant(
        "hardness-cutoff-first",
        "a smaller Matryoshka dimension's plain logits are cut off before the hardness penalty lifts them",
        "cgist/stage/pytorch/dense.py",
        "            term = self.call.work.terms(m, group.index, lo, t.shape)\n            if group.hard:\n",
        "            term = self.call.work.terms(m, group.index, lo, t.shape)\n"
        "            torch.nn.functional.threshold_(t, self.call.cutoff, -MASKED)\n            if group.hard:\n",
        ("tests/test_streaming.py", "tests/test_properties.py"),
    ),
    Mutant(
        "kernel-row-chunk-scores",
        "the Triton backward computes every row chunk's score gradients at the first chunk's rows",
        "cgist/stage/triton/dense.py",
        "row_stop=r1, col_stop=c1, row_start=r0, col_start=c0,",
        "row_stop=r1 - r0, col_stop=c1, row_start=0, col_start=c0,",
        ("tests/test_blocks.py", "tests/test_kernels.py"),
    ),
    Mutant(
        "kernel-row-chunk-gemm",
        "the Triton backward adds a later row chunk's gradients at the first chunk's rows",
        "cgist/stage/triton/dense.py",
        "h_rows = self.h[rows.grad][rows.start + r0 : rows.start + r1]",
        "h_rows = self.h[rows.grad][rows.start : rows.start + r1 - r0]",
        ("tests/test_blocks.py", "tests/test_kernels.py"),
    ),
    Mutant(
        "kernel-last-column-tile",
        "the forward kernel's last column tile is pulled back to end at column N, counting columns of the tile "
        "before it twice when BLOCK_N does not divide N",
        "kernels/gist.py",
        "    for start_n in range(0, n_cols, BLOCK_N):\n        offs_n = start_n + tl.arange(0, BLOCK_N)",
        "    for start_n in range(0, n_cols, BLOCK_N):\n"
        "        offs_n = tl.maximum(tl.minimum(start_n, n_cols - BLOCK_N), 0) + tl.arange(0, BLOCK_N)",
        ("tests/test_kernels.py",),
    ),
    Mutant(
        "tie-by-rounding",
        "a tie with theta_i is decided by the rounded comparison theta > theta - margin, not by the margin",
        "cgist/stage/numerics.py",
        "    return torch.full_like(theta, margin > 0, dtype=torch.bool)",
        "    return theta > threshold(theta, margin, relative)",
        ("tests/test_differential.py",),
    ),
    Mutant(
        "temperature-share-doubled",
        "the dense backends count each score's share of a learned temperature's gradient once per side (twice)",
        "cgist/stage/pytorch/dense.py",
        "self.temperature_share = torch.stack(shares).sum() / 2 if shares else None",
        "self.temperature_share = torch.stack(shares).sum() if shares else None",
        ("tests/test_door.py",),
    ),
    Mutant(
        "maxsim-self-pair-first-block",
        "the guide's mask leaves out AA's and PP's self-pairs at the first row block's columns in every row block",
        "cgist/stage/block.py",
        "mask[local, span.start + first + group.spec.excluded_offset + local] = True",
        "mask[local, span.start + group.spec.excluded_offset + local] = True",
        ("tests/test_multi_vector_guide.py",),
    ),
    Mutant(
        "maxsim-loss-after-the-sum",
        "a held row's loss is (peak + log total) - label, which float32 rounds to 0 where every logit is -1e9",
        "cgist/stage/block.py",
        "losses[first:first + rows] = gap + torch.log(total).squeeze(1)",
        "losses[first:first + rows] = (peak + torch.log(total)).squeeze(1) - (peak.squeeze(1) - gap)",
        ("tests/test_door.py",),
    ),
    Mutant(
        "zero-width-tokens",
        "a token axis of width 0 is not padded to one masked token at the door",
        "cgist/stage/spec/maxsim.py",
        "        if x.shape[1] == 0:  # no token",
        "        if x.shape[1] == -1:  # no token",
        ("tests/test_door.py",),
    ),
    Mutant(
        "xtr-kernel-sums-every-maximum",
        "the XTR kernels' logits sum every query token's maximum, not only the retrieved ones",
        "kernels/maxsim.py",
        "        kept = kept & (best >= tl.load(tau_ptr + q_rows, mask=q_real, other=float(\"inf\")))",
        "        kept = kept | (best >= tl.load(tau_ptr + q_rows, mask=q_real, other=float(\"inf\")))",
        ("tests/test_kernels_maxsim.py", "tests/test_xtr.py"),
    ),
    Mutant(
        "xtr-gradient-not-divided-by-z",
        "the held path's XTR gradients are not divided by each score's count of retrieved maxima",
        "cgist/stage/triton/maxsim.py",
        "                logits_grad /= counts[:n].clamp_(min=1.0)",
        "                logits_grad /= counts[:n].clamp_(min=1.0) ** 0",
        ("tests/test_kernels_maxsim.py",),
    ),
    Mutant(
        "xtr-threshold-one-too-deep",
        "the PyTorch stage's thresholds are each query token's (top_k + 1)-th largest similarity",
        "cgist/stage/pytorch/xtr.py",
        "        self.k = call.top_k",
        "        self.k = call.top_k + 1",
        ("tests/test_xtr.py",),
    ),
    Mutant(
        "xtr-kernel-thresholds-one-too-deep",
        "the thresholds' sweep of the Triton path takes each query token's (top_k + 1)-th largest similarity",
        "cgist/stage/xtr_thresholds.py",
        "            top = TopK(block.shape[0], call.top_k, acc, call.device)",
        "            top = TopK(block.shape[0], call.top_k + 1, acc, call.device)",
        ("tests/test_kernels_maxsim.py",),
    ),
    Mutant(
        "xtr-threshold-counts-padding",
        "the PyTorch stage's thresholds count a masked document token (a copy of its document's first real one)",
        "cgist/stage/pytorch/xtr.py",
        "        return self.top.offer(products, doc.real, rows)",
        "        return self.top.offer(products, None, rows)",
        ("tests/test_xtr.py",),
    ),
    Mutant(
        "xtr-last-candidates-dropped",
        "the thresholds' sweep ends without merging the candidates listed since its last merge",
        "cgist/stage/xtr_thresholds.py",
        "        if self.candidates:\n            self._merge_listed()\n        return self.floor",
        "        self.candidates = []\n        return self.floor",
        ("tests/test_xtr.py",),
    ),
    Mutant(
        "xtr-torch-sends-unretrieved",
        "the PyTorch stage's XTR backward sends a maximum that was not retrieved its score's gradient",
        "cgist/stage/pytorch/xtr.py",
        "        return torch.where(kept, grad.unsqueeze(1), 0.0)",
        "        return grad.unsqueeze(1) * weights.unsqueeze(2)",
        ("tests/test_xtr.py",),
    ),
    Mutant(
        "fallback-backward-raises",
        "a MaxSim kernel failing in the backward after its check is retried instead of the PyTorch stage taking over",
        "cgist/stage/dispatch/route.py",
        "            state = self.pytorch.forward(call, True, False)[1]",
        "            return self.kernels.backward(call, state.state, grad_output)",
        ("tests/test_kernels_maxsim.py",),
    ),
)


class MutantError(Exception):
    """A mutant's source text is not found exactly once."""


def mutant_named(name: str) -> Mutant:
    for mutant in MUTANTS:
        if mutant.name == name:
            return mutant
    raise KeyError(f"no mutant named {name!r}; known: {', '.join(m.name for m in MUTANTS)}")


def occurrences(mutant: Mutant, root: Path) -> int:
    """How many times the mutant's source text is in its file under ``root`` (0 when the file is missing)."""
    path = root / mutant.path
    return path.read_text(encoding="utf-8").count(mutant.old) if path.is_file() else 0


def apply(mutant: Mutant, root: Path) -> None:
    """Write the mutant into its file under ``root`` (a copy); MutantError unless its text is there exactly once."""
    path = root / mutant.path
    found = occurrences(mutant, root)
    if found != 1:
        raise MutantError(f"{mutant.name}: its source text is found {found} times in {mutant.path} (must be once)")
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace(mutant.old, mutant.new), encoding="utf-8")


def project_files(root: Path = ROOT) -> list[str]:
    """The working tree's files: tracked ones and untracked ones git does not ignore (a deleted file left out)."""
    listing = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
                             check=True, capture_output=True).stdout.decode()
    return sorted({name for name in listing.split("\0") if name and os.path.lexists(root / name)})


def copy_tree(dest: Path, root: Path = ROOT) -> Path:
    """A copy of the working tree under ``dest`` (``project_files``), links kept as links."""
    for name in project_files(root):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target, follow_symlinks=False)
    return dest


def install(copy: Path) -> None:
    """The copy installed into ``copy/_site`` (not editable, no dependencies: they are the venv's)."""
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(copy / SITE), str(copy)], cwd=copy, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip install failed ({done.returncode}):\n{(done.stderr or done.stdout)[-2000:]}")
    (copy / SITE / f"{GUARD_MODULE}.py").write_text(GUARD_SOURCE, encoding="utf-8")


def pytest_executable() -> str:
    """The venv's ``pytest`` (beside this interpreter), not ``python -m pytest``, which would put the copy's folder,
    whose ``cgist`` has no ``kernels``, first on ``sys.path``."""
    beside = Path(sys.executable).parent / "pytest"
    found = str(beside) if beside.is_file() else shutil.which("pytest")
    if found is None:
        raise SystemExit("no pytest executable beside the interpreter or on PATH")
    return found


def environment(copy: Path) -> dict[str, str]:
    """The runs' environment: offline, the copy's site folder alone on ``PYTHONPATH``, and the current folder first
    on ``sys.path`` of ``python -c`` (``CHECK_SOURCE`` drops it)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(copy / SITE))
    env.pop("PYTHONSAFEPATH", None)
    return env


def node_id(case: ET.Element) -> str:
    """A junit (xunit1) test case as pytest's node id."""
    name, path, classname = case.get("name", ""), case.get("file"), case.get("classname", "")
    if not path:  # a collection error: its name is the module
        return f"{classname}::{name}" if classname else name
    module = path[:-3].replace("/", ".") if path.endswith(".py") else path
    inner = classname[len(module) + 1:].replace(".", "::") if classname.startswith(module + ".") else ""
    return "::".join(part for part in (path, inner, name) if part)


def read_report(report: Path) -> tuple[list[str], int]:
    """The failing test ids (failures and errors, in order, each once) and the number of tests that passed."""
    if not report.is_file():
        return [], 0
    failing, passed = [], 0
    for case in ET.parse(report).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            node = node_id(case)
            if node not in failing:
                failing.append(node)
        elif "skipped" not in tags:
            passed += 1
    return failing, passed


@dataclass
class Outcome:
    """One mutant's run: ``status`` is killed, survived, timeout, error (the run itself failed) or missing (its text
    was not found in the copy)."""

    mutant: Mutant | None
    status: str
    seconds: float
    failing: list[str] = field(default_factory=list)
    passed: int = 0
    detail: str = ""


def run_tests(copy: Path, runner: list[str], tests: list[str], timeout: float) -> tuple[int | None, str, Path]:
    """pytest over ``tests`` (all when empty) in ``copy``: the exit status (None on timeout), the output's tail and the
    junit report."""
    env = environment(copy)
    check = subprocess.run([sys.executable, "-c", CHECK_SOURCE, str(copy / SITE)], cwd=copy, env=env,
                           capture_output=True, text=True)
    if check.returncode != 0:
        return 3, (check.stderr or check.stdout).strip(), copy / "_mutants_report.xml"
    report = copy / "_mutants_report.xml"
    command = [pytest_executable(), *runner, "-p", "no:cacheprovider", "--no-cov", "-p", GUARD_MODULE,
               f"--junitxml={report}", "-o", "junit_family=xunit1", *tests]  # a mutant's run measures no coverage
    process = subprocess.Popen(command, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the run's own process group: pytest and its workers
        output, _ = process.communicate()
        return None, output[-2000:], report
    return process.returncode, output[-2000:], report


def run_one(mutant: Mutant | None, runner: list[str], tests: list[str], timeout: float, keep: bool) -> Outcome:
    """Copy, mutate (``mutant`` None: the unmodified baseline), install and test; the copy is removed unless
    ``keep``."""
    start = time.perf_counter()
    copy = Path(tempfile.mkdtemp(prefix=f"cgist-mutant-{mutant.name if mutant else 'baseline'}-"))
    try:
        copy_tree(copy)
        if mutant is not None:
            try:
                apply(mutant, copy)
            except MutantError as error:
                return Outcome(mutant, "missing", time.perf_counter() - start, detail=str(error))
        try:
            install(copy)
        except RuntimeError as error:
            return Outcome(mutant, "error", time.perf_counter() - start, detail=str(error))
        status, tail, report = run_tests(copy, runner, tests, timeout)
        failing, passed = read_report(report)
        seconds = time.perf_counter() - start
        if status is None:
            return Outcome(mutant, "timeout", seconds, failing, passed, detail=f"stopped after {timeout:.0f} s")
        if status == 0:
            return Outcome(mutant, "survived", seconds, failing, passed)
        if status in (1, 2) and failing:  # 2: a test module failed to import (collection errors)
            return Outcome(mutant, "killed", seconds, failing, passed)
        return Outcome(mutant, "error", seconds, failing, passed, detail=f"pytest exited {status}:\n{tail}")
    finally:
        if keep:
            print(f"  (copy kept: {copy})", flush=True)
        else:
            shutil.rmtree(copy, ignore_errors=True)


def discount(outcome: Outcome, known: set[str]) -> Outcome:
    """A mutant's outcome without the tests that fail on the unmodified copy too: killed only by those, it survived."""
    if outcome.status != "killed" or not known:
        return outcome
    failing = [node for node in outcome.failing if node not in known]
    status = "killed" if failing else "survived"
    return Outcome(outcome.mutant, status, outcome.seconds, failing, outcome.passed, outcome.detail)


def line(outcome: Outcome) -> str:
    name, status = (outcome.mutant.name, outcome.status) if outcome.mutant else (
        "(baseline: no mutant)", {"survived": "passed", "killed": "failing"}.get(outcome.status, outcome.status))
    text = f"{status:<9} {name:<28} {outcome.seconds:7.1f} s"
    if outcome.failing:
        shown = ", ".join(outcome.failing[:SHOWN])
        more = f" (+{len(outcome.failing) - SHOWN} more)" if len(outcome.failing) > SHOWN else ""
        text += f"  {len(outcome.failing)} failing: {shown}{more}"
    elif outcome.status == "survived":
        text += f"  ({outcome.passed} passed)"
    if outcome.detail:
        text += "\n    " + outcome.detail.replace("\n", "\n    ")
    return text


def list_mutants(mutants: list[Mutant]) -> int:
    """The table, each mutant checked against the tree; 2 if one's text is not there exactly once."""
    bad = 0
    for mutant in mutants:
        found = occurrences(mutant, ROOT)
        bad += found != 1
        state = "ok" if found == 1 else f"FOUND {found} TIMES"
        print(f"{mutant.name:<28} {state:<14} {mutant.path}\n    {mutant.bug}\n    --quick: {' '.join(mutant.tests)}")
    return 2 if bad else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="run only each mutant's own test files")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these mutants only (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants, checked against the tree, and exit")
    parser.add_argument("--pytest-args", default=DEFAULT_PYTEST_ARGS,
                        help=f"the runner's options, one string (default: {DEFAULT_PYTEST_ARGS!r}); write "
                             "--pytest-args='-q' when it is a single option")
    parser.add_argument("--baseline", action="store_true",
                        help="first run the same tests on an unmodified copy; tests failing there kill nothing")
    parser.add_argument("--keep", action="store_true", help="keep each copy (its path is printed)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per test run")
    args = parser.parse_args()

    try:
        mutants = [mutant_named(name) for name in args.only] if args.only else list(MUTANTS)
    except KeyError as error:
        parser.error(error.args[0])
    if args.list:
        sys.exit(list_mutants(mutants))
    missing = [m for m in mutants if occurrences(m, ROOT) != 1]
    if missing:
        for mutant in missing:
            print(f"missing   {mutant.name}: its source text is found {occurrences(mutant, ROOT)} times in "
                  f"{mutant.path} (must be once)", file=sys.stderr)
        sys.exit(2)

    runner = shlex.split(args.pytest_args)
    selection = {m.name: list(m.tests) if args.quick else [] for m in mutants}
    known: set[str] = set()
    if args.baseline:
        tests = sorted({t for chosen in selection.values() for t in chosen})
        control = run_one(None, runner, tests, args.timeout, args.keep)
        print(line(control), flush=True)
        if control.status not in ("killed", "survived"):
            sys.exit(1)
        known = set(control.failing)
    outcomes = []
    for mutant in mutants:
        outcome = discount(run_one(mutant, runner, selection[mutant.name], args.timeout, args.keep), known)
        outcomes.append(outcome)
        print(line(outcome), flush=True)

    by_status: dict[str, list[str]] = {}
    for outcome in outcomes:
        by_status.setdefault(outcome.status, []).append(outcome.mutant.name)
    counts = ", ".join(f"{len(names)} {status}" for status, names in by_status.items())
    print(f"\n{len(outcomes)} mutants{' (--quick)' if args.quick else ''}: {counts}")
    for status in ("survived", "timeout", "error", "missing"):
        if status in by_status:
            print(f"  {status}: {', '.join(by_status[status])}")
    sys.exit(2 if "missing" in by_status else 0 if set(by_status) <= {"killed"} else 1)


if __name__ == "__main__":
    main()
