"""The drop-ins' own options: the one table (``OPTIONS``) that every drop-in's keyword-only constructor arguments,
class-level defaults, options cache key and configuration are derived from, and docs/losses.md#cgists-own-options
renders (``markdown_table``).

An option is read at each call like sentence-transformers' attributes; one that is also a field of
``cgist.GistOptions`` (``field``) reaches the loss stage by that name. Adding an option to the drop-ins is one
``Option`` here plus its field in ``GistOptions`` (docs/design.md#the-drop-in-protocol).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..stage.dispatch.route import requested_backend

__all__ = ["EVERY_FAMILY", "OPTIONS", "Option", "markdown_table", "options_of"]

#: The option families: ``"gist"`` (the guided drop-ins), ``"ranking"`` (the ranking drop-ins), ``"multi_vector"``
#: (the late-interaction drop-ins) and ``"multi_vector_gist"`` (the guided late-interaction drop-ins).
EVERY_FAMILY = ("gist", "ranking", "multi_vector", "multi_vector_gist")


def _bool_or_none(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool or None, got {type(value).__name__}")


@dataclass(frozen=True)
class Option:
    """One of cgist's own options of the drop-ins.

    ``check(name, value)`` raises, naming the option, for a bad value (None: ``GistOptions`` checks it, by the same
    name); ``field``: a ``GistOptions`` field of the same name; ``families``: the drop-in families that take it;
    ``annotation``: its type, as the constructor's signature shows it; ``example``: a valid value that changes the loss stage's arguments from those of the default, for a GIST drop-in
    guided by ``"self"`` without its contrast blocks and for a ranking drop-in (the tests assign it).
    """

    name: str
    default: object
    doc: str
    example: object
    families: tuple[str, ...] = EVERY_FAMILY
    field: bool = True
    check: Callable[[str, object], None] | None = None
    annotation: str = ""


OPTIONS = (
    Option("backend", "auto", "`\"auto\"` (the Triton kernels on GPUs they support, the PyTorch path elsewhere), "
           "`\"torch\"` or `\"triton\"`", example="torch", field=False,
           check=lambda name, value: requested_backend(value), annotation="Literal['auto', 'torch', 'triton']"),
    Option("block_bytes", None, "bytes of score buffers the loss stage may hold at once; None: a default for the "
           "device (at most an eighth of its free memory and 1 GiB)", example=2**20, annotation="int | None"),
    Option("mask_self", None, "always exclude the self-pairs AA[i, i] and PP[i, i]; None: for GIST the installed "
           "sentence-transformers' rule with a guide's own embeddings, on with `\"self\"` and None; for "
           "multi-vector GIST on", example=False, families=("gist", "multi_vector_gist"), check=_bool_or_none,
           annotation="bool | None"),
    Option("mask_duplicates", None, "exclude every candidate whose text is the anchor's or its positive's, whatever "
           "the scores; None: off with a guide's own embeddings, on with `\"self\"`, and with None on for GIST, off "
           "for multi-vector GIST (which is then sentence-transformers' multi-vector ranking loss)", example=False,
           families=("gist", "multi_vector_gist"), check=_bool_or_none, annotation="bool | None"),
    Option("directions", ("query_to_doc",), "sentence-transformers' `MultipleNegativesRankingLoss` directions, each "
           "block masked by the guide", example=("query_to_doc", "doc_to_query"), families=("gist",),
           annotation="tuple[str, ...]"),
    Option("partition_mode", "joint", "`\"joint\"` (one softmax over every block) or `\"per_direction\"` (the mean "
           "of each direction's log-sum-exp)", example="per_direction", families=("gist",),
           annotation="Literal['joint', 'per_direction']"),
    Option("hardness_mode", None, "the query-to-document logits that get `hardness_strength * stop_grad(cos)`: "
           "`\"in_batch_negatives\"`, `\"hard_negatives\"` or `\"all_negatives\"`", example="all_negatives",
           families=("gist",), annotation="str | None"),
    Option("hardness_strength", 0.0, "the hardness penalty's weight, not divided by the temperature", example=0.5,
           families=("gist",), annotation="float"),
)


def options_of(family: str) -> Iterator[Option]:
    """The options a drop-in of ``family`` takes, in the table's order."""
    return (option for option in OPTIONS if family in option.families)


def markdown_table() -> str:
    """The table as docs/losses.md shows it: name, default, the drop-ins that take it, what it does."""
    names = {"gist": "GIST", "ranking": "ranking", "multi_vector": "multi-vector",
             "multi_vector_gist": "multi-vector GIST"}
    rows = [f"| `{o.name}` | `{o.default!r}` | {', '.join(names[f] for f in o.families)} | {o.doc} |" for o in OPTIONS]
    return "\n".join(["| option | default | drop-ins | what it does |", "|---|---|---|---|", *rows])
