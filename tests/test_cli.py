"""``cgist train``: argument parsing, bad inputs (exit 2, nothing written) and a tiny end-to-end run (tiny BERT
student, real MiniLM guide, a small JSONL file). The data loaders' own tests are in test_data.py."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_models import tiny_model
from safetensors.torch import load_file
from test_data import pairs, write_csv, write_jsonl  # noqa: F401 (pairs is a fixture)

from cgist.cli import arguments, main, report, run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory) -> Path:
    """A saved tiny BERT SentenceTransformer sharing the guide's tokenizer."""
    root = tmp_path_factory.mktemp("student")
    model = tiny_model(root / "bert", dtype=torch.float32)
    model.save(str(root / "st"))
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
    args = arguments.build_parser().parse_args(["train"])
    assert (args.model, args.guide, args.data) == (None, None, None)
    assert (args.batch_size, args.mini_batch_size, args.max_seq_length) == (32, 16, 64)
    assert args.lr == 1e-4 and args.max_pairs is None
    assert (args.temperature, args.margin, args.margin_strategy) == (0.01, 0.0, "absolute")
    assert args.contrast_anchors and args.contrast_positives
    assert args.output_dir == arguments.DEFAULT_OUTPUT_DIR
    assert arguments.max_steps(args) == arguments.DEFAULT_STDLIB_STEPS
    assert (args.save_steps, args.save_total_limit, args.resume, args.overwrite) == (None, 2, False, False)
    assert 1 <= arguments.save_steps(args) == arguments.DEFAULT_STDLIB_SAVE_STEPS < arguments.DEFAULT_STDLIB_STEPS


def test_parser_options():
    args = arguments.build_parser().parse_args(
        ["train", "--data", "x.jsonl", "--batch-size", "8", "--mini-batch-size", "3", "--epochs", "2", "--lr",
         "1e-4", "--temperature", "0.05", "--margin", "0.1", "--margin-strategy", "relative",
         "--no-contrast-anchors", "--no-contrast-positives", "--seed", "7", "--device", "cpu"]
    )
    assert (args.data, args.batch_size, args.mini_batch_size, args.epochs, args.lr) == ("x.jsonl", 8, 3, 2.0, 1e-4)
    assert (args.temperature, args.margin, args.margin_strategy, args.seed) == (0.05, 0.1, "relative", 7)
    assert not args.contrast_anchors and not args.contrast_positives
    assert arguments.max_steps(args) == -1  # a file trains for --epochs
    assert arguments.max_steps(arguments.build_parser().parse_args(["train", "--epochs", "1"])) == -1
    assert arguments.max_steps(arguments.build_parser().parse_args(["train", "--data", "x", "--max-steps", "3"])) == 3
    assert arguments.save_steps(args) == arguments.DEFAULT_SAVE_STEPS
    assert arguments.save_steps(arguments.build_parser().parse_args(["train", "--max-steps", "3"])) == 500
    assert arguments.save_steps(arguments.build_parser().parse_args(["train", "--save-steps", "3"])) == 3


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train"], "cgist train --resume"),
        (["train", "--data", "my pairs.jsonl", "--overwrite", "--lr", "1e-5"],
         "cgist train --data 'my pairs.jsonl' --lr 1e-5 --resume"),
        (["train", "--ov", "--max-steps", "9"], "cgist train --max-steps 9 --resume"),
        (["train", "--output-dir", "out", "--resume"], "cgist train --output-dir out --resume"),
        (["train", "--res", "--output-dir=out"], "cgist train --res --output-dir=out"),
    ],
    ids=["bare", "overwrite-dropped", "abbreviation", "already-resuming", "abbreviated-resume"],
)
def test_resume_command(argv, expected):
    assert arguments.resume_command(argv) == expected
    args = arguments.build_parser().parse_args(argv)
    again = arguments.build_parser().parse_args(shlex.split(expected)[1:])
    assert again.resume and not again.overwrite
    assert {k: v for k, v in vars(again).items() if k not in ("resume", "overwrite")} == \
        {k: v for k, v in vars(args).items() if k not in ("resume", "overwrite")}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "many"], "--batch-size"),
        (["--lr", "0"], "--lr"),
        (["--epochs", "-1"], "--epochs"),
        (["--max-steps", "0"], "--max-steps"),
        (["--eval-fraction", "1"], "--eval-fraction"),
        (["--temperature", "warm"], "--temperature"),
        (["--save-steps", "0"], "--save-steps"),
        (["--save-total-limit", "0"], "--save-total-limit"),
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
                   "--save-steps", "--save-total-limit", "--resume"):
        assert option in result.stdout


# ---------------------------------------------------------------------------------------------- bad inputs


BAD_DATA = {
    "missing-file": (None, "does not exist"),
    "unknown-column": ([{"anchor": "a b", "positive": "c d", "label": "x"}], "unknown column(s) ['label']"),
    "missing-column": ([{"anchor": "a b", "negative": "c d"}], "missing column(s) ['positive']"),
    "empty-jsonl": ([], "empty"),
    "blank-cell": ([{"anchor": "a b", "positive": "c d"}, {"anchor": "e f", "positive": " "}], "row 2, column 'positive'"),
    "one-row": ([{"anchor": "a b", "positive": "c d"}], "at least 2"),
    "ragged-jsonl": ([{"anchor": "a b", "positive": "c d"}, {"anchor": "e", "positive": "f", "negative": "g"}],
                     "line 2 has keys"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data(case, tmp_path, capsys):
    rows, message = BAD_DATA[case]
    path = tmp_path / "pairs.jsonl"
    if rows is not None:
        write_jsonl(path, rows)
    _check(["--data", str(path)], capsys, code=2, out_dir=tmp_path / "out", message=message)


@pytest.mark.parametrize("header, message", [(["anchor", "text"], "unknown column"), (["anchor", "positive"], "empty")],
                         ids=["csv-unknown-column", "csv-empty"])
def test_bad_csv(header, message, tmp_path, capsys):
    path = write_csv(tmp_path / "pairs.csv", header, [])
    _check(["--data", str(path)], capsys, code=2, out_dir=tmp_path / "out", message=message)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "1"], "--batch-size must be at least 2"),
        (["--mini-batch-size", "0"], "--mini-batch-size"),
        (["--temperature", "0"], "temperature"),
        (["--margin", "nan"], "margin"),
        (["--margin-strategy", "squared"], "margin_strategy"),
        (["--backend", "cuda"], "--backend"),
        (["--device", "toaster"], "--device"),
        (["--model", "{tmp}/no-such-model"], "--model"),
        (["--guide", "{tmp}/no-such-guide"], "--guide"),
        (["--model", "{tmp}"], "--model: cannot load"),
    ],
    ids=["batch-1", "mini-batch-0", "temperature-0", "margin-nan", "strategy-squared", "backend-cuda", "device",
         "model-missing", "guide-missing", "model-not-a-model"],
)
def test_bad_options(argv, message, pairs, tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs[:6])
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    argv = [a.replace("{tmp}", str(empty if a == "{tmp}" else tmp_path)) for a in argv]
    _check(["--data", str(data), *argv], capsys, code=2, out_dir=tmp_path / "out", message=message)


def test_existing_output_dir_kept(pairs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier run")
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs[:6])
    _check(["--data", str(data)], capsys, code=2, out_dir=out, message="--overwrite")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


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
