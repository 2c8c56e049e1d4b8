"""The drop-in protocol: what every fused drop-in is, whatever its family and however it embeds a batch
(docs/design.md#the-drop-in-protocol).

A drop-in is one class over three pieces and sentence-transformers' own loss class, which it replaces::

    class FusedCachedGISTLoss(GistFamily, CachedStep, CachedGISTEmbedLoss): ...
    class FusedMultiVectorGISTLoss(MultiVectorGistFamily, PlainStep, MultiVectorMultipleNegativesRankingLoss): ...

* ``FusedDropIn`` (here) owns what every drop-in does: its constructor (sentence-transformers' arguments, checked and
  handed to its constructor, then cgist's own options of ``cgist.losses.options``, keyword-only), the options read off
  the attributes at each call and cached (``resolve``), ``calculate_loss`` and the loss-stage call (``loss_stage``),
  the fallback to sentence-transformers' own computation where the fused stage does not compute what the attributes
  ask, the path record and the configuration.
* The step (``cgist.losses.steps``): how a batch is embedded, GradCache's mini-batches (``CachedStep``) or one
  forward pass (``PlainStep``): its attributes and their checks, ``forward``, and sentence-transformers' own loss over
  a step's embeddings.
* The family (``cgist.losses.gist``, ``cgist.losses.ranking``, ``cgist.losses.multi_vector``,
  ``cgist.losses.multi_vector_gist``): its hyperparameters checked and turned into the loss stage's ``GistOptions``
  (one options object for every family and score), its guide, if any, and its score's columns
  (``cgist.losses.columns``: the loss stage's call over a step's embeddings).

Each piece declares its hooks here, with what they must do. This module imports no family.
"""

from __future__ import annotations

import abc
import functools
import inspect
import logging
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from sentence_transformers import SentenceTransformer
from torch import Tensor

from ..compat import note_untested_release
from ..stage.node import run
from ..stage.spec.call import StageCall
from ..stage.spec.options import GistOptions
from ..stage.stats import GistStats
from ..stage.ties import token_fingerprints
from .matryoshka import FusedMatryoshka
from .options import Option, options_of

__all__ = ["FUSED", "PATHS", "UNFUSED", "Columns", "FusedDropIn", "StageBatch", "StepInputs",
           "backward_if", "check_hooks"]

logger = logging.getLogger(__name__)

#: The two paths that compute a drop-in's loss: cgist's fused loss stage, or sentence-transformers' own code where the
#: fused stage does not compute what the attributes ask (``FusedDropIn.resolve``).
FUSED, UNFUSED = "fused", "sentence-transformers"
PATHS = (FUSED, UNFUSED)


@dataclass(frozen=True)
class StepInputs:
    """What a step's ``forward`` reads off the batch for the loss stage besides the embeddings, which
    sentence-transformers' ``calculate_loss(reps, reps_guided)`` has no argument for: the label column's guide
    embeddings (``guide="labels"``) and the texts' ids (``text_fingerprints``). ``FusedDropIn.reading`` holds them for
    the duration of the step."""

    guide: object = None
    text_ids: list[Tensor] | None = None


_NO_INPUTS = StepInputs()


@dataclass
class DropInState:
    """What a drop-in keeps between its calls besides its attributes (``FusedDropIn.state``): the options resolved
    for a key of the attributes and whether the unfused path's warning was shown (``resolve``), each path's count
    (``record_path``), the statistics of the training calls not yet popped (a guided family's), what the step
    being run read off its batch (``reading``), and a guided family's last guide columns with the batch they were
    made for ``(guide, token ids, columns)``, kept while a wrapper calls the loss again on the same batch."""

    resolved: tuple[tuple, tuple[GistOptions | None, str | None]] | None = None
    warned_unfused: bool = False
    path_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    training_stats: list[GistStats] = field(default_factory=list)
    inputs: StepInputs = _NO_INPUTS
    guide_columns: tuple | None = None


@dataclass(frozen=True)
class StageBatch:
    """One loss stage's input, made by ``FusedDropIn.loss_stage`` and handed to the family's columns
    (``Columns.call``), which read nothing else: a step's embeddings (``reps``, each column's mini-batches) and what
    ``calculate_loss`` got beside them (``beside``: the token embeddings' masks, the guide's embeddings or the labels),
    the options, Matryoshka's ``(d, w_d)`` pairs (``dims``), and what the family and the step put beside them: the
    family's guide for the stage (``FusedDropIn._stage_guide``), the texts' ids (``StepInputs``), a learned
    temperature (``temperature_tensor``), the door's arguments of the score itself (``_score_arguments``) and whether
    the columns are gathered across ranks (``gather``)."""

    reps: list[list[Tensor]]
    beside: object
    options: GistOptions
    dims: tuple[tuple[int, float], ...] | None = None
    guide: object = None
    text_ids: list[Tensor] | None = None
    temperature: Tensor | None = None
    score_arguments: Mapping[str, object] = field(default_factory=dict)
    gather: bool = False


@runtime_checkable
class Columns(Protocol):
    """A family's columns (``FusedDropIn.columns``; ``cgist.losses.columns``): the loss stage's call over a
    ``StageBatch``, and a plain step's embedding of a batch (the columns, one chunk each, and their masks, or None)."""

    def call(self, batch: StageBatch) -> StageCall: ...

    def embed(self, model: torch.nn.Module, features: list[dict[str, Tensor]],
              mini_batch_size: int | None) -> tuple[list[list[Tensor]], object]: ...


def check_hooks(cls: type) -> None:
    """A drop-in class against the protocol, when it is defined rather than at its first instance: no hook left
    abstract (each named with the piece that declares it), a family name and the family's columns (``Columns``); a
    TypeError lists what it lacks."""
    names = {name for base in cls.__mro__ for name in vars(base)}
    missing = [f"{name} (a hook of {next(b for b in cls.__mro__ if name in vars(b)).__qualname__})"
               for name in sorted(names) if getattr(getattr(cls, name, None), "__isabstractmethod__", False)]
    if not getattr(cls, "family", ""):
        missing.append("family (the family's name in cgist.losses.options' table)")
    if not isinstance(getattr(cls, "columns", None), Columns):
        missing.append("columns (the family's component of cgist.losses.columns)")
    if missing:
        raise TypeError(f"{cls.__name__} does not implement the drop-in protocol (cgist.losses.base): it lacks "
                        f"{', '.join(missing)}")


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


def backward_if(loss: Tensor, with_backward: bool) -> Tensor:
    """A loss-stage call's end under GradCache's ``with_backward``: its gradients accumulated into the leaves'
    ``.grad`` and the loss detached; without, the loss as it is."""
    if not with_backward:
        return loss
    loss.backward()
    return loss.detach()


def attribute_key(obj: object, names: Iterable[str]) -> tuple:
    """The values of the attributes ``names`` of ``obj`` (None where one is missing), each with its type, so that
    ``1`` and ``True`` or ``0`` and ``0.0`` differ: what a drop-in's options are rebuilt on. A tensor (a learned
    ``scale`` or ``temperature``) counts by its identity: its value is read at each call (``temperature_tensor``)."""
    return tuple((type(value), id(value) if isinstance(value, Tensor) else value)
                 for value in (getattr(obj, name, None) for name in names))



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


class FusedDropIn(abc.ABC):
    """What every fused drop-in is: sentence-transformers' attributes and cgist's own options are the options of
    the fused loss stage, read at each call.

    The subclass keeps every hyperparameter as the attribute that sentence-transformers defines, and cgist's own
    (``cgist.losses.options``) beside them, with class-level defaults so that a loss built by ``__new__`` with its
    attributes set by hand has them too. At each call ``resolve`` reads them: the ``GistOptions`` of the fused loss
    stage, checked and cached, rebuilt only when one of the attributes in ``options_key`` changed; or None when the
    fused stage does not compute what they ask for, and sentence-transformers' own loss computation runs instead
    (with one warning per loss object).

    Hooks, by the piece that supplies them (docs/design.md#the-drop-in-protocol); a hook without a default is
    abstract, and a drop-in class that leaves one so, or has no ``family`` or ``columns``, is refused when it is
    defined (``check_hooks``):

    * the family: ``family`` (its name in the options table), ``family_attributes``, ``columns`` (its component of
      ``cgist.losses.columns``), ``_family_options``, ``temperature_tensor``; optionally ``_check_arguments``,
      ``_family_key``, ``_for_sentence_transformers``, ``_keep_arguments``, ``_step_inputs``, ``_stage_guide``,
      ``_score_arguments``, ``_unfused_reps_guided``, ``_after_fused``, ``_config_extras``; under a plain step,
      ``_embeddings_loss``, and optionally ``_plain_beside`` and ``_st_forward_computes``
      (``cgist.losses.steps.PlainStep``);
    * the step: ``embedding_attributes``, ``_check_embedding_stage``, ``_unfused_loss`` and ``forward``;
    * the class: its sentence-transformers base (``replaces``, found from the bases) and ``deprecation``.

    The pieces pass data: ``loss_stage`` asks the family for its part of the stage's input and hands the family's
    columns one ``StageBatch``, and the columns read nothing else. A drop-in computes one step at a time:
    what the step read off its batch (``step_inputs``) belongs to the loss object, so two threads must not step the
    same loss object at once (as with any ``nn.Module`` that keeps state between its calls).
    """

    # -- declared by the family ---------------------------------------------------------------------------------------
    #: The family's name in the options table (``cgist.losses.options.Option.families``).
    family: str = ""
    #: sentence-transformers' attributes the family reads besides its constructor's parameters.
    family_attributes: tuple[str, ...] = ()
    #: The family's embedding-stage attributes beyond the step's (checked with them, ``_check_embedding_stage``).
    family_embedding_attributes: tuple[str, ...] = ()
    # -- declared by the step -----------------------------------------------------------------------------------------
    #: The embedding stage's attributes.
    embedding_attributes: tuple[str, ...] = ()
    # -- declared by the class ----------------------------------------------------------------------------------------
    #: The sentence-transformers class this drop-in replaces: the first of its bases that is no ``FusedDropIn``.
    replaces: type | None = None
    #: A ``DeprecationWarning`` given at construction (sentence-transformers deprecates the replaced class).
    deprecation: str | None = None
    #: The family: the annotations of sentence-transformers' parameters that it takes more of (the GIST guide).
    argument_annotations: dict[str, str] = {}
    #: The family: constructor parameters that sentence-transformers' class does not have (a guided family's guide and
    #: margin), kept by ``_keep_arguments`` (``_parameters`` says where they go in the signature).
    added_parameters: tuple[inspect.Parameter, ...] = ()
    #: The family: the model class its ``model`` argument must be.
    model_class: type = SentenceTransformer
    #: The family: its columns, the component that builds the loss stage's call from a ``StageBatch`` and embeds a
    #: plain step's batch (``cgist.losses.columns``: its score's kind of column).
    columns: Columns | None = None
    #: The family: whether it computes ``MatryoshkaLoss``'s dimensions in one loss stage (``FusedMatryoshka``); if
    #: not, sentence-transformers' decoration runs the loss stage once per dimension.
    fuses_matryoshka: bool = True

    last_stats: GistStats | None = None
    #: The path of the last loss computation: ``FUSED`` (cgist's loss stage) or ``UNFUSED`` (sentence-transformers'
    #: own code); None before the first.
    last_path: str | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Each family's options as class-level defaults; for a drop-in class (one with a sentence-transformers base),
        the class it replaces and its constructor's signature: sentence-transformers' parameters, then cgist's own
        options as keyword-only parameters."""
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:
            for option in options_of(cls.family):
                setattr(cls, option.name, option.default)
        # A subclass of a drop-in replaces what its drop-in replaces, whatever else it mixes in.
        replaces = cls.replaces or next((base for base in cls.__mro__ if issubclass(base, torch.nn.Module)
                                         and not issubclass(base, FusedDropIn)), None)
        if replaces is None:
            return
        cls.replaces = replaces
        clash = sorted(set(_parameter_names(replaces, cls.added_parameters))
                       & {option.name for option in cls.own_options()})
        if clash:
            raise TypeError(f"{replaces.__name__} takes {clash} itself, which are also options of cgist's table "
                            "(cgist.losses.options): this sentence-transformers release is not supported by this cgist")
        check_hooks(cls)
        if "__init__" not in cls.__dict__:
            cls.__init__ = _constructor(cls)
        if cls.__doc__ and cls.__module__.startswith("cgist.") and "family" not in cls.__dict__:
            lines = "".join(f"\n        {option.name} (default {option.default!r}): {option.doc}."
                            for option in cls.own_options())
            cls.__doc__ = (f"{cls.__doc__.rstrip()}\n\n    cgist's own options, keyword-only "
                           f"(docs/losses.md#cgists-own-options):{lines}\n")

    # -- construction --------------------------------------------------------------------------------------------------

    def _construct(self, args: tuple, kwargs: dict[str, object]) -> None:
        """sentence-transformers' arguments bound to its constructor's parameters and checked (with cgist's messages
        for what its constructor would not name), its constructor run on them, then cgist's own options and the
        family's arguments kept as attributes, and every attribute checked as it is again at each call."""
        own = {option.name: kwargs.pop(option.name, option.default) for option in self.own_options()}
        try:
            bound = _parameters(self.replaces, self.added_parameters).bind(self, *args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{type(self).__name__}(): {error}") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        if self.deprecation:
            warnings.warn(self.deprecation, DeprecationWarning, stacklevel=3)
        if not isinstance(arguments["model"], self.model_class):
            raise TypeError(f"model must be a {self.model_class.__name__}, got {type(arguments['model']).__name__}")
        self._check_arguments(arguments)
        self._check_embedding_stage(arguments)
        super().__init__(**self._for_sentence_transformers(arguments))
        for name, value in own.items():
            setattr(self, name, value)
        self._keep_arguments(arguments)
        self.resolve()

    @classmethod
    def own_options(cls) -> Iterator[Option]:
        """cgist's own options of this drop-in (``cgist.losses.options``)."""
        return options_of(cls.family)

    def _check_arguments(self, arguments: Mapping[str, object]) -> None:
        """The family: its hyperparameters among sentence-transformers' ``arguments`` (or the attributes) checked,
        where sentence-transformers' constructor would not name a bad one."""

    def _for_sentence_transformers(self, arguments: dict[str, object]) -> dict[str, object]:
        """The family: the arguments sentence-transformers' constructor takes (default: as given)."""
        return arguments

    def _keep_arguments(self, arguments: Mapping[str, object]) -> None:
        """The family: what it keeps of the arguments after sentence-transformers' constructor (default: nothing)."""

    @abc.abstractmethod
    def _check_embedding_stage(self, values: Mapping[str, object]) -> None:
        """The step: the embedding stage's attributes (``embedding_attributes``) among ``values``, checked."""

    # -- the options, read off the attributes --------------------------------------------------------------------------

    def options_key(self) -> tuple:
        """The attribute values the options are built from (``attribute_key``): sentence-transformers' constructor
        parameters, the family's and the step's attributes, cgist's own options, and the family's settings of
        objects held as attributes (``_family_key``)."""
        names = dict.fromkeys([*_parameter_names(self.replaces, self.added_parameters), *self.family_attributes,
                               *self.embedding_attributes, *self.family_embedding_attributes,
                               *(option.name for option in self.own_options())])
        return (*attribute_key(self, names), *self._family_key())

    def _family_key(self) -> tuple:
        """The family: what else its options depend on (settings of objects held as attributes)."""
        return ()

    def build_options(self) -> tuple[GistOptions | None, str | None]:
        """The attributes checked: the fused stage's options, or None and the reason it does not compute them."""
        self._check_embedding_stage({name: getattr(self, name, None)
                                     for name in (*self.embedding_attributes, *self.family_embedding_attributes)})
        for option in self.own_options():
            if option.check is not None:
                option.check(option.name, getattr(self, option.name))
        return self._family_options()

    @abc.abstractmethod
    def _family_options(self) -> tuple[GistOptions | None, str | None]:
        """The family: its hyperparameters checked (raising as its constructor does) and the fused stage's options,
        with cgist's own option fields (``own_fields``); or None and the reason the fused stage does not compute
        them."""

    def own_fields(self) -> dict[str, object]:
        """cgist's own options that are ``GistOptions`` fields, by name, as the attributes hold them."""
        return {option.name: getattr(self, option.name) for option in self.own_options() if option.field}

    def resolve(self) -> GistOptions | None:
        """The options of the next loss stage, from the attributes as they are now; None when sentence-transformers'
        own loss computation runs instead. A bad attribute raises here, with the constructor's error."""
        key, state = self.options_key(), self.state
        if state.resolved is None:  # this drop-in's first options: name an untested sentence-transformers, once
            note_untested_release()
        if state.resolved is None or state.resolved[0] != key:
            state.resolved = (key, self.build_options())
        options, reason = state.resolved[1]
        if options is None and not state.warned_unfused:
            state.warned_unfused = True
            logger.warning("%s runs sentence-transformers' own loss computation instead of the fused loss stage "
                           "(the same loss and gradients, with its time and memory): %s. This warning is shown once.",
                           type(self).__name__, reason)
        return options

    @property
    def options(self) -> GistOptions | None:
        """The fused loss stage's options for the attributes as they are now (None when it does not run)."""
        return self.resolve()

    # -- a step ---------------------------------------------------------------------------------------------------------

    @property
    def state(self) -> DropInState:
        """What this drop-in keeps between its calls (``DropInState``; made on first use, so that a loss built by
        ``__new__`` has one too)."""
        state = getattr(self, "_drop_in_state", None)
        if state is None:
            state = self._drop_in_state = DropInState()
        return state

    @contextmanager
    def reading(self, inputs: StepInputs) -> Iterator[None]:
        """``inputs`` are ``step_inputs`` for the duration (a step's ``forward`` around ``calculate_loss``, which
        sentence-transformers' own GradCache loop calls without them)."""
        state = self.state
        previous, state.inputs = state.inputs, inputs
        try:
            yield
        finally:
            state.inputs = previous

    @property
    def step_inputs(self) -> StepInputs:
        """What this step's ``forward`` read off the batch (``StepInputs``); empty outside a step."""
        return self.state.inputs

    def _step_inputs(self, features: list[dict[str, Tensor]], labels: Tensor | None,
                     options: GistOptions | None) -> StepInputs:
        """The family: what the loss stage reads off the batch (default: nothing)."""
        return _NO_INPUTS

    def calculate_loss(self, reps: list[list[Tensor]], reps_guided: object = None, *,
                       with_backward: bool = False) -> Tensor:
        """The loss over a step's embeddings (``reps``: each column's mini-batches); ``reps_guided`` is the GIST
        drop-ins' guide embeddings, or the ranking drop-ins' labels (unused: the positive pair is the diagonal).

        With ``with_backward`` the embedding gradients are accumulated into ``.grad`` of the leaves in ``reps`` and a
        detached scalar is returned; without, the loss is differentiable with respect to them; under
        ``torch.no_grad`` only the loss is computed.
        """
        return self.loss_stage(reps, reps_guided, with_backward=with_backward)

    def loss_stage(self, reps: list[list[Tensor]], reps_guided: object, *, with_backward: bool,
                   dims: tuple[tuple[int, float], ...] | None = None) -> Tensor:
        """``calculate_loss`` over ``dims`` (Matryoshka ``(d, w_d)`` pairs) if given: the fused loss stage
        (``cgist.stage.node.run`` over the call its columns build from a ``StageBatch``), or sentence-transformers'
        own computation where it does not run (``resolve``). With ``with_backward`` the embedding gradients are accumulated into the
        leaves' ``.grad`` and the loss is returned detached."""
        options = self.resolve()
        if options is None:
            self.record_path(UNFUSED)
            return self._unfused_loss(reps, self._unfused_reps_guided(reps_guided, reps), with_backward)
        temperature = self.temperature_tensor()
        if temperature is not None:  # its value now: the options were made with the attribute's identity
            options = options.replace(temperature=float(temperature.detach()))
            if not (temperature.requires_grad and torch.is_grad_enabled()):
                temperature = None
        inputs = self.step_inputs
        guide = self._stage_guide(reps, reps_guided, inputs)
        if options.mask_duplicates and inputs.text_ids is None:
            raise ValueError("mask_duplicates needs the batch's token ids: call the loss on the batch's features "
                             "(calculate_loss alone does not see them), or pass mask_duplicates=False")
        batch = StageBatch([list(r) for r in reps], reps_guided, options, dims, guide=guide, text_ids=inputs.text_ids,
                           temperature=temperature, score_arguments=self._score_arguments(),
                           gather=self.gather_across_devices)
        loss, stats = run(self.columns.call(batch), self.backend, return_stats=True)
        self.record_path(FUSED, stats)
        self._after_fused(reps, stats, options)
        return backward_if(loss, with_backward)

    @abc.abstractmethod
    def temperature_tensor(self) -> Tensor | None:
        """The family: the temperature as a 0-dim tensor where the family's temperature (or scale) attribute is a
        tensor (a learned one, an ``nn.Parameter``: it then gets the loss's derivative), checked as the family checks
        it; else None."""

    def _stage_guide(self, reps: list[list[Tensor]], reps_guided: object, inputs: StepInputs) -> object:
        """The family: its guide for the loss stage (``StageBatch.guide``) from a step's embeddings, what
        ``calculate_loss`` got beside them and what the step read off the batch (``inputs``): the dense columns take
        the guide's columns, ``"self"`` or None, the token columns the door's ``guide`` and ``guide_masks`` by name
        (default: None, no guide)."""
        return None

    def _score_arguments(self) -> Mapping[str, object]:
        """The family: the door's arguments of the score itself, such as a learned parameter of a multi-vector
        ``similarity_fct`` (default: none)."""
        return {}

    def _unfused_reps_guided(self, reps_guided: object, reps: list[list[Tensor]]) -> object:
        """The family: ``reps_guided`` as sentence-transformers' own computation takes it (default: as given)."""
        return reps_guided

    @abc.abstractmethod
    def _unfused_loss(self, reps: list[list[Tensor]], reps_guided: object, with_backward: bool) -> Tensor:
        """The step: sentence-transformers' own loss over a step's embeddings, where the fused stage does not run."""

    def _after_fused(self, reps: list[list[Tensor]], stats: GistStats, options: GistOptions) -> None:
        """The family: what follows a fused loss stage (default: nothing)."""

    # -- what a drop-in reports -----------------------------------------------------------------------------------------

    def __setattr__(self, name: str, value: object) -> None:
        # MatryoshkaLoss decorates a gradient-cache loss by replacing its ``calculate_loss`` with a loop over
        # dimensions; take that decoration over and compute the dimensions in one pass instead.
        if name == "calculate_loss" and self.fuses_matryoshka:
            value = FusedMatryoshka.take_over(self, value)
        super().__setattr__(name, value)

    def record_path(self, path: str, stats: GistStats | None = None) -> None:
        """Note which path computed this loss (``FUSED`` or ``UNFUSED``) and the fused stage's statistics (None on
        the unfused path): ``last_path``, ``last_stats`` and the running counts of ``path_counts``."""
        self.last_path, self.last_stats = path, stats
        self.state.path_counts[path] += 1

    @property
    def path_counts(self) -> dict[str, int]:
        """How many loss computations each path ran since this drop-in was built: ``{FUSED: n, UNFUSED: m}``. Under
        ``MatryoshkaLoss`` a fused step is one computation, an unfused one a computation per dimension."""
        return dict(self.state.path_counts)

    def own_config(self) -> dict[str, object]:
        """cgist's own options that differ from their defaults, for ``get_config_dict``."""
        return {option.name: getattr(self, option.name) for option in self.own_options()
                if getattr(self, option.name) != option.default}

    def _config_extras(self) -> dict[str, object]:
        """The family: what its configuration adds before cgist's own options (default: nothing)."""
        return {}

    def get_config_dict(self) -> dict:
        """sentence-transformers' configuration, key for key, then what the family adds and cgist's own options
        where they differ from their defaults."""
        return {**super().get_config_dict(), **self._config_extras(), **self.own_config()}



@functools.cache
def _parameters(replaces: type, added: tuple[inspect.Parameter, ...] = ()) -> inspect.Signature:
    """The signature of ``replaces``'s constructor (``self`` first), with a family's ``added`` parameters: those that
    may be positional right after ``model``, the keyword-only ones after sentence-transformers' own."""
    signature = inspect.signature(replaces.__init__)
    theirs = list(signature.parameters.values())
    after_model = [p.name for p in theirs].index("model") + 1
    keyword = [p for p in added if p.kind is inspect.Parameter.KEYWORD_ONLY]
    positional = [p for p in added if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    tail = [p for p in theirs[after_model:] if p.kind is not inspect.Parameter.VAR_KEYWORD]
    var_keyword = [p for p in theirs if p.kind is inspect.Parameter.VAR_KEYWORD]
    return signature.replace(parameters=[*theirs[:after_model], *positional, *tail, *keyword, *var_keyword])


def _parameter_names(replaces: type, added: tuple[inspect.Parameter, ...] = ()) -> tuple[str, ...]:
    """The names of the constructor parameters (``_parameters``), ``self`` left out."""
    return tuple(_parameters(replaces, added).parameters)[1:]


def _constructor(cls: type[FusedDropIn]) -> object:
    """The ``__init__`` of a drop-in class: ``FusedDropIn._construct`` under the signature of sentence-transformers'
    constructor followed by cgist's own options, keyword-only."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._construct(args, kwargs)

    own = [inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=option.default,
                             annotation=option.annotation or inspect.Parameter.empty)
           for option in cls.own_options()]
    signature = _parameters(cls.replaces, cls.added_parameters)
    theirs = [p.replace(annotation=cls.argument_annotations.get(p.name, p.annotation))
              for p in signature.parameters.values()]
    __init__.__signature__ = signature.replace(parameters=[*theirs, *own])
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    __init__.__doc__ = (f"The loss from the arguments of sentence-transformers' ``{cls.replaces.__name__}`` and "
                        "cgist's own options (keyword-only); a bad one raises here, naming it.")
    return __init__
