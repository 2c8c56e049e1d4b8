"""``cgist train`` loses nothing: checkpoints, ``--resume`` (also from the precomputed guide's cache), ``--resume
auto`` (continue if there is a checkpoint, else start), the stop on SIGINT/SIGTERM and the non-finite guard.

The signal tests run the real command line in a subprocess with a tiny student and a tiny guide. To make the
signal land in the middle of a step whatever the machine's load, the interrupted run goes through a small
driver that calls ``cgist.cli.main`` with a loss that, once the first checkpoint exists, waits until the test
has sent its signal. The straight and the resumed runs are plain ``python -m cgist train``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers_models import tiny_model
from safetensors.torch import load_file
from test_data import write_jsonl

from cgist.cli import build_parser, main, run
from cgist.cli.config import RunConfig
from cgist.cli.data import stdlib_pairs
from cgist.cli.output import CHECKPOINTS_DIR, RECORD_NAME, checkpoint_step, list_checkpoints, new_staging, read_record
from cgist.losses.gist import FusedCachedGISTLoss
from cgist.stage.stats import GistStats

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}
TIMEOUT_S = 300  # generous: a loaded 2-core machine may be slow, but nothing here waits on luck
STEPS = 9  # 54 training pairs in batches of 8 are 7 steps per epoch, so the runs cross an epoch's end

# Once a checkpoint exists under CHECKPOINTS (argv[3]), every loss computation marks WAITING (argv[2]) and waits
# for the file GO (argv[1]).
PAUSING_DRIVER = """
import sys, time
from pathlib import Path
from cgist.cli import main
from cgist.losses.gist import FusedCachedGISTLoss
from cgist.stage.stats import GistStats

go, waiting, checkpoints = (Path(a) for a in sys.argv[1:4])
calculate_loss = FusedCachedGISTLoss.calculate_loss

def waiting_calculate_loss(self, *args, **kwargs):
    deadline = time.monotonic() + {timeout}
    while any(checkpoints.glob("checkpoint-*")) and not go.exists() and time.monotonic() < deadline:
        waiting.touch()
        time.sleep(0.01)
    return calculate_loss(self, *args, **kwargs)

FusedCachedGISTLoss.calculate_loss = waiting_calculate_loss
sys.exit(main(sys.argv[4:]))
""".format(timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tiny student, a tiny guide (same tokenizer), 60 real pairs, and the options of every run here."""
    root = tmp_path_factory.mktemp("resume")
    tiny_model(root / "student-bert", dtype=torch.float32).save(str(root / "student"))
    tiny_model(root / "guide-bert", dtype=torch.float32, hidden_size=16, seed=1).save(str(root / "guide"))
    data = write_jsonl(root / "pairs.jsonl", stdlib_pairs(60, seed=2))
    argv = ["--model", str(root / "student"), "--guide", str(root / "guide"), "--data", str(data),
            "--max-steps", str(STEPS), "--save-steps", "2", "--batch-size", "8", "--mini-batch-size", "4",
            "--max-seq-length", "16", "--lr", "1e-2", "--device", "cpu"]
    return {"root": root, "argv": argv}


def cgist(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cgist", *argv], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def straight(setup) -> Path:
    """The uninterrupted run."""
    out = setup["root"] / "straight"
    result = cgist("train", *setup["argv"], "--output-dir", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


class Run:
    """A run to interrupt, in a subprocess that pauses in the step after its first checkpoint; stderr is collected."""

    def __init__(self, setup: dict, out: Path) -> None:
        self.out, self.go, self.waiting = out, out.parent / f"{out.name}.go", out.parent / f"{out.name}.waiting"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PAUSING_DRIVER, str(self.go), str(self.waiting), str(out / CHECKPOINTS_DIR),
             "train", *setup["argv"], "--output-dir", str(out)],
            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.chunks: list[str] = []
        self.reader = threading.Thread(target=lambda: self.chunks.extend(iter(self.proc.stderr.readline, "")))
        self.reader.start()

    @property
    def stderr(self) -> str:
        return "".join(self.chunks)

    def wait_until(self, condition, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not condition():
            assert self.proc.poll() is None, f"exited with {self.proc.returncode} before {what}:\n{self.stderr[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} after {TIMEOUT_S} s"
            time.sleep(0.05)

    def first_checkpoint(self) -> Path:
        """The first checkpoint, once it exists and the run waits in the middle of the next step."""
        self.wait_until(lambda: list_checkpoints(self.out / CHECKPOINTS_DIR), "first checkpoint")
        self.wait_until(self.waiting.exists, "pause in the step after the first checkpoint")
        (first,) = list_checkpoints(self.out / CHECKPOINTS_DIR)
        return first

    def finish(self) -> int:
        status = self.proc.wait(timeout=TIMEOUT_S)
        self.reader.join(timeout=TIMEOUT_S)
        return status

    def line(self, start: str) -> str:
        """The one stderr line that starts with ``start``."""
        (line,) = [line for line in self.stderr.splitlines() if line.startswith(start)]
        return line


def assert_no_model_and_no_leftovers(out: Path) -> None:
    assert not (out / "modules.json").exists() and not (out / "cgist_train.json").exists()
    assert not [p.name for p in (out / CHECKPOINTS_DIR).iterdir() if p.name.startswith(".")]
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}-")]


def resume_and_compare(stop_line: str, out: Path, straight: Path) -> dict:
    """Run the command the stop line gives; it must reach the straight run's weights and metrics."""
    command = shlex.split(stop_line.split("resume with: ", 1)[1])
    assert command[:2] == ["cgist", "train"] and command[-1] == "--resume"
    result = cgist(*command[1:])
    assert result.returncode == 0, result.stderr[-3000:]
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)
    summary, reference = (json.loads((d / "cgist_train.json").read_text()) for d in (out, straight))
    assert (summary["before"], summary["after"]) == (reference["before"], reference["after"])
    assert summary["steps"] == reference["steps"] == STEPS
    return summary


def test_straight_run_trains_and_keeps_checkpoints(setup, straight):
    """The reference itself: training changed the student; the newest two checkpoints stay, in the Trainer's format."""
    initial = load_file(str(setup["root"] / "student" / "model.safetensors"))
    trained = load_file(str(straight / "model.safetensors"))
    assert any(not torch.equal(initial[k], trained[k]) for k in initial)
    checkpoints = list_checkpoints(straight / CHECKPOINTS_DIR)
    assert [p.name for p in checkpoints] == [f"checkpoint-{STEPS - 1}", f"checkpoint-{STEPS}"]
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
                 RECORD_NAME):
        assert (checkpoints[-1] / name).is_file(), name
    record = read_record(checkpoints[-1])
    assert record["step"] == STEPS and record["options"]["--batch-size"] == 8
    assert record["before"] == json.loads((straight / "cgist_train.json").read_text())["before"]
    assert json.loads((straight / "cgist_train.json").read_text())["checkpoints"] == [p.name for p in checkpoints]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_after_the_step_then_resume_matches(signum, setup, straight, tmp_path):
    """Either signal finishes the step in progress, saves it and stops; the resume from there reaches the straight
    run. The two stops leave the same checkpoint and the same command, so the resume runs after SIGINT's alone."""
    run = Run(setup, tmp_path / "run")
    first = run.first_checkpoint()
    run.proc.send_signal(signum)
    run.go.touch()
    assert run.finish() == 128 + signum, run.stderr[-3000:]

    # The step in progress when the signal came was finished and saved; then the run stopped.
    step = checkpoint_step(first) + 1
    name = signal.Signals(signum).name
    line = run.line(f"cgist train: stopped by {name}")
    assert line.startswith(f"cgist train: stopped by {name} after step {step}; ")
    assert f"checkpoint-{step}" in line
    assert [p.name for p in list_checkpoints(run.out / CHECKPOINTS_DIR)] == [first.name, f"checkpoint-{step}"]
    assert_no_model_and_no_leftovers(run.out)

    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command == ["cgist", "train", *setup["argv"], "--output-dir", str(run.out), "--resume"]
    if signum == signal.SIGINT:
        summary = resume_and_compare(line, run.out, straight)
        assert summary["resumed_after"] == step and summary["timing"]["steps"] == STEPS - step


def test_second_sigint_stops_at_once(setup, straight, tmp_path):
    run = Run(setup, tmp_path / "run")
    first = run.first_checkpoint()
    run.proc.send_signal(signal.SIGINT)
    run.wait_until(lambda: "SIGINT: finishing the current step" in run.stderr, "message about the first SIGINT")
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 130, run.stderr[-3000:]

    line = run.line("cgist train: stopped at once")
    assert "second SIGINT" in line and f"checkpoint: {first}" in line
    assert list_checkpoints(run.out / CHECKPOINTS_DIR) == [first]  # the unfinished step left nothing
    assert_no_model_and_no_leftovers(run.out)
    assert resume_and_compare(line, run.out, straight)["resumed_after"] == checkpoint_step(first)


# ---------------------------------------------------------------------------------------------- in-process runs


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """``main(["train", *argv])`` in this process: the exit status and stderr."""
    status = main(["train", *argv])
    return status, capsys.readouterr().err


def replace_option(argv: list[str], option: str, value: str) -> list[str]:
    """``argv`` with ``option`` set to ``value`` (added if absent)."""
    if option not in argv:
        return [*argv, option, value]
    at = argv.index(option)
    return [*argv[:at + 1], value, *argv[at + 2:]]


@pytest.fixture(scope="module")
def finished(setup, tmp_path_factory) -> Path:
    """A finished two-step run (in this process), with its final checkpoint."""
    out = tmp_path_factory.mktemp("finished") / "run"
    argv = replace_option(setup["argv"], "--max-steps", "2")
    assert main(["train", *argv, "--output-dir", str(out)]) == 0
    return out


def listing(directory: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(directory)), p.stat().st_mtime_ns) for p in directory.rglob("*"))


@pytest.mark.parametrize(
    "change, message",
    [
        (("--batch-size", "6"), "--batch-size differs from the checkpoint's: 6 here, 8 in "),
        (("--mini-batch-size", "2"), "--mini-batch-size differs from the checkpoint's: 2 here, 4 in "),
        (("--margin", "0.1"), "--margin differs from the checkpoint's: 0.1 here, 0.0 in "),
        (("--lr", "1e-3"), "--lr differs from the checkpoint's: 0.001 here, 0.01 in "),
        (("--guide", "{student}"), "--guide differs from the checkpoint's: {student} here, {guide} in "),
        (("--data", "{other data}"), "--data differs from the checkpoint's (compared by content): sha256:"),
        (("--no-contrast-anchors", None), "--no-contrast-anchors differs from the checkpoint's: given here, not given"),
        (("--guide-mode", "precomputed"), "--guide-mode differs from the checkpoint's: precomputed here, model in "),
        (("--max-pairs", "50"), "--max-pairs differs from the checkpoint's: 50 here, unset in "),
    ],
    ids=["batch-size", "mini-batch-size", "margin", "lr", "guide", "data", "contrast-anchors", "guide-mode",
         "max-pairs"],
)
@pytest.mark.parametrize("resume", [["--resume"], ["--resume", "auto"]], ids=["resume", "resume-auto"])
def test_resume_refuses_other_options(resume, change, message, setup, finished, tmp_path, capsys):
    option, value = change
    argv = replace_option(setup["argv"], "--max-steps", "2")
    if value is None:
        argv = [*argv, option]
    else:
        if value == "{other data}":
            value = str(write_jsonl(tmp_path / "pairs.jsonl", stdlib_pairs(60, seed=3)))
        argv = replace_option(argv, option, value.replace("{student}", str(setup["root"] / "student")))
    message = message.format(student=setup["root"] / "student", guide=setup["root"] / "guide")
    before = listing(finished)
    status, err = run_cli([*argv, "--output-dir", str(finished), *resume], capsys)
    assert status == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("cgist train: error: --resume: ") and message in line, line
    assert "checkpoint-2" in line and "--overwrite" in line
    assert listing(finished) == before


@pytest.mark.parametrize("resume", [["--resume"], ["--resume", "auto"]], ids=["resume", "resume-auto"])
def test_resume_of_a_finished_run_trains_no_further(resume, setup, finished, tmp_path, capsys):
    """As after a stop during the final evaluation: the last checkpoint is loaded, scored and published. What a kill
    while an older checkpoint was being deleted left beside it (a hidden trash folder) is removed."""
    out = tmp_path / "run"
    shutil.copytree(finished / CHECKPOINTS_DIR, out / CHECKPOINTS_DIR)
    trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=out / CHECKPOINTS_DIR)) / "checkpoint-1"
    trash.mkdir()
    (trash / "optimizer.pt").write_bytes(b"half deleted")
    argv = replace_option(setup["argv"], "--max-steps", "2")
    status, err = run_cli([*argv, "--output-dir", str(out), *resume], capsys)
    assert status == 0, err
    assert [p.name for p in (out / CHECKPOINTS_DIR).iterdir()] == ["checkpoint-2"]
    summary, reference = (json.loads((d / "cgist_train.json").read_text()) for d in (out, finished))
    assert (summary["before"], summary["after"], summary["steps"]) == (reference["before"], reference["after"], 2)
    assert summary["timing"]["steps"] == 0 and summary["resumed_after"] == 2
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(finished / "model.safetensors"))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_resume_of_a_checkpoint_that_predates_guide_mode(setup, finished, tmp_path, capsys):
    """A checkpoint whose record has no --guide-mode was trained with the guide model, the only mode there was."""
    out = tmp_path / "run"
    shutil.copytree(finished / CHECKPOINTS_DIR, out / CHECKPOINTS_DIR)
    for checkpoint in list_checkpoints(out / CHECKPOINTS_DIR):
        record = read_record(checkpoint)
        del record["options"]["--guide-mode"]
        (checkpoint / RECORD_NAME).write_text(json.dumps(record))
    argv = replace_option(setup["argv"], "--max-steps", "2")
    before = listing(out)
    status, err = run_cli([*argv, "--guide-mode", "precomputed", "--output-dir", str(out), "--resume"], capsys)
    assert status == 2 and "--guide-mode differs from the checkpoint's: precomputed here, model in " in err, err
    assert listing(out) == before
    status, err = run_cli([*argv, "--output-dir", str(out), "--resume"], capsys)
    assert status == 0, err


def test_precomputed_run_resumes_from_the_cache(setup, tmp_path, capsys, monkeypatch):
    """Resumed with --guide-mode precomputed, a run reads the guide embeddings from the cache (the guide model is
    not loaded) and reaches the weights and scores of the uninterrupted run."""
    argv = [*replace_option(replace_option(setup["argv"], "--max-steps", "4"), "--save-steps", "2"),
            "--save-total-limit", "3", "--guide-mode", "precomputed", "--guide-cache", str(tmp_path / "cache")]
    straight = tmp_path / "straight"
    status, err = run_cli([*argv, "--output-dir", str(straight)], capsys)
    assert status == 0, err
    out = tmp_path / "resumed"
    shutil.copytree(straight / CHECKPOINTS_DIR / "checkpoint-2", out / CHECKPOINTS_DIR / "checkpoint-2")
    load_model = run.load_model

    def load_no_guide(option, *args):
        assert option != "--guide", "the guide model was loaded"
        return load_model(option, *args)

    monkeypatch.setattr(run, "load_model", load_no_guide)
    status, err = run_cli([*argv, "--output-dir", str(out), "--resume"], capsys)
    assert status == 0, err
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)
    summary, reference = (json.loads((d / "cgist_train.json").read_text()) for d in (out, straight))
    assert (summary["before"], summary["after"]) == (reference["before"], reference["after"])
    assert summary["resumed_after"] == 2 and summary["guide_embeddings"]["cached"]


def test_overwrite_starts_afresh(setup, finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    argv = replace_option(replace_option(setup["argv"], "--max-steps", "3"), "--save-steps", "1")
    status, err = run_cli([*argv, "--output-dir", str(out), "--overwrite"], capsys)
    assert status == 0, err
    checkpoints = list_checkpoints(out / CHECKPOINTS_DIR)
    assert [p.name for p in checkpoints] == ["checkpoint-2", "checkpoint-3"]
    assert all(read_record(p)["options"]["--max-steps"] == 3 for p in checkpoints)  # none left from the old run


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
        (["--resume", "auto", "--overwrite"], "--resume and --overwrite exclude each other"),
        (["--resume"], "--resume: no complete checkpoint in"),
        ([], "pass --resume to continue that run"),
    ],
    ids=["resume-and-overwrite", "resume-auto-and-overwrite", "resume-without-checkpoint",
         "checkpoints-without-resume"],
)
def test_output_dir_usage_errors(extra, message, setup, finished, tmp_path, capsys):
    out = finished if extra != ["--resume"] else tmp_path / "empty"
    before = listing(finished)
    status, err = run_cli([*setup["argv"], "--output-dir", str(out), *extra], capsys)
    assert status == 2
    (line,) = err.strip().splitlines()
    assert message in line, line
    assert listing(finished) == before and not (tmp_path / "empty").exists()


@pytest.mark.parametrize("when", ["loading-the-data", "loading-the-student", "loading-the-student-to-resume"])
def test_sigint_before_training_stops_at_once(when, setup, finished, tmp_path, capsys, monkeypatch):
    """Ctrl-C before training starts (the options being resolved, the models loaded) stops the run at once, exit 130,
    with one line: start again where no checkpoint had been written, else the checkpoint and the command that
    continues from it. Nothing is written."""
    from cgist.cli import config

    def interrupt() -> None:
        signal.raise_signal(signal.SIGINT)  # Python's own handler: KeyboardInterrupt
        raise AssertionError("SIGINT did not interrupt")

    load_model = run.load_model

    def load_model_interrupted(option, *args):
        if option == "--model":
            interrupt()
        return load_model(option, *args)

    if when == "loading-the-data":
        monkeypatch.setattr(config, "load_data", lambda args: interrupt())
    else:
        monkeypatch.setattr(run, "load_model", load_model_interrupted)
    out = tmp_path / "run"
    argv = [*replace_option(setup["argv"], "--max-steps", "2"), "--output-dir", str(out)]
    if when == "loading-the-student-to-resume":
        shutil.copytree(finished / CHECKPOINTS_DIR, out / CHECKPOINTS_DIR)
        argv.append("--resume")
    before = listing(out) if out.exists() else None
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        status, err = run_cli(argv, capsys)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert status == 130, err
    (line,) = [line for line in err.splitlines() if line.startswith("cgist train:")]
    if when == "loading-the-student-to-resume":
        command = shlex.join(["cgist", "train", *argv])
        assert line == (f"cgist train: interrupted; checkpoint: {out.resolve() / CHECKPOINTS_DIR / 'checkpoint-2'}; "
                        f"resume with: {command}")
    else:
        assert line == "cgist train: interrupted; no checkpoint had been written, so start the run again"
    assert (listing(out) if out.exists() else None) == before


# ---------------------------------------------------------------------------------------------- --resume auto


def leave_unfinished_start(out: Path) -> None:
    """What a run killed (SIGKILL) before its first checkpoint leaves in ``out``: the checkpoints folder with a save
    cut short in its hidden staging folder, and the hidden remains of an earlier run's checkpoints being deleted."""
    (out / CHECKPOINTS_DIR).mkdir(parents=True, exist_ok=True)
    staged = new_staging(out / CHECKPOINTS_DIR) / "checkpoint-2"
    staged.mkdir()
    (staged / "model.safetensors").write_bytes(b"cut short")
    trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=out)) / CHECKPOINTS_DIR / "checkpoint-5"
    trash.mkdir(parents=True)
    (trash / "optimizer.pt").write_bytes(b"half deleted")


def run_config(argv: list[str]) -> RunConfig:
    return RunConfig.from_args(build_parser().parse_args(["train", *argv]), ["train", *argv])


@pytest.mark.parametrize("holds", ["nothing", "an-empty-folder", "leftovers", "checkpoints"])
def test_resume_auto_resumes_where_there_is_a_checkpoint_and_else_starts(holds, setup, straight, tmp_path):
    """The decision, made before anything is written: the newest checkpoint where there is one (with the scores it
    recorded), else a new run in a missing or empty directory or one with only what an unfinished start left."""
    out = tmp_path / "run"
    if holds == "an-empty-folder":
        out.mkdir()
    elif holds == "leftovers":
        leave_unfinished_start(out)
    elif holds == "checkpoints":
        shutil.copytree(straight / CHECKPOINTS_DIR, out / CHECKPOINTS_DIR)
        leave_unfinished_start(out)
    before = listing(out) if out.exists() else None
    config = run_config([*setup["argv"], "--output-dir", str(out), "--resume", "auto"])
    assert (listing(out) if out.exists() else None) == before
    if holds == "checkpoints":
        newest = out.resolve() / CHECKPOINTS_DIR / f"checkpoint-{STEPS}"
        assert [p.name for p in list_checkpoints(out / CHECKPOINTS_DIR)] == [f"checkpoint-{STEPS - 1}", newest.name]
        assert config.resume_from == newest and dict(config.scores_before) == read_record(newest)["before"]
    else:
        assert (config.resume_from, config.scores_before) == (None, None)
    assert config.resume_command.endswith(" --resume auto")


def test_resume_auto_starts_over_an_unfinished_start_then_resumes(setup, finished, tmp_path, capsys):
    """A job requeued after a kill before its first checkpoint trains from the start (what that run left is
    removed), and requeued once more, after it finished, it continues from its final checkpoint."""
    out = tmp_path / "run"
    leave_unfinished_start(out)
    argv = [*replace_option(setup["argv"], "--max-steps", "2"), "--output-dir", str(out), "--resume", "auto"]
    status, err = run_cli(argv, capsys)
    assert status == 0, err
    summary, reference = (json.loads((d / "cgist_train.json").read_text()) for d in (out, finished))
    assert summary["resumed_after"] is None and summary["timing"]["steps"] == 2
    assert (summary["before"], summary["after"], summary["args"]["resume"]) == (reference["before"], reference["after"],
                                                                               "auto")
    assert [p.name for p in (out / CHECKPOINTS_DIR).iterdir()] == ["checkpoint-2"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(finished / "model.safetensors"))
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)

    status, err = run_cli(argv, capsys)
    assert status == 0, err
    again = json.loads((out / "cgist_train.json").read_text())
    assert (again["resumed_after"], again["timing"]["steps"], again["after"]) == (2, 0, summary["after"])
    assert all(torch.equal(w, ours[k]) for k, w in load_file(str(out / "model.safetensors")).items())


@pytest.mark.parametrize("holds", ["a-published-model", "a-file-of-its-own", "a-file-in-checkpoints"])
def test_resume_auto_refuses_files_that_no_unfinished_start_left(holds, setup, finished, tmp_path, capsys):
    """Without a checkpoint, anything but what a run leaves before its first one stops the run (exit 2, one line,
    nothing touched), as a non-empty --output-dir does without --overwrite."""
    out = tmp_path / "run"
    if holds == "a-published-model":
        shutil.copytree(finished, out, ignore=shutil.ignore_patterns(CHECKPOINTS_DIR))
        assert (out / "model.safetensors").is_file()
    else:
        leave_unfinished_start(out)
        notes = out / CHECKPOINTS_DIR / "notes.txt" if holds == "a-file-in-checkpoints" else out / "notes.txt"
        notes.write_text("mine")
    before = listing(out)
    status, err = run_cli([*setup["argv"], "--output-dir", str(out), "--resume", "auto"], capsys)
    assert status == 2
    (line,) = err.strip().splitlines()
    assert line == (f"cgist train: error: --output-dir {out} already has files and no checkpoint for --resume auto "
                    "to continue from; pass --overwrite instead of --resume auto to replace them")
    assert listing(out) == before


# ---------------------------------------------------------------------------------------------- non-finite guard


def assert_stopped_without_model(status: int, err: str, out: Path, step: int) -> str:
    """Exit 3 with one line; the checkpoints are those of the steps before ``step``; nothing is published."""
    assert status == 3, err
    (line,) = [line for line in err.splitlines() if line.startswith("cgist train:")]
    assert line.startswith("cgist train: error: ") and f" at step {step}; " in line
    assert "--lr (now" in line and "--margin" in line
    checkpoints = list_checkpoints(out / CHECKPOINTS_DIR)
    assert [checkpoint_step(p) for p in checkpoints] == list(range(max(1, step - 2), step))  # --save-steps 1
    assert f"(the newest checkpoint, from before it: {checkpoints[-1]})" in line
    weights = load_file(str(checkpoints[-1] / "model.safetensors"))
    assert all(bool(w.isfinite().all()) for w in weights.values())
    assert_no_model_and_no_leftovers(out)
    return line


def test_non_finite_from_a_huge_learning_rate(setup, tmp_path, capsys):
    out = tmp_path / "run"
    argv = replace_option(replace_option(setup["argv"], "--lr", "1e6"), "--save-steps", "1")
    status, err = run_cli([*argv, "--output-dir", str(out)], capsys)
    assert status == 3, err
    line = next(line for line in err.splitlines() if line.startswith("cgist train:"))
    step = int(line.split(" at step ", 1)[1].split(";", 1)[0])
    assert 1 < step <= STEPS
    line = assert_stopped_without_model(status, err, out, step)
    assert " is nan at step " in line or " is inf at step " in line or " is -inf at step " in line
    assert "--lr (now 1e+06)" in line


@pytest.mark.parametrize("output", ["new", "existing-empty"])
def test_non_finite_at_the_first_step_leaves_no_folders(output, setup, tmp_path, capsys, monkeypatch):
    """A NaN loss in step 1, before any checkpoint: exit 3, no checkpoint named, and the folders the run made are
    removed (the output directory itself only where the run made it)."""
    calculate_loss = FusedCachedGISTLoss.calculate_loss

    def nan_calculate_loss(self, *args, **kwargs):
        return calculate_loss(self, *args, **kwargs) * float("nan")

    monkeypatch.setattr(FusedCachedGISTLoss, "calculate_loss", nan_calculate_loss)
    out = tmp_path / "run"
    if output == "existing-empty":
        out.mkdir()
    status, err = run_cli([*setup["argv"], "--output-dir", str(out)], capsys)
    assert status == 3, err
    (line,) = [line for line in err.splitlines() if line.startswith("cgist train:")]
    assert line.startswith("cgist train: error: the training loss is nan at step 1; ")
    assert "(no checkpoint had been written)" in line
    assert (list(out.iterdir()) if out.exists() else None) == ([] if output == "existing-empty" else None)
    assert [p.name for p in tmp_path.iterdir()] == (["run"] if output == "existing-empty" else [])


@pytest.mark.parametrize("fault", ["loss", "stats", "gradient"])
def test_non_finite_injected(fault, setup, tmp_path, capsys, monkeypatch):
    """A NaN made inside step 3: in the loss value, in the loss stage's statistics, or in the gradients that reach
    the student."""
    calculate_loss = FusedCachedGISTLoss.calculate_loss
    calls = []

    def faulty_calculate_loss(self, reps, reps_guided, *, with_backward=False):
        loss = calculate_loss(self, reps, reps_guided, with_backward=with_backward)
        calls.append(with_backward)
        if len(calls) < 3:
            return loss
        if fault == "gradient":
            reps[0][0].grad.fill_(float("nan"))
        elif fault == "stats":
            self.last_stats = GistStats(masked={}, candidates={}, positive_only=0, anchors=8, theta_mean=0.5,
                                        threshold_mean=float("nan"))
        else:
            loss = loss * float("nan")
        return loss

    monkeypatch.setattr(FusedCachedGISTLoss, "calculate_loss", faulty_calculate_loss)
    out = tmp_path / "run"
    argv = replace_option(setup["argv"], "--save-steps", "1")
    status, err = run_cli([*argv, "--output-dir", str(out)], capsys)
    line = assert_stopped_without_model(status, err, out, step=3)
    what = {"loss": "the training loss", "stats": "the loss stage's threshold_mean", "gradient": "the gradient norm"}[fault]
    assert f"error: {what} is nan at step 3; " in line
    assert calls == [True, True, True]  # stopped within the step, before any later one
