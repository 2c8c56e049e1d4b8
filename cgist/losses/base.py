"""What every fused drop-in shares: the loss stage of a GradCache step over the cached mini-batch embeddings
(``fused_loss_stage``; the texts' ids it masks duplicates by, and the equal batches that gathering across ranks
needs), the embedding stage's attributes checked, the options read off a drop-in's attributes at each call
(``FusedDropIn``) and the takeover of ``MatryoshkaLoss``'s decoration (``FusedMatryoshka``). The drop-ins are
``cgist.losses.gist`` (GIST) and ``cgist.losses.ranking``; this module imports neither."""

from __future__ import annotations

import logging
import numbers
import random
from collections.abc import Iterable

import torch
import torch.distributed as dist
from sentence_transformers.base.losses.gradcache import _validate_mini_batch_num_tokens
from sentence_transformers.util import all_gather, all_gather_with_grad, get_rank
from torch import Tensor

from ..compat import note_untested_release
from ..function import gist_loss_with_options
from ..stage.spec.options import GistOptions
from ..stage.stats import GistStats
from ..stage.ties import token_fingerprints

__all__ = ["FUSED", "PATHS", "UNFUSED", "FusedDropIn", "FusedMatryoshka"]

logger = logging.getLogger(__name__)

#: The two paths that compute a drop-in's loss: cgist's fused loss stage, or sentence-transformers' own code where the
#: fused stage does not compute what the attributes ask (``FusedDropIn.resolve``).
FUSED, UNFUSED = "fused", "sentence-transformers"
PATHS = (FUSED, UNFUSED)


def text_fingerprints(features: list[dict[str, Tensor]], needed: bool) -> list[Tensor] | None:
    """A key per text of each column's features, from its token ids and attention mask (or packed lengths): what
    decides the guide's ties and the duplicates (``cgist.stage.ties.tie_ids``). None when a column has no token ids
    (then equal guide vectors decide the ties), which is an error when ``needed`` (``mask_duplicates``)."""
    if not all("input_ids" in feature for feature in features):
        if needed:
            raise ValueError("mask_duplicates compares texts by their token ids, but these features have no "
                             "'input_ids'; pass mask_duplicates=False")
        return None
    return [_column_fingerprints(feature) for feature in features]


def _column_fingerprints(feature: dict[str, Tensor]) -> Tensor:
    input_ids = feature["input_ids"]
    if "cu_seq_lens_q" in feature:  # packed: one row of all tokens, with cumulative lengths
        bounds = feature["cu_seq_lens_q"].tolist()
        input_ids = torch.nn.utils.rnn.pad_sequence([input_ids[0, a:b] for a, b in zip(bounds[:-1], bounds[1:])],
                                                    batch_first=True, padding_value=0)
        lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=input_ids.device)
        mask = torch.arange(input_ids.shape[1], device=input_ids.device) < lengths.unsqueeze(1)
        return token_fingerprints(input_ids, mask)
    return token_fingerprints(input_ids, feature.get("attention_mask"))


def fused_loss_stage(
    reps: list[list[Tensor]], guide: list | str | None, text_ids: list[Tensor] | None, options: GistOptions, *,
    backend: str, gather: bool, with_backward: bool, dims: tuple[tuple[int, float], ...] | None = None,
) -> tuple[Tensor, GistStats]:
    """The loss stage of a GradCache step: the loss over the cached mini-batch embeddings ``reps`` and its statistics.

    Each column stays a list of its mini-batches (the loss stage takes them as row chunks, so the embeddings are not
    concatenated into a copy). With ``gather`` the candidates are gathered with gradients from every rank, as
    sentence-transformers does, and so are the anchors when a direction scores against them; the guide's columns
    (``guide``: a list of the guide's columns, "self" or None) and the text ids go with them. ``dims`` are Matryoshka
    ``(d, w_d)`` pairs. With ``with_backward`` the embedding gradients are accumulated into the leaves' ``.grad``
    and the loss is returned detached.
    """
    anchors, *candidates = (list(r) for r in reps)
    if gather:
        batch = sum(r.shape[0] for r in anchors)
        check_equal_batches(batch, anchors[0].device)
        everyone = options.reads_anchors
        candidates = [all_gather_with_grad(torch.cat(c)) for c in candidates]
        if everyone:  # every rank's anchors, as one more column
            candidates.append(all_gather_with_grad(torch.cat(anchors)))
        if isinstance(guide, list):  # the guide model's mini-batches, or the label column's whole columns
            whole = [torch.cat(c) if isinstance(c, (list, tuple)) else c for c in guide]
            gathered = [all_gather_with_grad(c) for c in whole[1:]]
            guide = [guide[0], *gathered, *([all_gather_with_grad(whole[0])] if everyone else [])]
        if text_ids is not None:
            text_ids = [text_ids[0], *(all_gather(t) for t in text_ids[1:]), *([all_gather(text_ids[0])] if everyone else [])]
        options = options.replace(offset=get_rank() * batch, all_anchors=everyone)
    if dims is not None:
        # MatryoshkaLoss scores normalised prefixes (its ``shrink``), so even a dot-product loss scores cosines.
        options = options.replace(matryoshka_dims=tuple(d for d, _ in dims), matryoshka_weights=tuple(w for _, w in dims),
                                  similarity="cos")
    loss, stats = gist_loss_with_options([anchors, *candidates], guide, options, backend=backend, return_stats=True,
                                         text_ids=text_ids)
    if with_backward:
        loss.backward()
        loss = loss.detach()
    return loss, stats


def check_embedding_stage(mini_batch_size: object, mini_batch_num_tokens: object, gather_across_devices: object) -> None:
    """The embedding stage's attributes of every drop-in, checked; sentence-transformers' own check of
    ``mini_batch_num_tokens`` keeps its message."""
    for name, value, expected in (
        ("mini_batch_size", mini_batch_size, "an int"),
        ("mini_batch_num_tokens", mini_batch_num_tokens, "an int or None"),
    ):
        if value is None and name == "mini_batch_num_tokens":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    if mini_batch_size < 1:
        raise ValueError(f"mini_batch_size must be at least 1, got {mini_batch_size}")
    try:
        _validate_mini_batch_num_tokens(mini_batch_num_tokens)
    except ValueError as error:
        raise ValueError(f"{error} Got {mini_batch_num_tokens!r}.") from None
    check_gather(gather_across_devices)


def check_gather(gather_across_devices: object) -> None:
    """``gather_across_devices`` is a bool (every drop-in's; the plain ones have no other embedding-stage attribute)."""
    if not isinstance(gather_across_devices, bool):
        raise TypeError(f"gather_across_devices must be a bool, got {type(gather_across_devices).__name__}")


def attribute_key(obj: object, names: Iterable[str]) -> tuple:
    """The values of the attributes ``names`` of ``obj`` (None where one is missing), each with its type, so that
    ``1`` and ``True`` or ``0`` and ``0.0`` differ: what a drop-in's options are rebuilt on."""
    return tuple((type(value), value) for value in (getattr(obj, name, None) for name in names))


class FusedDropIn:
    """What the fused drop-ins share: sentence-transformers' attributes are the options.

    The subclass (a sentence-transformers loss) keeps every hyperparameter as the attribute that
    sentence-transformers defines, and cgist's own (``backend``, ``block_bytes``, ...) beside them, with class-level
    defaults so that a loss built by ``__new__`` with its attributes set by hand has them too. At each call,
    ``resolve`` reads them: the ``GistOptions`` of the fused loss stage, validated and cached, rebuilt only when one
    of the attributes in ``options_key`` changed; or None when the fused stage does not compute what they ask for,
    and sentence-transformers' own loss computation runs instead (with one warning per loss object).
    """

    backend: str = "auto"
    block_bytes: int | None = None
    last_stats: GistStats | None = None
    #: The path of the last loss computation: ``FUSED`` (cgist's loss stage) or ``UNFUSED`` (sentence-transformers'
    #: own code); None before the first.
    last_path: str | None = None
    #: cgist's own constructor arguments and their defaults: ``get_config_dict`` lists those that differ.
    OWN_DEFAULTS: dict[str, object] = {"backend": "auto", "block_bytes": None}

    def __setattr__(self, name: str, value: object) -> None:
        # MatryoshkaLoss decorates a gradient-cache loss by replacing its ``calculate_loss`` with a loop over
        # dimensions; take that decoration over and compute the dimensions in one pass instead.
        if name == "calculate_loss":
            value = FusedMatryoshka.take_over(self, value)
        super().__setattr__(name, value)

    def record_path(self, path: str, stats: GistStats | None = None) -> None:
        """Note which path computed this loss (``FUSED`` or ``UNFUSED``) and the fused stage's statistics (None on
        the unfused path): ``last_path``, ``last_stats`` and the running counts of ``path_counts``."""
        self.last_path, self.last_stats = path, stats
        counts = self.__dict__.setdefault("_path_counts", dict.fromkeys(PATHS, 0))  # past nn.Module.__setattr__
        counts[path] += 1

    @property
    def path_counts(self) -> dict[str, int]:
        """How many loss computations each path ran since this drop-in was built: ``{FUSED: n, UNFUSED: m}``. Under
        ``MatryoshkaLoss`` a fused step is one computation, an unfused one a computation per dimension."""
        return dict(self.__dict__.get("_path_counts", dict.fromkeys(PATHS, 0)))

    def options_key(self) -> tuple:
        """The attribute values the options are built from (``attribute_key``)."""
        raise NotImplementedError

    def build_options(self) -> tuple[GistOptions | None, str | None]:
        """The attributes checked: the fused stage's options, or None and the reason it does not compute them."""
        raise NotImplementedError

    def resolve(self) -> GistOptions | None:
        """The options of the next loss stage, from the attributes as they are now; None when sentence-transformers'
        own loss computation runs instead. A bad attribute raises here, with the constructor's error."""
        key = self.options_key()
        cached = self.__dict__.get("_resolved")
        if cached is None:  # this drop-in's first options: name an untested sentence-transformers, once per process
            note_untested_release()
        if cached is None or cached[0] != key:
            cached = (key, self.build_options())
            self.__dict__["_resolved"] = cached  # past nn.Module.__setattr__: the cache is no attribute
        options, reason = cached[1]
        if options is None and not self.__dict__.get("_warned_unfused"):
            self.__dict__["_warned_unfused"] = True
            logger.warning("%s runs sentence-transformers' own loss computation instead of the fused loss stage "
                           "(the same loss and gradients, with its time and memory): %s. This warning is shown once.",
                           type(self).__name__, reason)
        return options

    @property
    def options(self) -> GistOptions | None:
        """The fused loss stage's options for the attributes as they are now (None when it does not run)."""
        return self.resolve()

    def own_config(self) -> dict[str, object]:
        """cgist's own arguments that differ from their defaults, for ``get_config_dict``."""
        return {name: getattr(self, name) for name, default in self.OWN_DEFAULTS.items()
                if getattr(self, name) != default}


def check_equal_batches(batch_size: int, device: torch.device) -> None:
    """With gathering, every rank must hold the same number of anchors, or the offsets would be wrong.

    The sizes travel on ``device``, the embeddings' own, which the process group can reach.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    sizes = [torch.zeros((), dtype=torch.long, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor(batch_size, device=device))
    sizes = [int(s) for s in sizes]
    if len(set(sizes)) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
        raise ValueError(
            f"gather_across_devices=True needs the same local batch size on every rank, got {listing} rows; "
            "use a sampler that gives every rank full batches (e.g. drop_last / dataloader_drop_last=True)"
        )



class FusedMatryoshka:
    """``calculate_loss`` of a fused drop-in under ``MatryoshkaLoss``: every dimension in one pass.

    It stands in for sentence-transformers' ``CachedLossDecorator`` and reads its attributes (``fn``,
    ``matryoshka_dims``, ``matryoshka_weights``, ``n_dims_per_step``) at each call. Each call picks the dimensions
    with the same random call as that decorator (``random.sample`` over the dimension indices when
    ``n_dims_per_step`` is below their number), then computes ``sum_d w_d * L_d`` and its gradients in one loss-stage
    call. When the loss's attributes ask for what the fused stage does not compute, the decorator itself runs, a
    loss per dimension, as in sentence-transformers.
    """

    def __init__(self, loss: FusedDropIn, decorator: object) -> None:
        self.loss = loss
        self.decorator = decorator

    def __getattr__(self, name: str) -> object:
        if name in ("fn", "matryoshka_dims", "matryoshka_weights", "n_dims_per_step"):
            return getattr(self.decorator, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @staticmethod
    def take_over(loss: FusedDropIn, value: object) -> object:
        """``value`` replaced by a ``FusedMatryoshka`` if it is the Matryoshka decoration of ``loss``'s own method.

        Anything else (another wrapper, or a decorator whose shape has changed) is kept as it is: the loss then
        runs once per dimension, as in sentence-transformers, which is slower but the same.
        """
        try:
            from sentence_transformers.sentence_transformer.losses.matryoshka import CachedLossDecorator
        except ImportError:
            return value
        fn = getattr(value, "fn", None)
        if not (isinstance(value, CachedLossDecorator) and getattr(fn, "__self__", None) is loss
                and getattr(fn, "__func__", None) is getattr(type(loss), "calculate_loss", None)
                and all(hasattr(value, a) for a in ("matryoshka_dims", "matryoshka_weights", "n_dims_per_step"))):
            return value
        return FusedMatryoshka(loss, value)

    def __call__(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]] | Tensor | None = None, *,
                 with_backward: bool = False) -> Tensor:
        """``calculate_loss`` over the sampled dimensions; ``reps_guided`` is the GIST loss's guide embeddings, or the
        labels of the ranking losses (unused)."""
        if self.loss.resolve() is None and (with_backward or not torch.is_grad_enabled()):
            return self.decorator(reps, reps_guided, with_backward=with_backward)
        dims, weights = self.decorator.matryoshka_dims, self.decorator.matryoshka_weights
        indices: range | list[int] = range(len(dims))
        if 0 < self.decorator.n_dims_per_step < len(indices):
            indices = random.sample(indices, self.decorator.n_dims_per_step)
        chosen = tuple((dims[i], float(weights[i])) for i in indices)
        if self.loss.resolve() is None:
            return self._per_dimension(reps, reps_guided, chosen)
        return self.loss._loss_stage(reps, reps_guided, with_backward=with_backward, dims=chosen)

    def _per_dimension(self, reps: list[list[Tensor]], reps_guided: object,
                       chosen: tuple[tuple[int, float], ...]) -> Tensor:
        """A plain drop-in's unfused loss under ``MatryoshkaLoss``, differentiable: sentence-transformers' loop over
        the dimensions (ascending, as it sorts the sampled ones), each on the embeddings truncated and normalised by
        its ``shrink``. (Its cached-loss decorator expects each dimension's gradients in the leaves instead.)"""
        from sentence_transformers.sentence_transformer.losses.matryoshka import shrink

        loss = 0.0
        for dim, weight in sorted(chosen, key=lambda pair: self.decorator.matryoshka_dims.index(pair[0])):
            truncated = [[shrink(r, dim) for r in column] for column in reps]
            loss = loss + weight * self.fn(truncated, reps_guided)
        return loss
