"""cgist.stage.spec.options: ``GistOptions`` validation, defaults, immutability, hashing and ``replace``."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
from helpers import BAD_OPTIONS, token_score_fields

import cgist
import cgist.compat
from cgist import GistOptions
from cgist.stage.spec.options import ScoreOptions


@pytest.mark.parametrize("overrides, error, match", BAD_OPTIONS)
def test_rejects_bad_options(overrides, error, match):
    with pytest.raises(error, match=match):
        GistOptions(**overrides)


def test_defaults_are_those_of_gist_loss():
    """The same defaults, but for the masks: gist_loss decides those by its guide (None), and with the guide's own
    embeddings that gives the options' defaults. gist_loss takes every field but those of the token scores alone
    (``cgist.stage.spec.scores``: the dense score's call)."""
    tokens_only = token_score_fields()
    assert tokens_only == {"guide_similarity", "score_options"}
    defaults = {f.name: f.default for f in dataclasses.fields(GistOptions) if f.name not in tokens_only}
    keywords = {name: p.default for name, p in inspect.signature(cgist.gist_loss).parameters.items() if name in defaults}
    assert set(keywords) == set(defaults)
    masks = ("mask_self", "mask_duplicates")
    assert [keywords.pop(name) for name in masks] == [None, None]
    newest = cgist.compat.NEWEST_RULES.self_pairs_excluded  # gist_loss's rule (docs/design.md#rules-by-release)
    assert cgist.stage.spec.guide.masks("embeddings", None, None, True, self_pairs_excluded=newest) == \
        tuple(defaults.pop(name) for name in masks)
    # all_anchors: the option says whether the column is there; gist_loss takes the column itself (None: not)
    assert keywords.pop("all_anchors") is None and defaults.pop("all_anchors") is False
    assert keywords == defaults


def test_frozen():
    options = GistOptions()
    for name in ("temperature", "offset"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(options, name, 1)
    assert options == GistOptions()


def test_hashable_by_value():
    a = GistOptions(margin=0.1, margin_strategy="relative", offset=3)
    b = GistOptions(margin=0.1, margin_strategy="relative", offset=3)
    assert a == b and hash(a) == hash(b)
    assert {a: "cached"}[b] == "cached"
    assert len({a, b, a.replace(offset=4), GistOptions()}) == 3


def test_replace_returns_a_validated_copy():
    options = GistOptions(temperature=0.05, contrast_anchors=False)
    moved = options.replace(offset=7)
    assert moved.offset == 7 and options.offset == 0
    assert dataclasses.replace(moved, offset=0) == options
    with pytest.raises(ValueError, match=r"temperature must be a positive finite number, got 0"):
        options.replace(temperature=0)
    with pytest.raises(TypeError, match=r"offset must be an int, got float"):
        options.replace(offset=2.0)


def test_numbers_become_plain_python_numbers():
    options = GistOptions(temperature=np.float32(0.25), margin=1, offset=np.int64(4))
    assert type(options.temperature) is float and options.temperature == 0.25
    assert type(options.margin) is float and options.margin == 1.0
    assert type(options.offset) is int and options.offset == 4
    assert hash(options) == hash(GistOptions(temperature=0.25, margin=1.0, offset=4))


@pytest.mark.parametrize("strategy, relative", [("absolute", False), ("relative", True)])
def test_relative(strategy, relative):
    assert GistOptions(margin_strategy=strategy).relative is relative


def test_a_scores_own_options_are_a_read_only_hashable_mapping():
    """``GistOptions.score_options``: the score's defaults filled in and its checks' values, read-only, hashable as
    the options are, equal to a dict of the same items."""
    options = GistOptions(similarity="xtr", score_options={"top_k": np.int64(4)}, contrast_anchors=False,
                          contrast_positives=False)
    own = options.score_options
    assert isinstance(own, ScoreOptions) and own == {"top_k": 4} and type(own["top_k"]) is int
    assert len(own) == 1 and list(own) == ["top_k"] and repr(own) == "{'top_k': 4}"
    assert hash(options) == hash(options.replace()) and options == options.replace()
    with pytest.raises(TypeError):
        own["top_k"] = 5
    assert GistOptions().score_options == {}
