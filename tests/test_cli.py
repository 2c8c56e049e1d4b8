"""``cgist train``: argument parsing, bad inputs (exit 2, nothing written), a tiny end-to-end run (tiny BERT
student, real MiniLM guide, a small JSONL file), and the guide modes: the precomputed guide's cache (built once, then
used without loading the guide; rebuilt when damaged), and runs without a guide model. The data loaders' own tests
are in test_data.py."""

from __future__ import annotations

import ast
import dataclasses
import errno
import inspect
import json
import os
import shlex
import shutil
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
from helpers_models import tiny_model
from datasets import Dataset, DatasetDict
from safetensors.torch import load_file
from test_data import write_csv, write_jsonl

from cgist.cli import arguments, build_parser, config, guide_cache, main, report, run
from cgist.cli.common import UsageError
from cgist.stage.spec.guide import MODEL

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory) -> Path:
    """A saved tiny BERT SentenceTransformer sharing the guide's tokenizer."""
    root = tmp_path_factory.mktemp("student")
    model = tiny_model(root / "bert", dtype=torch.float32)
    model.save(str(root / "st"))
    return root / "st"


@pytest.fixture(scope="module")
def guide_dir(tmp_path_factory) -> Path:
    """A saved tiny BERT SentenceTransformer, other weights and width than the student, as a quick guide."""
    root = tmp_path_factory.mktemp("guide")
    tiny_model(root / "bert", dtype=torch.float32, hidden_size=16, seed=1).save(str(root / "st"))
    return root / "st"


def _check(argv: list[str], capsys, *, code: int, out_dir: Path, message: str = "") -> str:
    """Run ``cgist train argv``; check the exit code, the message on stderr and that ``out_dir`` holds no run."""
    try:
        status = main(["train", *argv, "--output-dir", str(out_dir)])
    except SystemExit as exit_:  # argparse errors
        status = exit_.code
    captured = capsys.readouterr()
    assert status == code, captured.err
    if code:
        assert message.lower() in captured.err.lower(), captured.err
        assert "Traceback" not in captured.err
        assert not out_dir.exists() or not (out_dir / "modules.json").exists()
        assert not [p for p in out_dir.parent.iterdir() if p.name.startswith(f".{out_dir.name}-")]
    return captured.out


# ---------------------------------------------------------------------------------------------- parsing


def test_parser_defaults():
    args = build_parser().parse_args(["train"])
    assert (args.model, args.guide, args.data) == (None, None, None)
    assert (args.batch_size, args.mini_batch_size, args.max_seq_length) == (32, 16, 64)
    assert args.lr == 1e-4 and args.max_pairs is None
    assert (config.temperature(args), args.margin, args.margin_strategy) == (0.01, 0.0, "absolute")
    assert args.contrast_anchors and args.contrast_positives
    assert config.output_dir(args) == Path(arguments.DEFAULT_OUTPUT_DIR)
    assert config.max_steps(args) == arguments.DEFAULT_STDLIB_STEPS
    assert (args.save_steps, args.save_total_limit, args.resume, args.overwrite) == (None, 2, False, False)
    assert (args.guide_mode, args.guide_cache) == ("model", None)
    assert 1 <= config.save_steps(args) == arguments.DEFAULT_STDLIB_SAVE_STEPS < arguments.DEFAULT_STDLIB_STEPS
    parse = build_parser().parse_args
    assert (parse(["train", "--resume"]).resume, parse(["train", "--resume", "auto"]).resume) == (True, "auto")
    assert parse(["train", "--resume=auto", "--output-dir", "out"]).resume == "auto"


def test_parser_options():
    args = build_parser().parse_args(
        ["train", "--data", "x.jsonl", "--batch-size", "8", "--mini-batch-size", "3", "--epochs", "2", "--lr",
         "1e-4", "--temperature", "0.05", "--margin", "0.1", "--margin-strategy", "relative",
         "--no-contrast-anchors", "--no-contrast-positives", "--seed", "7", "--device", "cpu"]
    )
    assert (args.data, args.batch_size, args.mini_batch_size, args.epochs, args.lr) == ("x.jsonl", 8, 3, 2.0, 1e-4)
    assert (args.temperature, args.margin, args.margin_strategy, args.seed) == (0.05, 0.1, "relative", 7)
    assert not args.contrast_anchors and not args.contrast_positives
    assert config.max_steps(args) == -1  # a file trains for --epochs
    assert config.max_steps(build_parser().parse_args(["train", "--epochs", "1"])) == -1
    assert config.max_steps(build_parser().parse_args(["train", "--data", "x", "--max-steps", "3"])) == 3
    assert config.save_steps(args) == arguments.DEFAULT_SAVE_STEPS
    assert config.save_steps(build_parser().parse_args(["train", "--max-steps", "3"])) == 500
    assert config.save_steps(build_parser().parse_args(["train", "--save-steps", "3"])) == 3


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train"], "cgist train --resume"),
        (["train", "--data", "my pairs.jsonl", "--overwrite", "--lr", "1e-5"],
         "cgist train --data 'my pairs.jsonl' --lr 1e-5 --resume"),
        (["train", "--ov", "--max-steps", "9"], "cgist train --max-steps 9 --resume"),
        (["train", "--output-dir", "out", "--resume"], "cgist train --output-dir out --resume"),
        (["train", "--res", "--output-dir=out"], "cgist train --res --output-dir=out"),
        (["train", "--resume", "auto", "--output-dir", "out"], "cgist train --resume auto --output-dir out"),
        (["train", "--output-dir", "out", "--resume=auto"], "cgist train --output-dir out --resume=auto"),
    ],
    ids=["bare", "overwrite-dropped", "abbreviation", "already-resuming", "abbreviated-resume", "resume-auto",
         "resume-auto-with-equals"],
)
def test_resume_command(argv, expected):
    assert config.resume_command(argv) == expected
    args = build_parser().parse_args(argv)
    again = build_parser().parse_args(shlex.split(expected)[1:])
    assert again.resume and not again.overwrite
    assert {k: v for k, v in vars(again).items() if k not in ("resume", "overwrite")} == \
        {k: v for k, v in vars(args).items() if k not in ("resume", "overwrite")}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "many"], "--batch-size"),
        (["--max-steps", "three"], "argument --max-steps: expected an integer, got 'three'"),
        (["--lr", "0"], "--lr"),
        (["--lr", "fast"], "argument --lr: expected a number, got 'fast'"),
        (["--epochs", "-1"], "--epochs"),
        (["--max-steps", "0"], "--max-steps"),
        (["--eval-fraction", "1"], "--eval-fraction"),
        (["--temperature", "warm"], "--temperature"),
        (["--save-steps", "0"], "--save-steps"),
        (["--save-total-limit", "0"], "--save-total-limit"),
        (["--guide-mode", "teacher"], "--guide-mode"),
        (["--resume", "later"], "argument --resume: invalid choice: 'later' (choose from 'auto')"),
    ],
    ids=lambda v: "-".join(v).strip("-") if isinstance(v, list) else None,
)
def test_parser_rejects(argv, message, tmp_path, capsys):
    _check(argv, capsys, code=2, out_dir=tmp_path / "out", message=message)


def test_module_help():
    result = subprocess.run(
        [sys.executable, "-m", "cgist", "train", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for option in ("--data", "--batch-size", "--max-steps", "--margin-strategy", "--no-contrast-positives",
                   "--save-steps", "--save-total-limit", "--resume", "--guide-mode", "--guide-cache"):
        assert option in result.stdout


# ---------------------------------------------------------------------------------------------- bad inputs


#: --data that cannot be trained on: (what the data is, what the message says). The data is the rows of a JSONL file
#: (None: no file), the file's text (a str), or the splits of a directory saved by datasets (a dict; empty: an empty
#: directory).
BAD_DATA = {
    "missing-file": (None, "does not exist"),
    "unknown-column": ([{"anchor": "a b", "positive": "c d", "label": "x"}], "unknown column(s) ['label']"),
    "missing-column": ([{"anchor": "a b", "negative": "c d"}], "missing column(s) ['positive']"),
    "empty-jsonl": ([], "empty"),
    "blank-cell": ([{"anchor": "a b", "positive": "c d"}, {"anchor": "e f", "positive": " "}], "row 2, column 'positive'"),
    "one-row": ([{"anchor": "a b", "positive": "c d"}], "at least 2"),
    "ragged-jsonl": ([{"anchor": "a b", "positive": "c d"}, {"anchor": "e", "positive": "f", "negative": "g"}],
                     "line 2 has keys"),
    "invalid-json": ('{"anchor": "a b", "positive": "c d"}\n\n{"anchor": "e f", "positive"}\n',
                     "pairs.jsonl: line 3 is not valid JSON (Expecting ':' delimiter)"),
    "not-an-object": ([["a b", "c d"], ["e f", "g h"]], "pairs.jsonl: line 1 must be a JSON object, got list"),
    "directory-not-a-dataset": ({}, "pairs is not a saved `datasets` directory (Directory "),
    "directory-without-train-split": ({"test": [{"anchor": "a b", "positive": "c d"}] * 2},
                                      "pairs holds splits ['test'], but no 'train' split"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data(case, tmp_path, capsys):
    """Exit 2 before anything is written, with a message that names the file (and its line or split) and what is
    wrong."""
    rows, message = BAD_DATA[case]
    path = tmp_path / "pairs.jsonl"
    if isinstance(rows, str):
        path.write_text(rows)
    elif isinstance(rows, dict):
        path = tmp_path / "pairs"
        path.mkdir()
        if rows:
            DatasetDict({split: Dataset.from_list(r) for split, r in rows.items()}).save_to_disk(str(path))
    elif rows is not None:
        write_jsonl(path, rows)
    _check(["--data", str(path)], capsys, code=2, out_dir=tmp_path / "out", message=message)


@pytest.mark.parametrize(
    "header, rows, message",
    [
        (["anchor", "text"], [], "unknown column"),
        (["anchor", "positive"], [], "empty"),
        (None, [], "pairs.csv: the file is empty; it needs a header row (anchor,positive,...) and data rows"),
        (["anchor", "positive"], [["a b", "c d"], [], ["e f"]], "pairs.csv: line 4 has 1 fields, but the header has 2"),
    ],
    ids=["csv-unknown-column", "csv-empty", "csv-no-header", "csv-short-row"],
)
def test_bad_csv(header, rows, message, tmp_path, capsys):
    """A CSV file with bad columns, no rows, no header (None: an empty file) or a row whose fields do not match the
    header's (the blank line between the rows counts as a line)."""
    path = tmp_path / "pairs.csv"
    if header is None:
        path.write_text("")
    else:
        write_csv(path, header, rows)
    _check(["--data", str(path)], capsys, code=2, out_dir=tmp_path / "out", message=message)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "1"], "--batch-size must be at least 2"),
        (["--mini-batch-size", "0"], "--mini-batch-size"),
        (["--warmup-ratio", "1"], "--warmup-ratio must be in [0, 1), got 1.0"),
        (["--temperature", "0"], "temperature"),
        (["--margin", "nan"], "margin"),
        (["--margin-strategy", "squared"], "margin_strategy"),
        (["--backend", "cuda"], "--backend"),
        (["--device", "toaster"], "--device"),
        (["--model", "{tmp}/no-such-model"], "--model"),
        (["--guide", "{tmp}/no-such-guide"], "--guide"),
        (["--model", "{tmp}"], "--model: cannot load"),
        (["--guide-mode", "self", "--guide", "{tmp}/guide"], "--guide-mode self trains without a guide model"),
        (["--guide-mode", "none", "--guide", "{tmp}/guide"], "--guide-mode none trains without a guide model"),
        (["--guide-cache", "{tmp}/cache"], "--guide-cache is used only with --guide-mode precomputed, not model"),
        (["--guide-mode", "precomputed", "--guide-cache", "{tmp}/pairs.jsonl"], "exists and is not a directory"),
        (["--directions", "query_to_doc", "query_to_query"],
         "--directions query_to_query holds the anchor-anchor block, which the loss also adds by default; add "
         "--no-contrast-anchors"),
        (["--directions", "query_to_doc", "doc_to_doc", "--no-contrast-anchors"],
         "--directions doc_to_doc holds the positive-positive block, which the loss also adds by default; add "
         "--no-contrast-positives"),
        (["--directions", "doc_to_query"], "directions must include 'query_to_doc'"),
        (["--directions", "query_to_doc", "sideways"], "directions must be among"),
        (["--partition-mode", "per_direction"], "partition_mode='per_direction' requires"),
        (["--hardness-mode", "hardest"], "hardness_mode must be one of"),
        (["--hardness-mode", "hard_negatives", "--hardness-strength", "-1"], "hardness_strength must be"),
    ],
    ids=["batch-1", "mini-batch-0", "warmup-1", "temperature-0", "margin-nan", "strategy-squared", "backend-cuda", "device",
         "model-missing", "guide-missing", "model-not-a-model", "self-with-guide", "none-with-guide",
         "cache-without-precomputed", "cache-is-a-file", "q2q-with-contrast-anchors", "d2d-with-contrast-positives",
         "no-q2d", "unknown-direction", "per-direction-with-contrast", "unknown-hardness", "negative-hardness"],
)
def test_bad_options(argv, message, pairs, tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs[:6])
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    argv = [a.replace("{tmp}", str(empty if a == "{tmp}" else tmp_path)) for a in argv]
    _check(["--data", str(data), *argv], capsys, code=2, out_dir=tmp_path / "out", message=message)


def test_direction_options_reach_the_loss_and_resume(tmp_path, monkeypatch):
    """--directions and the other MultipleNegativesRankingLoss flags become the loss's options; a checkpoint that
    predates them (no record of them) resumes as one trained with their defaults, and a different value is named."""
    monkeypatch.chdir(tmp_path)  # the default --output-dir is relative: not the one a user's own run left here
    parser = build_parser()
    args = parser.parse_args(["train", "--no-contrast-anchors", "--no-contrast-positives", "--directions",
                              "query_to_doc", "query_to_query", "doc_to_doc", "--hardness-mode", "hard_negatives",
                              "--hardness-strength", "5"])
    config.check_args(args)
    options = config.loss_options(args)
    assert (options["directions"], options["partition_mode"], options["hardness_mode"], options["hardness_strength"]) \
        == (["query_to_doc", "query_to_query", "doc_to_doc"], "joint", "hard_negatives", 5.0)
    assert parser.parse_args(["train", "--hardness-mode", "none"]).hardness_mode is None

    default = config.training_options(parser.parse_args(["train"]), "sha256:x")
    older = {k: v for k, v in default.items()
             if k not in ("--directions", "--partition-mode", "--hardness-mode", "--hardness-strength")}
    config.check_resume(json.loads(json.dumps(older)), default, Path("checkpoint-8"))
    changed = config.training_options(args, "sha256:x")
    with pytest.raises(UsageError, match="--directions differs from the checkpoint's"):
        config.check_resume(json.loads(json.dumps(older)), {**default, "--directions": changed["--directions"]},
                               Path("checkpoint-8"))


def test_existing_output_dir_kept(pairs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier run")
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs[:6])
    _check(["--data", str(data)], capsys, code=2, out_dir=out, message="--overwrite")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_output_dir_that_is_a_file(pairs, tmp_path, capsys):
    """An --output-dir that names a file stops the run (exit 2) and the file is left as it was."""
    out = tmp_path / "notes.txt"
    out.write_text("not a run")
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs[:6])
    _check(["--data", str(data)], capsys, code=2, out_dir=out,
           message=f"--output-dir {out} exists and is not a directory")
    assert out.read_text() == "not a run"


def test_device_beyond_the_visible_cuda_devices(pairs, tmp_path, capsys, monkeypatch):
    """--device cuda:N names a device that must exist: with one visible GPU (simulated: this machine may have none),
    cuda:0 is taken and cuda:1 stops the run (exit 2) with the number of devices that are visible."""
    from cgist.cli.common import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs[:6])
    _check(["--data", str(data), "--device", "cuda:1"], capsys, code=2, out_dir=tmp_path / "out",
           message="--device cuda:1: only 1 CUDA device(s) are visible")


def test_the_run_config_resolves_every_option_once(student_dir, tmp_path, monkeypatch):
    """``RunConfig.from_args`` checks and resolves the options into one frozen object: the default guide, the
    device, the loaded data, the schedule, the loss options and the output directory."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "pairs.jsonl", [{"anchor": f"query {i}", "positive": f"document {i}"} for i in range(10)])
    argv = ["train", "--data", "pairs.jsonl", "--model", str(student_dir), "--max-pairs", "8", "--max-steps", "3",
            "--margin", "0.1", "--device", "cpu", "--output-dir", "runs/x", "--overwrite"]
    run_config = config.RunConfig.from_args(build_parser().parse_args(argv), argv)
    bundled = config.bundled_model_path(build_parser().parse_args(["train"]))
    assert (run_config.student, run_config.guide) == (str(student_dir), bundled)
    assert run_config.guide_id == config.model_id(bundled) == str(Path(bundled).resolve())
    assert (run_config.guide_source, run_config.guide_cache, str(run_config.device)) == (MODEL, None, "cpu")
    assert len(run_config.pairs) == 8 and run_config.pairs.column_names == ["anchor", "positive"]
    assert (run_config.epochs, run_config.max_steps, run_config.save_steps, run_config.batch_size) == (1.0, 3, 500, 32)
    assert run_config.loss_options["margin"] == 0.1 and run_config.options["--max-steps"] == 3
    assert run_config.options["--data"] == config.data_fingerprint(build_parser().parse_args(argv), run_config.pairs)
    output = tmp_path.resolve() / "runs" / "x"
    assert (run_config.output, run_config.checkpoints) == (output, output / "checkpoints")
    assert (run_config.resume_from, run_config.scores_before) == (None, None)
    assert run_config.resume_command == f"cgist train --data pairs.jsonl --model {student_dir} --max-pairs 8 " \
        "--max-steps 3 --margin 0.1 --device cpu --output-dir runs/x --resume"
    assert run_config.given["data"] == "pairs.jsonl" and "command" not in run_config.given
    with pytest.raises(dataclasses.FrozenInstanceError):
        run_config.lr = 1.0
    with pytest.raises(TypeError):
        run_config.options["--lr"] = 1.0
    assert not (tmp_path / "runs").exists()  # building it writes nothing


def test_built_in_pairs_and_their_fingerprint(pairs):
    """Without --data the pairs are the standard library's (``stdlib_pairs``: --max-pairs of them, shuffled with
    --seed), and their fingerprint, which --resume compares, is of their content: the same pairs give the same one,
    other pairs another."""
    from cgist.cli.data import stdlib_pairs

    def fingerprint(*argv: str) -> str:
        args = build_parser().parse_args(["train", *argv])
        return config.data_fingerprint(args, config.load_data(args))

    args = build_parser().parse_args(["train", "--max-pairs", "6", "--seed", "3"])
    dataset = config.load_data(args)
    assert dataset.column_names == ["anchor", "positive"] and dataset.to_list() == stdlib_pairs(6, seed=3)
    digest = fingerprint("--max-pairs", "6", "--seed", "3")
    assert digest.startswith("sha256:") and len(digest) == len("sha256:") + 64
    assert digest == fingerprint("--seed", "3", "--max-pairs", "6", "--lr", "1e-3")
    others = {fingerprint("--max-pairs", "6", "--seed", "4"), fingerprint("--max-pairs", "7", "--seed", "3")}
    assert len({digest, *others}) == 3


# ---------------------------------------------------------------------------------------------- end to end


def test_train_end_to_end(pairs, student_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    loaded = {}

    def recording_load_model(option, path, *args):
        loaded[option] = cli_load_model(option, path, *args)
        return loaded[option]

    cli_load_model = run.load_model
    monkeypatch.setattr(run, "load_model", recording_load_model)
    built = []
    from_args = config.RunConfig.from_args

    def recording_from_args(args, argv):
        built.append(from_args(args, argv))
        return built[-1]

    monkeypatch.setattr(config.RunConfig, "from_args", recording_from_args)
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs[:24])
    out = tmp_path / "runs" / "tiny"
    out.mkdir(parents=True)
    (out / "stale.txt").write_text("from an earlier run")
    argv = ["--data", str(data), "--model", str(student_dir), "--max-steps", "2", "--batch-size", "6",
            "--mini-batch-size", "4", "--max-seq-length", "32", "--eval-fraction", "0.25", "--lr", "1e-3",
            "--overwrite", "--device", "cpu"]
    stdout = _check(argv, capsys, code=0, out_dir=out)

    assert "MRR@10" in stdout and "->" in stdout and "loss stage" in stdout
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]  # no staging or trash directory left
    assert not (out / "stale.txt").exists() and not (out / "trainer").exists()
    summary = json.loads((out / "cgist_train.json").read_text())
    assert (summary["train_pairs"], summary["eval_pairs"], summary["timing"]["steps"]) == (18, 6, 2)
    for when in ("before", "after"):
        assert set(summary[when]) == set(report.METRICS.values())
        assert all(0 <= v <= 1 for v in summary[when].values())
    assert 0 < summary["timing"]["loss_s"] < summary["timing"]["step_s"]
    assert summary["memory"]["peak_rss_mib"] > 0
    assert "FusedCachedGISTLoss" in (out / "README.md").read_text()
    # The guide's statistics over the two steps: a summary row, and the logged entries in the saved summary.
    guide_keys = {"guide/masked_ap", "guide/masked_aa", "guide/masked_pp", "guide/positive_only", "guide/theta_mean"}
    assert set(summary["guide"]) == guide_keys and all(0 <= summary["guide"][k] <= 1 for k in guide_keys - {"guide/theta_mean"})
    row = next(line for line in stdout.splitlines() if line.startswith("guide (mean over the run's steps)"))
    assert "masked AP " in row and "AA " in row and "PP " in row and "mean theta" in row

    before = load_file(str(next(student_dir.glob("**/model.safetensors"))))
    after = load_file(str(next(out.glob("**/model.safetensors"))))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "training did not change the student"
    guide = loaded["--guide"]
    assert not guide.training and all(not p.requires_grad and p.grad is None for p in guide.parameters())
    assert loaded["--model"].max_seq_length == 32
    assert len(built) == 1 and summary["args"] == dict(built[0].given)  # the options are read once, at the start


def test_stage_timer_times_the_loss_only_inside_a_step(monkeypatch):
    """``StageTimer`` adds a ``calculate_loss`` call's time to ``loss_s`` only between a step's begin and end; a call
    outside a step (an evaluation's, say) returns the same value and adds nothing. The clock is one that only the
    loss advances, by a second a call."""
    now = [0.0]
    monkeypatch.setattr(report, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    class Loss:
        def calculate_loss(self, value: float, *, scale: float) -> float:
            now[0] += 1.0
            return value * scale

    loss = Loss()
    timer = report.StageTimer(loss, torch.device("cpu"))
    assert loss.calculate_loss(2.0, scale=3.0) == 6.0
    assert timer.timing() == {"steps": 0, "step_s": 0.0, "loss_s": 0.0, "loss_share": 0.0}
    timer.callback.on_step_begin(None, None, None)
    assert loss.calculate_loss(2.0, scale=3.0) == 6.0
    timer.callback.on_step_end(None, None, None)
    assert loss.calculate_loss(1.0, scale=3.0) == 3.0
    assert timer.timing() == {"steps": 1, "step_s": 1.0, "loss_s": 1.0, "loss_share": 1.0}


def test_peak_memory_on_a_cuda_device(monkeypatch):
    """On a CUDA device the summary's peak memory has the device's peak allocation, in MiB, besides the process's
    resident set (simulated: this machine may have no GPU, so ``torch.cuda.max_memory_allocated`` answers for it)."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: {"cuda:1": 3 * 2**20}[str(device)])
    peak = report.peak_memory(torch.device("cuda:1"))
    assert set(peak) == {"peak_rss_mib", "peak_cuda_mib"} and peak["peak_cuda_mib"] == 3.0 and peak["peak_rss_mib"] > 0
    assert set(report.peak_memory(torch.device("cpu"))) == {"peak_rss_mib"}


# ---------------------------------------------------------------------------------------------- guide modes


class Loads:
    """``run.load_model`` replaced by one that records what each option loaded and can refuse the guide."""

    def __init__(self, monkeypatch) -> None:
        self.options: list[str] = []
        self.refuse_guide = False
        load_model = run.load_model

        def recording_load_model(option, path, *args):
            if option == "--guide" and self.refuse_guide:
                raise AssertionError("the guide model was loaded")
            self.options.append(option)
            return load_model(option, path, *args)

        monkeypatch.setattr(run, "load_model", recording_load_model)


def _train(argv: list[str], out: Path, capsys) -> tuple[dict, str]:
    """A successful ``cgist train`` into ``out``: its summary and stdout."""
    status = main(["train", *argv, "--output-dir", str(out)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return json.loads((out / "cgist_train.json").read_text()), captured.out


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


@pytest.fixture
def mode_argv(pairs, student_dir, tmp_path, monkeypatch) -> list[str]:
    """The options of the guide-mode runs (tiny student, 2 steps), without --guide."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs[:24])
    return ["--data", str(data), "--model", str(student_dir), "--max-steps", "2", "--batch-size", "6",
            "--mini-batch-size", "4", "--max-seq-length", "32", "--eval-fraction", "0.25", "--lr", "1e-3",
            "--device", "cpu"]


def test_precomputed_guide_is_cached_then_used_without_the_guide(mode_argv, guide_dir, tmp_path, capsys, monkeypatch):
    """The first run embeds the training split with the guide and caches it; a second run with the same key loads
    the cache and never loads the guide, and trains to the same weights; another --max-seq-length is another key."""
    loads = Loads(monkeypatch)
    cache = tmp_path / "cache"
    argv = [*mode_argv, "--guide", str(guide_dir), "--guide-mode", "precomputed", "--guide-cache", str(cache)]
    cold, stdout = _train(argv, tmp_path / "cold", capsys)
    assert loads.options == ["--model", "--guide"]
    assert cold["guide_mode"] == "precomputed" and not cold["guide_embeddings"]["cached"]
    entry = Path(cold["guide_embeddings"]["entry"])
    assert entry.parent.parent == cache and (entry / guide_cache.ENTRY_NAME).is_file() and (entry / "dataset").is_dir()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no staging directory left
    assert "guide mode: precomputed (the guide's embeddings of the training split, computed and cached" in stdout
    assert '"guide_mode": "labels"' in (tmp_path / "cold" / "README.md").read_text()
    assert set(cold["guide"]) >= {"guide/masked_ap", "guide/theta_mean"}

    loads.refuse_guide, loads.options = True, []
    warm, stdout = _train(argv, tmp_path / "warm", capsys)
    assert loads.options == ["--model"]
    assert warm["guide_embeddings"] == {**warm["guide_embeddings"], "cached": True, "entry": str(entry)}
    assert "loaded from the cache" in stdout
    cold_weights, warm_weights = _weights(tmp_path / "cold"), _weights(tmp_path / "warm")
    assert all(torch.equal(cold_weights[k], warm_weights[k]) for k in cold_weights)
    assert (warm["before"], warm["after"]) == (cold["before"], cold["after"])

    loads.refuse_guide = False
    shorter = [*argv[:argv.index("--max-seq-length") + 1], "16", *argv[argv.index("--max-seq-length") + 2:]]
    other, _ = _train(shorter, tmp_path / "shorter", capsys)
    assert not other["guide_embeddings"]["cached"] and other["guide_embeddings"]["entry"] != str(entry)
    assert len(list(entry.parent.iterdir())) == 2


@pytest.mark.parametrize("damage", ["edited-file", "missing-record"])
def test_a_damaged_cache_entry_is_rebuilt(damage, mode_argv, guide_dir, tmp_path, capsys, monkeypatch):
    loads = Loads(monkeypatch)
    argv = [*mode_argv, "--guide", str(guide_dir), "--guide-mode", "precomputed", "--guide-cache", str(tmp_path / "c")]
    cold, _ = _train(argv, tmp_path / "cold", capsys)
    entry = Path(cold["guide_embeddings"]["entry"])
    if damage == "edited-file":
        data = max((entry / "dataset").glob("*.arrow"), key=lambda p: p.stat().st_size)
        raw = bytearray(data.read_bytes())
        raw[-100] ^= 0xFF
        data.write_bytes(bytes(raw))
        reason = "its files differ from those it recorded"
    else:
        (entry / guide_cache.ENTRY_NAME).unlink()
        reason = f"its {guide_cache.ENTRY_NAME} cannot be read (FileNotFoundError)"
    loads.options = []
    again, stdout = _train(argv, tmp_path / "again", capsys)
    assert f"cannot be used ({reason}); computing it again" in stdout
    assert loads.options == ["--model", "--guide"] and not again["guide_embeddings"]["cached"]
    first, second = _weights(tmp_path / "cold"), _weights(tmp_path / "again")
    assert all(torch.equal(first[k], second[k]) for k in first)
    loads.refuse_guide = True  # the rebuilt entry is whole again
    assert _train(argv, tmp_path / "warm", capsys)[0]["guide_embeddings"]["cached"]


def _cache_entry(tmp_path: Path):
    """A training split, its labelled form, a cache key for them and the entry's path under ``tmp_path``."""
    train = Dataset.from_dict({"anchor": ["a b", "c d"], "positive": ["e f", "g h"]})
    labelled = train.add_column("label", [[[0.5, 1.5], [2.5, 3.5]]] * 2)
    key = {"format": guide_cache.FORMAT, "guide": "g", "guide_files": "sha256:0",
           "train_texts": guide_cache.texts_digest(train), "student_tokenizer": "sha256:1", "max_seq_length": 8}
    return train, labelled, key, guide_cache.entry_path(tmp_path, key)


def test_cache_entries_are_checked_before_use(tmp_path):
    """``load_entry`` takes only an entry of the same key whose files and texts are those recorded."""
    from cgist.cli.output import fingerprint

    train, labelled, key, entry = _cache_entry(tmp_path)
    assert guide_cache.load_entry(entry, key, train) == (None, "")
    guide_cache.store_entry(entry, key, labelled)
    dataset, problem = guide_cache.load_entry(entry, key, train)
    assert problem == "" and dataset.to_list() == labelled.to_list()
    assert guide_cache.load_entry(entry, {**key, "max_seq_length": 9}, train)[1] == "its entry.json records another key"
    other = Dataset.from_dict({"anchor": ["a b", "x y"], "positive": ["e f", "g h"]})
    other_key = {**key, "train_texts": guide_cache.texts_digest(other)}
    guide_cache.store_entry(guide_cache.entry_path(tmp_path, other_key), other_key, labelled)  # a wrong dataset
    assert guide_cache.load_entry(guide_cache.entry_path(tmp_path, other_key), other_key, other)[1] == \
        "its texts differ from the training split's"
    state = entry / "dataset" / "state.json"
    state.unlink()
    assert guide_cache.load_entry(entry, key, train)[1] == "its files differ from those it recorded"
    # Rebuilt in place: the damaged entry is replaced as a whole.
    guide_cache.store_entry(entry, key, labelled)
    assert guide_cache.load_entry(entry, key, train)[1] == "" and fingerprint(state).startswith("sha256:")
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]
    # Whole as its record says, and still of no use: a dataset that does not load (its data file gone, the record
    # written again to match), or one without the label column.
    for data in (entry / "dataset").glob("*.arrow"):
        data.unlink()
    record = json.loads((entry / guide_cache.ENTRY_NAME).read_text())
    record["files"] = {path.relative_to(entry / "dataset").as_posix(): fingerprint(path)
                       for path in sorted((entry / "dataset").rglob("*")) if path.is_file()}
    (entry / guide_cache.ENTRY_NAME).write_text(json.dumps(record))
    assert guide_cache.load_entry(entry, key, train)[1] == "its dataset cannot be loaded (FileNotFoundError)"
    guide_cache.store_entry(entry, key, train)
    assert guide_cache.load_entry(entry, key, train)[1] == "its dataset does not hold the training split"


def test_a_cache_entry_another_run_put_in_place_meanwhile_is_kept(tmp_path, monkeypatch):
    """Two runs rebuild the same unusable entry: the other one renames its entry into place after this one has
    discarded the old entry and before it renames its own, so that rename fails (the name is taken); the entry in
    place holds the same embeddings and stays, and this run's staging directory is removed."""
    train, labelled, key, entry = _cache_entry(tmp_path)
    guide_cache.store_entry(entry, key, labelled)
    (entry / guide_cache.ENTRY_NAME).write_text("{}")  # unusable
    discard = guide_cache.discard

    def discard_while_the_other_run_finishes(path: Path) -> None:
        discard(path)
        guide_cache.store_entry(entry, key, labelled)  # the other run: the old entry is gone, so it renames at once

    monkeypatch.setattr(guide_cache, "discard", discard_while_the_other_run_finishes)
    guide_cache.store_entry(entry, key, labelled)
    dataset, problem = guide_cache.load_entry(entry, key, train)
    assert problem == "" and dataset.to_list() == labelled.to_list()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]


def test_a_cache_entry_that_cannot_be_renamed_into_place(tmp_path, monkeypatch):
    """A rename that fails while the entry's name is free is an error of its own (the run warns and goes on,
    test_an_unwritable_guide_cache_only_warns): it propagates, and neither an entry nor the staging directory is
    left."""
    train, labelled, key, entry = _cache_entry(tmp_path)
    rename = Path.rename

    def failing_rename(self: Path, target):
        if self.name.startswith(".building-"):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))  # e.g. the cache on another file system
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match=os.strerror(errno.EXDEV)):
        guide_cache.store_entry(entry, key, labelled)
    assert list(entry.parent.iterdir()) == []


def _slow_tokenizer(vocab: Path):
    """A tokenizer without a fast (Rust) backend: the Python BERT tokenizer of ``vocab``."""
    try:
        from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy as PythonBertTokenizer
    except ImportError:  # transformers 4: BertTokenizer is the Python one
        from transformers import BertTokenizer as PythonBertTokenizer
    return PythonBertTokenizer(str(vocab))


def test_tokenizer_digest_of_a_python_tokenizer(tmp_path):
    """A tokenizer without a fast backend is keyed by its class and vocabulary: the same vocabulary gives the same
    digest, another vocabulary another, and the fast tokenizer of the same vocabulary another (another class)."""
    from transformers import BertTokenizerFast

    def vocab(name: str, *words: str) -> Path:
        path = tmp_path / name
        path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
        return path

    slow = _slow_tokenizer(vocab("a.txt", "query", "document"))
    assert getattr(slow, "backend_tokenizer", None) is None
    digest = guide_cache.tokenizer_digest(slow)
    assert digest.startswith("sha256:")
    assert guide_cache.tokenizer_digest(_slow_tokenizer(vocab("b.txt", "query", "document"))) == digest
    assert guide_cache.tokenizer_digest(_slow_tokenizer(vocab("c.txt", "query", "documents"))) != digest
    assert guide_cache.tokenizer_digest(BertTokenizerFast(str(vocab("d.txt", "query", "document")))) != digest


def hub_snapshot(cache: Path, repo_id: str, model: Path) -> Path:
    """``model``'s files as a download of the Hub repository ``repo_id`` leaves them in the cache directory
    ``cache`` (the Hugging Face layout: ``models--org--name/snapshots/<commit>``, with ``refs/main`` naming it)."""
    repo, commit = cache / f"models--{repo_id.replace('/', '--')}", "0" * 40
    shutil.copytree(model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_guide_directory_of_local_and_downloaded_guides(guide_dir, tmp_path, monkeypatch):
    """The guide's files are a local directory itself, or the snapshot of a Hub id (or of a bare name of the
    sentence-transformers organisation) in the Hugging Face cache; None for an id that has not been downloaded."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # this test's Hugging Face cache
    own = hub_snapshot(cache, "cgist-tests/tiny-guide", guide_dir)
    organisation = hub_snapshot(cache, "sentence-transformers/cgist-tiny-guide", guide_dir)
    monkeypatch.chdir(guide_dir.parent)
    assert guide_cache.guide_directory(guide_dir.name) == guide_dir.resolve()
    assert guide_cache.guide_directory("cgist-tests/tiny-guide").resolve() == own.resolve()
    assert guide_cache.guide_directory("cgist-tiny-guide").resolve() == organisation.resolve()
    assert guide_cache.guide_directory("cgist-tests/not-downloaded") is None
    assert guide_cache.guide_directory("cgist-not-downloaded") is None


def test_precomputed_guide_whose_files_are_not_local(mode_argv, guide_dir, tmp_path, capsys, monkeypatch):
    """The cache is keyed by the guide's files: a Hub id that loads, but from elsewhere than the Hugging Face cache
    (here the sentence-transformers cache in $SENTENCE_TRANSFORMERS_HOME), stops the run (exit 2) once loaded, asking
    for a local directory; nothing is cached."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty Hugging Face cache
    hub_snapshot(tmp_path / "st-home", "cgist-tests/tiny-guide", guide_dir)
    monkeypatch.setenv("SENTENCE_TRANSFORMERS_HOME", str(tmp_path / "st-home"))
    loads = Loads(monkeypatch)
    argv = [*mode_argv, "--guide", "cgist-tests/tiny-guide", "--guide-mode", "precomputed",
            "--guide-cache", str(tmp_path / "cache")]
    _check(argv, capsys, code=2, out_dir=tmp_path / "out",
           message="--guide-mode precomputed keys its cache by the guide's files, but the files of "
           "'cgist-tests/tiny-guide' are not in a local directory or the Hugging Face cache; pass a local directory "
           "as --guide")
    assert loads.options == ["--model", "--guide"]  # the guide loaded: its files were looked for again
    assert not (tmp_path / "cache").exists()


def _precomputed_config(mode_argv: list[str], guide_dir: Path, cache: Path) -> config.RunConfig:
    """The RunConfig of a --guide-mode precomputed run of ``mode_argv`` with the guide ``guide_dir``."""
    argv = ["train", *mode_argv, "--guide", str(guide_dir), "--guide-mode", "precomputed", "--guide-cache", str(cache),
            "--output-dir", str(cache.parent / "out")]
    return config.RunConfig.from_args(build_parser().parse_args(argv), argv)


def test_an_unwritable_guide_cache_only_warns(mode_argv, guide_dir, tmp_path, capsys):
    """Where the cache entry cannot be written (here a file holds the name of the cache's folder), the guide's
    embeddings are still returned for training, with a warning on stderr that names the entry and the error; the
    file is left alone."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "guide-embeddings").write_text("mine")
    run_config = _precomputed_config(mode_argv, guide_dir, cache)
    student = run.load_model("--model", run_config.student, run_config.device, run_config.max_seq_length)
    train_set = run_config.pairs.select(range(8))
    labelled, precomputed = run.guide_embeddings(run_config, student, train_set)
    captured = capsys.readouterr()
    assert labelled.column_names == ["anchor", "positive", "label"] and labelled["anchor"] == train_set["anchor"]
    entry = precomputed["entry"]
    assert not precomputed["cached"] and Path(entry).parent == cache / "guide-embeddings"
    assert (f"cgist train: warning: cannot write the guide cache {entry} ([Errno {errno.EEXIST}] File exists: "
            in captured.err and "training goes on without it" in captured.err)
    assert "Guide embeddings cached" not in captured.out
    assert [p.name for p in cache.iterdir()] == ["guide-embeddings"]
    assert (cache / "guide-embeddings").read_text() == "mine"


def test_the_guide_is_freed_before_the_cuda_cache_is_emptied(mode_argv, guide_dir, tmp_path, monkeypatch):
    """On a CUDA device, once the guide has embedded the training split, nothing holds it any more when the CUDA
    cache is emptied, so its memory goes back to the device before training. The device is simulated (this machine
    may have no GPU): the guide runs on the CPU, and ``torch.cuda.empty_cache`` records what is alive when called."""
    run_config = dataclasses.replace(_precomputed_config(mode_argv, guide_dir, tmp_path / "cache"),
                                     device=torch.device("cuda"))
    student = run.load_model("--model", run_config.student, torch.device("cpu"), run_config.max_seq_length)
    guides, alive = [], []
    load_model = run.load_model

    def load_on_the_cpu(option, path, device, *args):
        assert (option, device.type) == ("--guide", "cuda")
        model = load_model(option, path, torch.device("cpu"), *args)
        guides.append(weakref.ref(model))
        return model

    monkeypatch.setattr(run, "load_model", load_on_the_cpu)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive.append([guide() is not None for guide in guides]))
    train_set = run_config.pairs.select(range(8))
    labelled, precomputed = run.guide_embeddings(run_config, student, train_set)
    assert alive == [[False]]
    assert labelled.column_names == ["anchor", "positive", "label"] and not precomputed["cached"]


@pytest.mark.parametrize("mode", ["self", "none"])
def test_self_and_none_load_no_guide(mode, mode_argv, tmp_path, capsys, monkeypatch):
    loads = Loads(monkeypatch)
    loads.refuse_guide = True
    summary, stdout = _train([*mode_argv, "--guide-mode", mode], tmp_path / "out", capsys)
    assert loads.options == ["--model"] and summary["guide_mode"] == mode and summary["guide_embeddings"] is None
    assert f"guide mode: {mode} (" in stdout
    assert f'"guide_mode": "{mode}"' in (tmp_path / "out" / "README.md").read_text()
    student = Path(mode_argv[mode_argv.index("--model") + 1])
    before, after = (load_file(str(next(d.glob("**/model.safetensors")))) for d in (student, tmp_path / "out"))
    assert any(not torch.equal(before[k], after[k]) for k in before), "training did not change the student"


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert guide_cache.default_cache_dir() == tmp_path / "xdg" / "cgist"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert guide_cache.default_cache_dir() == tmp_path / "home" / ".cache" / "cgist"


# ---------------------------------------------------------------------------------------------- module structure

TRAIN_MODULES = {"arguments", "config", "run", "trainer", "output", "guide_cache", "report"}


def cli_imports(source: str, modules: set[str]) -> set[str]:
    """The modules of cgist/cli (``__init__`` for the package) that a module of it imports, anywhere in ``source``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [alias.name for alias in node.names]
            found |= {name.split(".")[0] if name.split(".")[0] in modules else "__init__" for name in names}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            absolute = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found |= {name.removeprefix("cgist.cli").lstrip(".").split(".")[0] or "__init__" for name in absolute
                      if name == "cgist.cli" or name.startswith("cgist.cli.")}
    return found


def test_cli_modules_import_no_circle_and_neither_command_the_other():
    """The package registers each command; each command imports what they share from ``common``, never the other
    command nor the package; and no chain of imports leads back to where it started."""
    cli = Path(arguments.__file__).parent
    modules = {path.stem for path in cli.glob("*.py")}
    assert {"__init__", "common", "doctor"} | TRAIN_MODULES <= modules
    graph = {name: cli_imports((cli / f"{name}.py").read_text(encoding="utf-8"), modules) for name in modules}
    assert cli_imports("from . import doctor, common\nfrom .run import x\ndef f():\n    from . import main\n"
                       "    import cgist.cli.output", modules) == {"doctor", "common", "run", "__init__", "output"}
    assert graph["__init__"] >= {"arguments", "doctor", "common"}
    assert graph["common"] == set()
    assert not graph["doctor"] & TRAIN_MODULES
    assert not any("doctor" in graph[name] for name in TRAIN_MODULES)
    assert [name for name in modules if "__init__" in graph[name] and name != "__init__"] == []

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(name == target or (name not in seen and reaches(name, target, seen | {name}))
                   for name in graph[start])

    assert [name for name in sorted(modules) if reaches(name, name, set())] == []


def test_the_stages_of_a_run_take_its_config_not_the_parsed_arguments():
    """Only ``run_train`` sees the parsed arguments, to build the RunConfig; every stage after it takes that."""
    stages = [run.train, run._load_models, run._score_before, run._build_trainer, run._fit, run._publish_run,
              run._summary, run.guide_embeddings, run._trainer_arguments]
    assert [name for name, value in vars(run).items() if inspect.isfunction(value) and value.__module__ == run.__name__
            and "args" in inspect.signature(value).parameters] == ["run_train"]
    assert all(next(iter(inspect.signature(stage).parameters)) == "config" for stage in stages)
    assert "arguments" not in cli_imports(Path(run.__file__).read_text(encoding="utf-8"), {"arguments", "config"})


# ---------------------------------------------------------------------------------------------- without GradCache


@pytest.mark.parametrize("how", ["--no-cache", "one mini-batch"])
def test_training_without_gradient_cache(how, mode_argv, tmp_path, capsys):
    """--no-cache, or a mini-batch that holds the whole batch, trains with FusedGISTEmbedLoss (one forward pass of the
    student per step); the summary names the loss, the weights move, and --resume compares the choice."""
    argv = [*mode_argv, "--no-cache"] if how == "--no-cache" else [*mode_argv, "--mini-batch-size", "6"]
    summary, stdout = _train(argv, tmp_path / "plain", capsys)
    assert summary["loss"] == "FusedGISTEmbedLoss" and summary["mini_batch_size"] is None
    assert "loss: FusedGISTEmbedLoss (no GradCache: the student embedded each batch of 6 at once)" in stdout
    assert "in FusedGISTEmbedLoss.calculate_loss" in stdout
    assert 0 < summary["timing"]["loss_s"] < summary["timing"]["step_s"]
    assert set(summary["guide"]) >= {"guide/masked_ap", "guide/theta_mean"}
    cached, stdout = _train(mode_argv, tmp_path / "cached", capsys)
    assert cached["loss"] == "FusedCachedGISTLoss" and "loss: FusedCachedGISTLoss (GradCache: mini-batches of 4)" in stdout
    assert any(not torch.equal(v, _weights(tmp_path / "cached")[k]) for k, v in _weights(tmp_path / "plain").items())
    if how == "--no-cache":
        parser = build_parser()
        saved = config.training_options(parser.parse_args(["train", *argv]), "sha256:x")
        with pytest.raises(UsageError, match="--no-cache differs from the checkpoint's: not given here, given in"):
            config.check_resume(saved, config.training_options(parser.parse_args(["train", *mode_argv]), "sha256:x"),
                                Path("checkpoint-2"))
