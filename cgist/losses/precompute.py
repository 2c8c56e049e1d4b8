"""``add_guide_embeddings``: a guide model's embeddings of a dataset's texts, computed once, as its label column.

``FusedCachedGISTLoss(model, "labels")`` then reads them off each batch instead of running the guide, so the guide
model need not be loaded while training.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch
from datasets import Dataset, Value, concatenate_datasets
from datasets.table import InMemoryTable
from sentence_transformers import SentenceTransformer
from sentence_transformers.multi_vector_encoder import MultiVectorEncoder
from sentence_transformers.util import batch_to_device
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

__all__ = ["LABEL_COLUMN", "add_guide_embeddings", "must_retokenize"]

#: The column the embeddings go to: sentence-transformers' data collator passes it to the loss as ``labels``.
LABEL_COLUMN = "label"
#: Column names sentence-transformers' data collator takes for the labels, the first one found winning; with any of
#: them beside the new column, that one would be tokenised as text or the new one ignored.
LABEL_COLUMNS = ("label", "labels", "score", "scores")
#: The precisions the column may hold, as NumPy and Arrow value types. sentence-transformers' collator turns rows
#: of Python floats into a tensor of torch's default dtype (float32); float64 reaches the loss from a dataset in
#: torch format (``dataset.with_format("torch", dtype=torch.float64)``, which leaves the texts as they are).
DTYPES = {torch.float32: (np.float32, pa.float32()), torch.float64: (np.float64, pa.float64())}


def must_retokenize(model: SentenceTransformer, guide: SentenceTransformer) -> bool:
    """Whether ``CachedGISTEmbedLoss(model, guide)`` re-tokenises the student's texts for the guide.

    It does when the two vocabularies differ or the guide reads fewer tokens than the student; otherwise the guide
    runs on the student's own token ids.
    """
    return model.tokenizer.get_vocab() != guide.tokenizer.get_vocab() or guide.max_seq_length < model.max_seq_length


def _check_tokenizer(name: str, model: SentenceTransformer) -> None:
    tokenizer = getattr(model, "tokenizer", None)
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"{name} must have a transformers tokenizer (model.tokenizer), got "
                        f"{type(tokenizer).__name__}")


def _text_columns(dataset: Dataset, columns: Sequence[str] | None) -> list[str]:
    """The columns to embed, checked: names of string columns of ``dataset``, each once."""
    if columns is None:
        columns = list(dataset.column_names)
    elif isinstance(columns, str) or not isinstance(columns, Sequence):
        raise TypeError(f"columns must be a list of column names or None, got {type(columns).__name__}")
    else:
        columns = list(columns)
    if not columns:
        raise ValueError("columns must name at least one column")
    for name in columns:
        if not isinstance(name, str):
            raise TypeError(f"columns must hold column names (str), got {type(name).__name__}")
        if name not in dataset.column_names:
            raise ValueError(f"columns: the dataset has no column {name!r}; it has {dataset.column_names}")
    if len(set(columns)) < len(columns):
        raise ValueError(f"columns names a column twice: {columns}")
    not_text = {name: dataset.features[name] for name in columns
                if not (isinstance(dataset.features[name], Value)
                        and dataset.features[name].dtype in ("string", "large_string"))}
    if not_text:
        listing = ", ".join(f"{name!r} ({feature})" for name, feature in not_text.items())
        raise ValueError(f"the guide embeds text columns, but {listing} hold other values; pass columns=[...] with the "
                         "text columns the loss sees, in their order")
    return columns


def _embed(guide: SentenceTransformer, model: SentenceTransformer | None, retokenize: bool, texts: list[str]) -> Tensor:
    """The guide's sentence embeddings of ``texts``, tokenised as the live loss does (see ``add_guide_embeddings``)."""
    if model is None:
        features = guide.preprocess(texts)
    else:
        features = model.preprocess(texts)
        if retokenize:
            # The guide sees the text the student's tokens spell (its truncation included), not the raw text.
            features = guide.preprocess(model.tokenizer.batch_decode(features["input_ids"], skip_special_tokens=True))
    return guide(batch_to_device(features, guide.device))["sentence_embedding"]


def add_guide_embeddings(
    dataset: Dataset,
    guide: SentenceTransformer,
    *,
    model: SentenceTransformer | MultiVectorEncoder | None = None,
    columns: Sequence[str] | None = None,
    batch_size: int = 64,
    dtype: torch.dtype = torch.float32,
    show_progress_bar: bool = True,
) -> Dataset:
    """``dataset`` with a ``label`` column of ``guide``'s embeddings of its text columns, for
    ``FusedCachedGISTLoss(model, "labels")``.

    Each row's label is a ``len(columns) x Dg`` list of lists: the guide's sentence embedding of each of the row's
    texts, in the order of ``columns``, rounded to ``dtype``, not normalised (the loss normalises).
    sentence-transformers' data collator stacks the labels of a batch into the ``(batch, n_columns, Dg)`` tensor that
    ``guide="labels"`` expects. The guide runs in eval mode under ``torch.no_grad`` (its mode is restored after),
    ``batch_size`` rows at a time; the embeddings are held in memory until the column is built (rows x columns x Dg
    values of ``dtype``).

    With ``model``, the texts are tokenised exactly as ``CachedGISTEmbedLoss(model, guide)`` has the guide see them
    in training, so the labels are the live guide's embeddings up to rounding: the guide runs on the student's
    tokenisation (``model.preprocess``, truncated at ``model.max_seq_length``), or, when the vocabularies differ or
    ``guide.max_seq_length < model.max_seq_length``, on the student's tokens decoded without special tokens and
    tokenised again by ``guide.preprocess``; a MultiVectorEncoder student's tokens are always decoded, as the guided
    multi-vector losses have the guide read them (``FusedCachedMultiVectorGISTLoss(model, "labels")``). Without
    ``model``, the guide tokenises the texts itself. Prompts and a
    Router's task mapping, which the trainer may add to the student's inputs, are not applied.

    Args:
        dataset: a ``datasets.Dataset`` of text columns, without a label column.
        guide: the guide model.
        model: the student the labels are for (a SentenceTransformer or a MultiVectorEncoder); None to let the
            guide tokenise the texts itself.
        columns: the text columns in the order the loss sees them. None: every column, in the dataset's order,
            which is how sentence-transformers' trainer feeds them; every one must then hold strings.
        batch_size: rows embedded at once.
        dtype: ``torch.float32`` or ``torch.float64``, the precision the column holds.
        show_progress_bar: show a progress bar over the rows.

    Returns:
        A new ``Dataset``: ``dataset``'s columns and rows, plus ``label``.

    Raises:
        TypeError, ValueError: for a bad argument, naming it, before the guide runs.

    Example:
        ::

            guide = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
            train_dataset = cgist.add_guide_embeddings(train_dataset, guide, model=model)
            del guide  # training needs only the student
            loss = cgist.FusedCachedGISTLoss(model, "labels", mini_batch_size=64, margin=0.05)
    """
    columns = _check_arguments(dataset, guide, model, columns, batch_size, dtype, show_progress_bar)
    embeddings = _guide_embeddings(dataset, guide, model, columns, batch_size, dtype, show_progress_bar)
    label = _label_column(embeddings, dtype)
    return concatenate_datasets([dataset, Dataset(InMemoryTable(pa.table({LABEL_COLUMN: label})))], axis=1)


def _check_arguments(dataset: object, guide: object, model: object, columns: object, batch_size: object,
                     dtype: object, show_progress_bar: object) -> list[str]:
    """``add_guide_embeddings``'s arguments checked before the guide runs: the types and scalars first, then the
    dataset's label and text columns and the tokenizers. Returns the text columns to embed."""
    if not isinstance(dataset, Dataset):
        raise TypeError(f"dataset must be a datasets.Dataset (one split; map a DatasetDict split by split), got "
                        f"{type(dataset).__name__}")
    if not isinstance(guide, SentenceTransformer):
        raise TypeError(f"guide must be a SentenceTransformer, got {type(guide).__name__}")
    if model is not None and not isinstance(model, (SentenceTransformer, MultiVectorEncoder)):
        raise TypeError(f"model must be a SentenceTransformer, a MultiVectorEncoder or None, got "
                        f"{type(model).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
        raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
    if not isinstance(show_progress_bar, bool):
        raise TypeError(f"show_progress_bar must be a bool, got {type(show_progress_bar).__name__}")
    taken = [name for name in LABEL_COLUMNS if name in dataset.column_names]
    if taken:
        raise ValueError(f"the dataset already has a label column, {taken[0]!r}: sentence-transformers' collator "
                         f"passes one of {list(LABEL_COLUMNS)} to the loss, and the guide embeddings go to "
                         f"{LABEL_COLUMN!r}; remove or rename it first")
    if len(dataset) == 0:
        raise ValueError("the dataset is empty: there is nothing to embed")
    columns = _text_columns(dataset, columns)
    if model is not None:
        _check_tokenizer("model", model)
        _check_tokenizer("guide", guide)
    return columns


def _guide_embeddings(dataset: Dataset, guide: SentenceTransformer, model: SentenceTransformer | None,
                      columns: list[str], batch_size: int, dtype: torch.dtype, show_progress_bar: bool) -> np.ndarray:
    """The guide's embeddings of ``columns``, ``(rows, len(columns), Dg)`` in ``dtype``'s NumPy type, checked finite;
    the guide runs in eval mode under ``torch.no_grad``, its mode restored after."""
    retokenize = model is not None and (isinstance(model, MultiVectorEncoder) or must_retokenize(model, guide))
    rows, texts_only = len(dataset), dataset.select_columns(columns)
    out: np.ndarray | None = None
    was_training = guide.training
    guide.eval()
    try:
        with torch.no_grad(), tqdm(total=rows, desc="Guide embeddings", unit="row",
                                   disable=not show_progress_bar) as progress:
            for begin in range(0, rows, batch_size):
                batch = texts_only[begin:begin + batch_size]
                for c, name in enumerate(columns):
                    texts = batch[name]
                    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
                    if bad is not None:
                        raise ValueError(f"row {begin + bad}, column {name!r} holds {texts[bad]!r}, not a text")
                    embeddings = _embed(guide, model, retokenize, texts).to(device="cpu", dtype=dtype).numpy()
                    if out is None:
                        out = np.empty((rows, len(columns), embeddings.shape[1]), dtype=DTYPES[dtype][0])
                    out[begin:begin + len(texts), c] = embeddings
                progress.update(len(texts))
    finally:
        guide.train(was_training)
    if not np.isfinite(out).all():
        raise ValueError("the guide's embeddings of this dataset contain NaN or infinite values (in the precision "
                         f"{dtype}); check the guide model")
    return out


def _label_column(embeddings: np.ndarray, dtype: torch.dtype) -> pa.FixedSizeListArray:
    """The label column of ``embeddings``: fixed-size lists, Dg values per text column and the text columns per row,
    straight from the buffer (no Python floats), as ``dtype``."""
    values = pa.array(embeddings.reshape(-1), type=DTYPES[dtype][1])
    return pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(values, embeddings.shape[2]),
                                             embeddings.shape[1])
