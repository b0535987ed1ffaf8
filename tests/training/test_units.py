"""Schedule, loss, metrics, config files and crash-safe checkpoints."""

import json

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import preset
from aiayn.nn.model import build_model
from aiayn.tasks.metrics import accuracy_and_macro_f1, entity_f1, entity_spans, translation_scores
from aiayn.training import checkpoint as ckpt
from aiayn.training.config import TrainConfig, load_run_config
from aiayn.training.loop import get_lr
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.optim import make_optimizer
from aiayn.training.schedule import Recipe, resolve_recipe


def noam_lr(step: int, *, d_model: int, warmup: int) -> float:
    """The rate `get_lr` gives a recipe whose peak is equation 3's own, d_model^-0.5 * warmup^-0.5."""
    recipe = Recipe(optimizer="adam", schedule="noam", peak_lr=d_model**-0.5 * warmup**-0.5, warmup=warmup,
                    total_steps=1, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0)
    return get_lr(step, recipe, d_model)


def test_noam_schedule_is_the_papers_formula():
    d_model, warmup = 512, 4000
    for step in (1, 100, 3999, 4000, 4001, 100_000):
        expected = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert noam_lr(step, d_model=d_model, warmup=warmup) == pytest.approx(expected)
    peak = noam_lr(warmup, d_model=d_model, warmup=warmup)
    assert noam_lr(warmup - 1, d_model=d_model, warmup=warmup) < peak > noam_lr(warmup + 1, d_model=d_model,
                                                                                warmup=warmup)


def test_recipe_with_the_full_warmup_is_equation_3():
    recipe, notes = resolve_recipe(TrainConfig(dataset="copy"), total_steps=100_000, d_model=512)
    assert notes == [] and (recipe.optimizer, recipe.schedule, recipe.warmup) == ("adam", "noam", 4000)
    assert (recipe.betas, recipe.eps, recipe.weight_decay) == ((0.9, 0.98), 1e-9, 0.0)
    for step in (1, 100, 3999, 4000, 4001, 100_000):
        assert get_lr(step, recipe, 512) == pytest.approx(noam_lr(step, d_model=512, warmup=4000))
    given, notes = resolve_recipe(TrainConfig(dataset="copy", warmup=400), total_steps=1200, d_model=256)
    assert notes == [] and given.warmup == 400  # an explicit warmup is taken as given
    for step in (1, 399, 400, 401, 1200):
        assert get_lr(step, given, 256) == pytest.approx(noam_lr(step, d_model=256, warmup=400))


def test_a_short_run_warms_up_over_a_tenth_of_its_steps_to_the_papers_peak():
    recipe, notes = resolve_recipe(TrainConfig(dataset="copy"), total_steps=300, d_model=512)
    assert recipe.warmup == 30 and "30 steps" in notes[0]
    peak = noam_lr(4000, d_model=512, warmup=4000)
    assert get_lr(30, recipe, 512) == pytest.approx(peak) and get_lr(15, recipe, 512) == pytest.approx(peak / 2)
    assert get_lr(120, recipe, 512) == pytest.approx(peak / 2)  # inverse square root after the warmup
    explicit, _ = resolve_recipe(TrainConfig(dataset="copy", lr=5e-4, schedule="constant"), total_steps=300, d_model=64)
    assert get_lr(30, explicit, 64) == get_lr(300, explicit, 64) == 5e-4


@pytest.mark.parametrize("schedule", ["noam", "linear"])
@pytest.mark.parametrize(("at", "total"), [(50, 2400), (50, 400), (500, 2400), (900, 1500)])
def test_a_replanned_schedule_never_jumps(schedule, at, total):
    """A budget re-plans its steps during the run (after its probe steps, at each validation): the rate goes on from
    where it stood, where a schedule resolved afresh would jump to another warmup's or another end's rate."""
    cfg = TrainConfig(train="data.tsv", lr=3e-3, warmup_fraction=0.3, schedule=schedule)
    first, _ = resolve_recipe(cfg, total_steps=1000, d_model=128)
    fresh, _ = resolve_recipe(cfg, total_steps=total, d_model=128)
    lr = get_lr(at, first, 128)
    again = first.replanned(fresh, step=at, lr=lr)
    rates = [get_lr(step, again, 128) for step in range(at + 1, total + 1)]
    steps = [abs(b - a) for a, b in zip([lr, *rates], rates)]
    # resolved afresh, these re-plans jump by 10-43% of the peak; a step of the re-planned rate moves it under 2%
    assert max(steps) < 0.02 * 3e-3
    if at < first.warmup:
        assert again.warmup == max(fresh.warmup, at + 1)  # a warmup on its way fits the new plan
        assert max(rates) == pytest.approx(3e-3) == get_lr(again.warmup, again, 128)  # and reaches the peak
    else:
        assert again.warmup == first.warmup  # a warmup that is over stays: the inverse square root goes on
    if schedule == "linear":
        assert rates[-1] == 0.0  # decayed to 0 at the new end


def test_fine_tuning_recipe_is_adamw_with_linear_warmup_and_decay():
    recipe, _ = resolve_recipe(TrainConfig(dataset="compare", objective="sequence_classification", init_from="minilm"),
                               total_steps=1000, d_model=384)
    assert (recipe.optimizer, recipe.schedule, recipe.warmup, recipe.peak_lr) == ("adamw", "linear", 100, 3e-5)
    assert (recipe.betas, recipe.eps, recipe.weight_decay) == ((0.9, 0.999), 1e-8, 0.01)
    assert get_lr(50, recipe, 384) == pytest.approx(1.5e-5) and get_lr(550, recipe, 384) == pytest.approx(1.5e-5)
    assert get_lr(1000, recipe, 384) == 0.0
    model = build_model(preset("tiny").replace(n_decoder_layers=0, vocab_size=50))
    optimizer = make_optimizer(model.parameters(), recipe)
    assert isinstance(optimizer, torch.optim.AdamW)
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.01 and all(p.dim() >= 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.dim() == 1 for p in plain["params"])


def test_label_smoothed_loss_matches_torch_cross_entropy():
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    labels[0, 3:] = -100
    loss, nll = label_smoothed_loss(logits, labels, smoothing=0.1)
    keep = labels != -100
    expected = F.cross_entropy(logits[keep], labels[keep], label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, F.cross_entropy(logits[keep], labels[keep], reduction="sum"))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_label_smoothed_loss_gradient_matches_torch(smoothing):
    logits = torch.randn(7, 13, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (7,))
    labels[2] = -100
    scale = torch.linspace(0.5, 2.0, 7, dtype=torch.float64)
    loss, _ = label_smoothed_loss(logits * scale[:, None], labels, smoothing=smoothing)
    (ours,) = torch.autograd.grad(loss, logits)
    keep = labels != -100
    expected_loss = F.cross_entropy((logits * scale[:, None])[keep], labels[keep], label_smoothing=smoothing,
                                    reduction="sum")
    (expected,) = torch.autograd.grad(expected_loss, logits)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(ours, expected)


def test_label_smoothed_loss_stays_exact_where_the_label_is_improbable():
    # The label's probability underflows float32 (exp(-300) = 0) and the logits sit far from 0: the loss is read
    # from the log-sum-exp, not from the probability, so it stays finite and equal to torch's.
    logits = torch.tensor([[0.0, -300.0, 5.0], [1e4, 1e4 - 1.0, 1e4 - 2.0]], requires_grad=True)
    labels = torch.tensor([1, 2])
    loss, nll = label_smoothed_loss(logits, labels, smoothing=0.1)
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels, label_smoothing=0.1, reduction="sum"))
    torch.testing.assert_close(nll, F.cross_entropy(logits, labels, reduction="sum"))
    (grad,) = torch.autograd.grad(loss, logits)
    (expected,) = torch.autograd.grad(F.cross_entropy(logits, labels, label_smoothing=0.1, reduction="sum"), logits)
    torch.testing.assert_close(grad, expected)


def test_metrics():
    assert translation_scores(["ein haus", "zwei"], ["ein haus", "drei"])["exact_match"] == 50.0
    scores = accuracy_and_macro_f1([0, 0, 1, 1], [0, 1, 1, 1], 2)
    assert scores["accuracy"] == 75.0
    assert scores["macro_f1"] == pytest.approx(100 * (2 / 3 + 0.8) / 2)
    assert entity_spans(["B-PER", "I-PER", "O", "B-LOC", "I-PER"]) == {(0, 2, "PER"), (3, 4, "LOC"), (4, 5, "PER")}
    f1 = entity_f1([["B-PER", "I-PER", "O"]], [["B-PER", "O", "O"]])
    assert f1["entity_f1"] == 0.0
    assert entity_f1([["B-PER", "O", "B-LOC"]], [["B-PER", "O", "B-LOC"]])["entity_f1"] == 100.0


def test_config_from_toml_and_json_with_overrides(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('dataset = "copy"\nepochs = 2\nwarmup = 50\n[model]\npreset = "tiny"\nd_model = 32\n',
                    encoding="utf-8")
    run = load_run_config(toml, ["epochs=3", "model.n_heads=2"])
    assert run.train.epochs == 3 and run.train.warmup == 50 and run.train.adam_beta2 is None
    assert run.model_config(vocab_size=50).d_model == 32 and run.model_config(vocab_size=50).n_heads == 2
    js = tmp_path / "run.json"
    js.write_text(json.dumps(run.to_dict()), encoding="utf-8")
    assert load_run_config(js) == run
    with pytest.raises(ValueError, match="unknown config key 'epoch'"):
        load_run_config(toml, ["epoch=3"])
    with pytest.raises(ValueError, match="unknown training key"):
        js.write_text(json.dumps({"dataset": "copy", "lr_sclae": 2}), encoding="utf-8")
        load_run_config(js)
    with pytest.raises(ValueError, match="epochs expects an integer"):
        load_run_config(toml, ["epochs=many"])


def test_bf16_is_the_old_spelling_of_precision(tmp_path):
    old_run = tmp_path / "train_config.json"  # as runs saved before `precision` hold it
    old_run.write_text(json.dumps({"task": "copy", "bf16": True}), encoding="utf-8")
    assert load_run_config(old_run).train == TrainConfig(dataset="copy", precision="bf16")
    assert load_run_config(None, ["dataset=copy", "bf16=true"]).train.precision == "bf16"
    assert TrainConfig(dataset="copy").precision is None  # the device's choice, as before
    assert "bf16" not in TrainConfig(dataset="copy", bf16=True).to_dict()
    with pytest.raises(ValueError, match="bf16=true and precision=fp32 disagree"):
        TrainConfig(dataset="copy", bf16=True, precision="fp32")
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, got 'int8'"):
        TrainConfig(dataset="copy", precision="int8")


def test_beam_size_is_the_old_spelling_of_num_beams(tmp_path):
    old_run = tmp_path / "train_config.json"  # as runs saved before `num_beams` hold it
    old_run.write_text(json.dumps({"task": "copy", "beam_size": 2}), encoding="utf-8")
    run = load_run_config(old_run)
    assert run.train == TrainConfig(dataset="copy", num_beams=2) and "num_beams" in run.given
    assert "beam_size" not in run.to_dict() and run.to_dict()["num_beams"] == 2
    assert load_run_config(old_run, ["num_beams=3"]).train.num_beams == 3  # an override replaces the file's
    assert load_run_config(None, ["dataset=copy", "beam_size=2"]).train.num_beams == 2
    assert load_run_config(None, ["dataset=copy", "beam_size=2", "num_beams=2"]).train.num_beams == 2
    with pytest.raises(ValueError, match=r"^beam_size=2 and num_beams=3 disagree: keep num_beams"):
        load_run_config(None, ["dataset=copy", "beam_size=2", "num_beams=3"])
    old_run.write_text(json.dumps({"task": "copy", "beam_size": 2, "num_beams": 3}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"train_config.json: beam_size=2 and num_beams=3 disagree"):
        load_run_config(old_run)
    with pytest.raises(ValueError, match="beam_size expects an integer, got 'four'"):
        load_run_config(None, ["dataset=copy", "beam_size=four"])



def test_task_keys_are_the_old_spelling_of_dataset_keys(tmp_path):
    old = {"task": "copy", "task_train": 60, "task_valid": 5, "task_test": 6, "task_max_number": 100,
           "task_max_len": 4}
    new = TrainConfig(dataset="copy", dataset_train=60, dataset_valid=5, dataset_test=6, dataset_max_number=100,
                      dataset_max_len=4)
    old_run = tmp_path / "train_config.json"  # as runs saved before `dataset` hold it
    old_run.write_text(json.dumps(old), encoding="utf-8")
    run = load_run_config(old_run)
    assert run.train == new and {"dataset", "dataset_train", "dataset_max_len"} <= run.given
    assert not any(key.startswith("task") for key in run.to_dict()) and run.to_dict()["dataset"] == "copy"
    assert load_run_config(old_run, ["dataset_train=70"]).train.dataset_train == 70  # an override replaces the file's
    assert load_run_config(None, [f"{key}={value}" for key, value in old.items()]).train == new
    toml = tmp_path / "old.toml"
    toml.write_text('task = "copy"\ntask_train = 60\n', encoding="utf-8")
    assert load_run_config(toml).train == TrainConfig(dataset="copy", dataset_train=60)
    assert load_run_config(None, ["task=copy", "dataset=copy"]).train.dataset == "copy"
    with pytest.raises(ValueError, match=r"^task=copy and dataset=numbers disagree: keep dataset"):
        load_run_config(None, ["task=copy", "dataset=numbers"])
    old_run.write_text(json.dumps({"dataset": "copy", "task_train": 60, "dataset_train": 70}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"train_config.json: task_train=60 and dataset_train=70 disagree"):
        load_run_config(old_run)
    with pytest.raises(ValueError, match="task_train expects an integer, got 'many'"):
        load_run_config(None, ["task=copy", "task_train=many"])

def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    model = build_model(preset("tiny").replace(vocab_size=50, d_model=16, n_heads=2, d_ff=32))
    first = ckpt.save_checkpoint(tmp_path, model, {"step": 1}, step=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def broken_save(obj, handle):
        handle.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, model, {"step": 2}, step=2)
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(tmp_path) == first
    assert not (tmp_path / ckpt.checkpoint_name(2)).exists()
    assert not list(tmp_path.glob(".*.tmp"))
    fresh = build_model(model.config)
    assert ckpt.load_checkpoint(first, fresh) == {"step": 1}
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, before[name])


def test_keep_last_best_and_averaging(tmp_path):
    model = build_model(preset("tiny").replace(vocab_size=50, d_model=16, n_heads=2, d_ff=32))
    values = []
    for step in range(1, 6):
        with torch.no_grad():
            model.encoder.layers[0].self_attn.q_proj.weight.fill_(float(step))
        path = ckpt.save_checkpoint(tmp_path, model, {"step": step}, step=step)
        values.append(step)
        if step == 2:
            ckpt.mark_best(tmp_path, path)
        ckpt.prune_checkpoints(tmp_path, keep_last=2)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step-00000002", "step-00000004", "step-00000005"]
    assert ckpt.best_checkpoint(tmp_path).name == "step-00000002"
    ckpt.average_checkpoints(model, ckpt.list_checkpoints(tmp_path)[-2:])
    assert float(model.encoder.layers[0].self_attn.q_proj.weight.detach()[0, 0]) == pytest.approx(4.5)
