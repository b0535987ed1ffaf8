"""The task objects: each one's forward is the model's own output at the positions its loss counts."""

from types import SimpleNamespace

import pytest
import torch

from aiayn.config import ModelConfig
from aiayn.nn.model import build_model
from aiayn.tasks import MASKED_LM, OBJECTIVES, SEQ2SEQ, SEQUENCE_CLASSIFICATION, get_task, resolved, task_of

TINY = ModelConfig(vocab_size=24, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                   max_len=16, dropout=0.0)
TOKENS = SimpleNamespace(pad_id=0, bos_id=1, eos_id=2, unk_id=3, mask_id=4, vocab_size=24)
DATA = SimpleNamespace(source_tokenizer=TOKENS, target_tokenizer=TOKENS, labels=["neg", "pos"])


def test_seq2seq_forward_is_the_full_decoder_output_at_real_target_tokens():
    model = build_model(TINY).eval()
    task = get_task(SEQ2SEQ)
    batch = task.collate(DATA, [([5, 6, 7, 2], [8, 9]), ([10, 2], [11, 12, 13])], generator=None)
    logits, labels = task.forward(model, batch)
    keep = batch["labels"] != -100
    torch.testing.assert_close(logits, model(batch["src"], batch["tgt_in"])[keep])
    assert labels.tolist() == [8, 9, 2, 11, 12, 13, 2]


def test_masked_lm_forward_is_the_head_at_the_masked_positions_only():
    model = build_model(TINY.replace(n_decoder_layers=0, head=MASKED_LM)).eval()
    task = get_task(MASKED_LM).configured(SimpleNamespace(mlm_probability=0.5))
    batch = task.collate(DATA, [[1, 5, 6, 7, 8, 2], [1, 9, 10, 2]], generator=torch.Generator().manual_seed(3))
    logits, labels = task.forward(model, batch)
    keep = batch["labels"] != -100
    assert 0 < len(labels) == int(keep.sum()) < keep.numel()
    torch.testing.assert_close(logits, model(batch["ids"])[keep])


def test_sequence_classification_scores_predictions_in_split_order():
    task = get_task(SEQUENCE_CLASSIFICATION)
    raw = [SimpleNamespace(text=t, label=label) for t, label in (("a", "neg"), ("b", "pos"), ("c", "pos"))]
    split = SimpleNamespace(items=[([1], 0), ([1], 1), ([1], 1)], raw=raw)
    logits = torch.tensor([[0.0, 1.0], [2.0, 0.0]])  # examples 2 and 0, in batch order
    predictions = task.predictions(logits, torch.tensor([1, 0]), [2, 0])
    scores, shown = task.score(DATA, split, predictions)
    assert predictions == {2: 1, 0: 0}
    assert scores["accuracy"] == 100.0
    assert shown == [("a", "neg", "neg"), ("c", "pos", "pos")]


def test_an_unknown_objective_names_the_choices():
    with pytest.raises(ValueError, match="seq2seq, sequence_classification, token_classification, masked_lm"):
        get_task("translation")


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_each_objective_owns_the_models_it_trains_and_what_they_become(objective):
    """`task_of` finds the objective from the shape its `model_settings` give; what it names resolves."""
    task = get_task(objective)
    settings = task.model_settings(SimpleNamespace(**vars(DATA), shared_tokenizer=True), {})
    assert task_of(TINY.replace(**settings)) is task
    loaded, exporter = (resolved(r) for r in (task.loaded, task.exporter))
    assert isinstance(loaded, type) and callable(exporter) and loaded.from_pretrained is not None
    from aiayn.serve.models import SERVED  # how the server answers with what the task loads

    assert SERVED[loaded].call is not None


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_the_shape_known_before_the_data_is_the_shape_the_data_gives(objective):
    """What the layout times (`shape_before_data`) agrees with what the run will train (`model_settings`)."""
    from aiayn.training import TrainConfig

    task = get_task(objective)
    before = task.shape_before_data(TrainConfig(train="data.txt", objective=objective))
    settings = task.model_settings(SimpleNamespace(**vars(DATA), shared_tokenizer=True), {})
    assert before is None or before.items() <= settings.items()


def test_a_plain_encoder_is_masked_lm_and_an_unowned_shape_is_named():
    assert task_of(TINY.replace(n_decoder_layers=0)) is get_task(MASKED_LM)  # BERT checkpoints load as embedders
    with pytest.raises(ValueError, match=r"no objective trains this model \(encoder-only, head 'ner'\)"):
        task_of(SimpleNamespace(n_decoder_layers=0, causal=False, has_cross_attention=False, head="ner",
                                architecture="encoder-only"))


def test_a_causal_lm_reads_its_text_as_one_stream_in_windows_every_token_a_label_once(tmp_path):
    """nanoGPT's and `group_texts`' reading: documents one after another, cut into windows of `max_source_len`; a
    paragraph longer than the window is trained on whole, where one example a line dropped it."""
    from aiayn.data.readers import read_documents
    from aiayn.tasks import CAUSAL_LM

    text = tmp_path / "book.txt"
    paragraph = "\n".join(f"line {i} of a long paragraph" for i in range(12))
    text.write_text(f"{paragraph}\n\n\nA short one.\nIt ends here.\n\n", encoding="utf-8")
    documents, stats = read_documents(str(text))
    assert documents == [paragraph, "A short one.\nIt ends here."] and stats.kept == 2
    (tmp_path / "lines.txt").write_text("one\ntwo  \nthree\n", encoding="utf-8")
    assert read_documents(str(tmp_path / "lines.txt"))[0] == ["one", "two  ", "three"]  # no blank line: a line each

    cfg = SimpleNamespace(lm_examples="auto", dataset="", max_source_len=8, recipe="auto")
    task = get_task(CAUSAL_LM).configured(cfg)
    assert task.window == 8 and get_task(CAUSAL_LM).configured(SimpleNamespace(**{**vars(cfg), "dataset": "counting"}))\
        .window == 0  # the built-in data sets' sentences stay one a line
    tokens = SimpleNamespace(encode_batch=lambda texts, add_bos, add_eos: [[1, *range(10, 10 + len(t)), 2]
                                                                           for t in texts])
    items, sizes = task.encode(documents, tokens, tokens, [], "train")
    stream = [1, *range(10, 10 + len(documents[0])), 2, 1, *range(10, 10 + len(documents[1])), 2]
    assert all(len(item) <= 9 for item in items) and [n for n, _ in sizes] == [len(item) - 1 for item in items]
    assert [label for item in items for label in item[1:]] == stream[1:]  # each id but the first a label, once
    batch = task.collate(SimpleNamespace(source_tokenizer=TOKENS), items[:2], generator=None)
    assert batch["ids"].shape == (2, 8) and batch["labels"][0].tolist() == items[0][1:]
    assert "every token trained on" in task.encoding_note({"train": (2, SimpleNamespace(lengths=[n for n, _ in sizes],
                                                                                        items=items))})


def test_a_language_model_has_the_shape_gpt2_holds_unless_the_paper_recipe_or_a_key_says_otherwise():
    from aiayn.config import preset
    from aiayn.interop.gpt2 import gpt2_problems
    from aiayn.tasks import CAUSAL_LM

    def shape(recipe, given):
        cfg = SimpleNamespace(lm_examples="auto", dataset="counting", max_source_len=256, recipe=recipe)
        settings = get_task(CAUSAL_LM).configured(cfg).model_settings(None, given)
        return preset("tiny").replace(vocab_size=40, **{**given, **settings})

    default = shape("auto", {})
    assert (default.norm_first, default.positional, default.activation, default.scale_embeddings) == \
        (True, "learned", "gelu_tanh", False)
    assert default.causal and default.tie_embeddings and gpt2_problems(default) == []
    assert shape("auto", {"activation": "relu"}).activation == "relu"  # a key the config sets is kept
    paper = shape("paper", {})
    assert (paper.norm_first, paper.positional, paper.scale_embeddings) == (False, "sinusoidal", True)
