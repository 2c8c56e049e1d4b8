"""``cgist train --multi-vector``: a late-interaction student (a tiny BERT SentenceTransformer converted by
sentence-transformers to a MultiVectorEncoder) trained with the guided multi-vector drop-ins, scored with MaxSim, in
every guide mode, with and without GradCache; the single-vector loss's options refused; a finished run resumed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_cli import _check, _train, guide_dir, student_dir  # noqa: F401 (fixtures)
from test_data import write_jsonl

from cgist.cli import arguments, build_parser, config, run
from cgist.cli.common import UsageError

pytest.importorskip("sentence_transformers.multi_vector_encoder")

from sentence_transformers.multi_vector_encoder import MultiVectorEncoder  # noqa: E402


def test_the_temperature_and_the_loss_options_follow_the_model_kind():
    parse = build_parser().parse_args
    single, multi = parse(["train"]), parse(["train", "--multi-vector", "--margin", "0.1"])
    assert (single.temperature, multi.temperature, single.multi_vector, multi.multi_vector) == (None, None, False, True)
    assert config.temperature(single) == arguments.DEFAULT_TEMPERATURE
    assert config.output_dir(single) == Path(arguments.DEFAULT_OUTPUT_DIR)
    assert config.output_dir(multi) == Path(arguments.DEFAULT_MULTI_VECTOR_OUTPUT_DIR)
    assert config.output_dir(parse(["train", "--multi-vector", "--output-dir", "x"])) == Path("x")
    assert config.temperature(multi) == arguments.MULTI_VECTOR_TEMPERATURE
    assert config.loss_options(multi) == {"scale": 1 / arguments.MULTI_VECTOR_TEMPERATURE, "margin": 0.1,
                                          "margin_strategy": "absolute"}
    assert config.loss_options(parse(["train", "--multi-vector", "--temperature", "0.5"]))["scale"] == 2.0
    assert config.loss_options(single)["temperature"] == arguments.DEFAULT_TEMPERATURE
    saved = config.training_options(single, "sha256:x")
    assert saved["--multi-vector"] is False and saved["--temperature"] == arguments.DEFAULT_TEMPERATURE
    older = {k: v for k, v in saved.items() if k != "--multi-vector"}  # a checkpoint from before the option
    config.check_resume(older, saved, Path("checkpoint-8"))
    with pytest.raises(UsageError, match="--multi-vector differs from the checkpoint's: given here, not given"):
        config.check_resume(older, {**saved, "--multi-vector": True}, Path("checkpoint-8"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--directions", "query_to_doc", "doc_to_query"], "--directions shapes the single-vector loss"),
        (["--partition-mode", "per_direction"], "--partition-mode shapes the single-vector loss"),
        (["--hardness-mode", "hard_negatives"], "--hardness-mode shapes the single-vector loss"),
        (["--hardness-strength", "2"], "--hardness-strength shapes the single-vector loss"),
        (["--no-contrast-anchors"], "--no-contrast-anchors shapes the single-vector loss"),
        (["--margin-strategy", "squared"], "margin_strategy"),
        (["--temperature", "0"], "temperature"),
    ],
    ids=["directions", "partition", "hardness-mode", "hardness-strength", "contrast-anchors", "strategy", "temperature"],
)
def test_bad_multi_vector_options(argv, message, pairs, tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs[:6])
    _check(["--multi-vector", "--data", str(data), *argv], capsys, code=2, out_dir=tmp_path / "out", message=message)


@pytest.fixture
def mv_argv(pairs, student_dir, guide_dir, tmp_path, monkeypatch) -> list[str]:  # noqa: F811 (fixtures)
    """A two-step --multi-vector run of the tiny student, guided by the tiny single-vector guide."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs[:24])
    return ["--multi-vector", "--data", str(data), "--model", str(student_dir), "--guide", str(guide_dir),
            "--max-steps", "2", "--batch-size", "6", "--mini-batch-size", "4", "--max-seq-length", "32",
            "--eval-fraction", "0.25", "--lr", "1e-3", "--device", "cpu"]


def _transformer_weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def test_a_multi_vector_run_trains_a_late_interaction_model_and_resumes(
        mv_argv, student_dir, tmp_path, capsys, monkeypatch):  # noqa: F811 (fixtures)
    loaded = {}
    load_model = run.load_model

    def recording_load_model(option, path, *args):
        loaded[option] = load_model(option, path, *args)
        return loaded[option]

    monkeypatch.setattr(run, "load_model", recording_load_model)
    out = tmp_path / "mv"
    summary, stdout = _train(mv_argv, out, capsys)
    assert isinstance(loaded["--model"], MultiVectorEncoder) and not isinstance(loaded["--guide"], MultiVectorEncoder)
    guide = loaded["--guide"]
    assert not guide.training and all(not p.requires_grad and p.grad is None for p in guide.parameters())
    assert (summary["loss"], summary["multi_vector"], summary["mini_batch_size"]) == \
        ("FusedCachedMultiVectorGISTLoss", True, 4)
    assert "loss: FusedCachedMultiVectorGISTLoss (GradCache: mini-batches of 4)" in stdout and "MRR@10" in stdout
    assert summary["args"]["multi_vector"] and summary["timing"]["steps"] == 2
    assert all(0 <= v <= 1 for when in ("before", "after") for v in summary[when].values())
    # What the guide masked: the multi-vector loss has the positives' column only (no negatives in these pairs).
    assert set(summary["guide"]) == {"guide/masked_ap", "guide/positive_only", "guide/theta_mean"}
    model = MultiVectorEncoder(str(out), device="cpu")
    assert model.similarity_fn_name == "maxsim" and model.encode_query(["a query"])[0].shape[-1] == 128
    before, after = _transformer_weights(student_dir), _transformer_weights(out)
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    assert "FusedCachedMultiVectorGISTLoss" in (out / "README.md").read_text()

    # The finished run resumed: its final checkpoint loaded as a MultiVectorEncoder, scored and published again.
    again = tmp_path / "again"
    shutil.copytree(out / "checkpoints", again / "checkpoints")
    resumed, _ = _train([*mv_argv, "--resume"], again, capsys)
    assert (resumed["steps"], resumed["timing"]["steps"], resumed["after"]) == (2, 0, summary["after"])
    assert isinstance(loaded["--resume"], MultiVectorEncoder)
    ours, theirs = _transformer_weights(again), _transformer_weights(out)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("mode", ["--no-cache", "none", "self", "precomputed"])
def test_every_guide_mode_and_the_plain_loss_train(mode, mv_argv, tmp_path, capsys):
    argv = [*mv_argv, "--no-cache"] if mode == "--no-cache" else [*mv_argv, "--guide-mode", mode]
    if mode in ("none", "self"):  # no guide model
        del argv[argv.index("--guide"):argv.index("--guide") + 2]
    if mode == "precomputed":
        argv += ["--guide-cache", str(tmp_path / "cache")]
    summary, _ = _train(argv, tmp_path / "out", capsys)
    loss = "FusedMultiVectorGISTLoss" if mode == "--no-cache" else "FusedCachedMultiVectorGISTLoss"
    assert (summary["loss"], summary["guide_mode"]) == (loss, "model" if mode == "--no-cache" else mode)
    if mode == "none":
        assert summary["guide"]["guide/masked_ap"] == 0 and "guide/theta_mean" not in summary["guide"]
    else:
        assert 0 <= summary["guide"]["guide/masked_ap"] < 1 and "guide/theta_mean" in summary["guide"]
    saved = json.loads((tmp_path / "out" / "cgist_train.json").read_text())
    assert saved["multi_vector"] and all(0 <= v <= 1 for v in saved["after"].values())
