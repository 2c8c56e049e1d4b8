"""Shared benchmark setup: the embedding factory, timers, peak-memory probes and the CSV writer.

Every benchmark in ``bench/`` times and measures memory on inputs from :func:`make_embeddings`, so
speed and memory rows describe the same work. Rows follow :data:`FIELDS` (plus a trailing ``note``).

CPU peak memory is the resident-set high-water mark of the measuring process above a baseline taken
after setup: :func:`reset_peak_rss` rewinds the kernel's high-water mark (``/proc/self/clear_refs``)
so that allocations made while building the inputs do not hide the run's own peak. CUDA peak memory
is ``torch.cuda.max_memory_allocated`` above the memory already allocated after setup.
"""

from __future__ import annotations

import csv
import gc
import math
import resource
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

#: Column order of every benchmark CSV; a free-text ``note`` (why a row was skipped) may follow.
FIELDS = ("impl", "op", "B", "N", "D", "Dg", "k", "dtype", "device", "median_ms", "p20_ms", "p80_ms", "peak_mb", "version")
NOTE = "note"
MB = 2**20


def make_embeddings(
    batch: int,
    n_cand: int,
    dim: int,
    guide_dim: int,
    negatives: int,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    latent: int = 64,
) -> tuple[list[Tensor], list[Tensor]]:
    """Student columns ``[anchor B x D, positive N x D, *negatives N x D]`` and guide columns in ``guide_dim``.

    Rows are unit vectors scaled by a factor in [0.9, 1.1] ("normalised-ish", as model outputs are).
    Student and guide embed the same hidden texts (random ``latent``-dim codes) through different random
    projections, so their similarities agree: positive i is a noisy copy of anchor i, each negative a
    noisier one, and candidates past B are unrelated. Deterministic for a given ``seed`` and device.
    """
    if not 1 <= batch <= n_cand:
        raise ValueError(f"batch must be in [1, n_cand={n_cand}], got {batch}")
    if negatives < 0:
        raise ValueError(f"negatives must be >= 0, got {negatives}")
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    anchor = randn(batch, latent)
    codes = [anchor] + [
        torch.cat([anchor + noise * randn(batch, latent), randn(n_cand - batch, latent)])
        for noise in [0.6] + [1.2] * negatives
    ]

    def embed(width: int) -> list[Tensor]:
        proj = randn(latent, width) / math.sqrt(latent)
        cols = []
        for code in codes:
            x = code @ proj + 0.3 * randn(code.shape[0], width)
            scale = 0.9 + 0.2 * torch.rand(code.shape[0], 1, generator=gen, device=device)
            cols.append((x * (scale / x.norm(dim=1, keepdim=True))).to(dtype))
        return cols

    return embed(dim), embed(guide_dim)


def split_leaves(columns: Sequence[Tensor], mini_batch_size: int) -> list[list[Tensor]]:
    """GradCache layout: each column cut into mini-batch leaf tensors that require grad."""
    return [[part.detach().requires_grad_() for part in col.split(mini_batch_size)] for col in columns]


def split_detached(columns: Sequence[Tensor], mini_batch_size: int) -> list[list[Tensor]]:
    """Guide layout: each column cut into mini-batches without grad."""
    return [[part.detach() for part in col.split(mini_batch_size)] for col in columns]


def quantiles_ms(seconds: Sequence[float]) -> tuple[float, float, float]:
    """``(median, p20, p80)`` in milliseconds of per-call times given in seconds."""
    ms = sorted(s * 1e3 for s in seconds)
    if len(ms) == 1:
        return ms[0], ms[0], ms[0]
    p20, *_, p80 = statistics.quantiles(ms, n=5, method="inclusive")
    return statistics.median(ms), p20, p80


def time_cpu(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """``(median, p20, p80)`` ms of ``repeats`` calls timed with ``perf_counter`` (warm up before calling)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return quantiles_ms(times)


def time_cuda(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> tuple[float, float, float]:
    """``(median, p20, p80)`` ms from ``triton.testing.do_bench`` (it warms up and flushes L2 itself)."""
    from triton.testing import do_bench

    median, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return median, p20, p80


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> float:
    """Rewind the RSS high-water mark to the current RSS; return that baseline in MB.

    Uses Linux's ``/proc/self/clear_refs``. Where that is unavailable the baseline is the lifetime
    peak (``ru_maxrss``), so a run that stays under an earlier peak reports 0.
    """
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        rss = _status_kb("VmRSS")
        if rss is not None and _status_kb("VmHWM") == rss:
            return rss / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_mb() -> float:
    """RSS high-water mark of this process in MB (since the last :func:`reset_peak_rss`)."""
    hwm = _status_kb("VmHWM")
    return (hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024


def measure_once(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """Run ``fn`` once; return ``(seconds, peak MB above what was resident/allocated before it)``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) / MB
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start, torch.cuda.max_memory_allocated(device) / MB - base
    base = reset_peak_rss()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, max(0.0, peak_rss_mb() - base)


def write_csv(path: str | Path, rows: Iterable[Mapping[str, object]]) -> Path:
    """Write rows with the :data:`FIELDS` columns first and ``note`` last; floats to 3 decimals."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*FIELDS, NOTE], extrasaction="raise")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in row.items()})
    return path


def read_csv(path: str | Path) -> list[dict[str, str]]:
    """Rows of a CSV written by :func:`write_csv`, as strings."""
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def _measuring_child(measure: Callable, point: object, settings: object, conn) -> None:
    """Entry point of a measuring process: sends ("ok", row) or ("error", message)."""
    try:
        conn.send(("ok", measure(point, settings)))
    except BaseException as err:  # report everything, MemoryError included, to the parent
        traceback.print_exc()
        conn.send(("error", f"{type(err).__name__}: {err}".splitlines()[0][:200]))
    finally:
        conn.close()


def measure_in_subprocess(ctx, measure: Callable, point: object, settings: object,
                          timeout_s: float) -> dict[str, object] | str:
    """Run ``measure(point, settings)`` in a fresh process of ``ctx`` (a multiprocessing context), so that its peak
    RSS is its own; return its row, or a note saying why there is none."""
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_measuring_child, args=(measure, point, settings, send), daemon=True)
    proc.start()
    send.close()
    status, payload = "error", None
    try:
        if not recv.poll(timeout_s):
            proc.kill()
            return f"failed: no result within {timeout_s:.0f} s"
        status, payload = recv.recv()
    except EOFError:
        pass
    finally:
        proc.join()
        recv.close()
    if status == "ok":
        return payload
    if payload is None:
        return f"failed: measuring process died with exit code {proc.exitcode} (out of memory?)"
    return f"failed: {payload}"


def available_mb() -> float:
    """The host's available memory in MB (``cgist.stage.devices.free_bytes``: MemAvailable, or physical memory)."""
    from cgist.stage.devices import free_bytes

    return free_bytes(torch.device("cpu")) / 2**20
