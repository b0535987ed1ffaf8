"""aiayn pre-LN -> Hugging Face Pegasus: equal logits and equal generate() outputs; why M2M100 cannot hold the model."""

import pytest
import torch

from aiayn.inference.generation import GenerationConfig, generate
from aiayn.nn.embedding import sinusoidal_table
from aiayn.nn.model import build_model
from tests.interop.test_marian import PAD, marian_like, padded

transformers = pytest.importorskip("transformers")
from aiayn.interop.pegasus import to_pegasus  # noqa: E402

BOS, EOS = 1, 2
transformers.logging.set_verbosity_error()


def pre_ln(seed: int, **changes) -> torch.nn.Module:
    """A tiny random pre-LN model in the paper's interleaved layout (as `aiayn train` makes it), outputs varied."""
    split = marian_like(seed, norm_first=True, **changes)
    model = build_model(split.config.replace(pe_layout="interleaved")).eval()
    model.load_state_dict(split.state_dict())
    return model


def _until_eos(row: torch.Tensor) -> list[int]:
    ids = row[1:].tolist()  # drop the decoder start token
    return ids[: ids.index(EOS)] if EOS in ids else ids


@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": False, "activation": "gelu"}])
def test_logits_equal_pegasus_after_saving_and_loading(changes, tmp_path):
    model = pre_ln(0, **changes)
    to_pegasus(model, decoder_start_token_id=BOS).save_pretrained(tmp_path)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "PegasusForConditionalGeneration"
    src, tgt = padded(), torch.randint(4, 24, (4, 6))
    tgt[:, 0] = BOS
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=(src != PAD).long(), decoder_input_ids=tgt).logits
        torch.testing.assert_close(model(src, tgt), theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_generate_returns_the_same_sequences(seed):
    model = pre_ln(seed)
    hf = to_pegasus(model, decoder_start_token_id=BOS, eos_token_id=EOS)
    src = padded()
    seen = set()
    for beam in (1, 4):
        ours = generate(model, src, bos_id=BOS, eos_id=EOS,
                        config=GenerationConfig(max_new_tokens=12, num_beams=beam, length_penalty=0.6))
        with torch.no_grad():
            out = hf.generate(input_ids=src, attention_mask=(src != PAD).long(), num_beams=beam, max_length=13,
                              length_penalty=0.6, early_stopping=False, do_sample=False)
        assert ours.tokens == [_until_eos(row) for row in out], beam
        seen.update(tuple(t) for t in ours.tokens)
    assert len(seen) > 2  # varied outputs, not one degenerate sequence


def test_unmappable_models_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="Pegasus is pre-LN \\(export a post-LN model as Marian\\)"):
        to_pegasus(marian_like(0))
    with pytest.raises(ValueError, match="one vocabulary .*shared_vocab=true"):
        to_pegasus(marian_like(0, norm_first=True, share_embeddings=False, tgt_vocab_size=30))


def test_m2m100_positions_are_not_the_papers():
    """M2M100, the other pre-LN translator, recomputes fairseq's sinusoids on load: other frequencies, positions
    from padding_idx + 1. No order of its columns gives the paper's table, so no M2M100 checkpoint holds aiayn's
    model; Pegasus's stored table is the paper's, split."""
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding

    d_model, length = 16, 20
    theirs = M2M100SinusoidalPositionalEmbedding(length, d_model, padding_idx=PAD)(torch.ones(1, length).long())[0]
    ours = sinusoidal_table(length, d_model, layout="split")
    nearest = torch.cdist(theirs.T, ours.T).min(dim=1).values  # each M2M100 column's closest aiayn column
    assert nearest.max() > 1.0
    pegasus = to_pegasus(pre_ln(0)).model.encoder.embed_positions.weight[:length]
    torch.testing.assert_close(pegasus, sinusoidal_table(length, 32, layout="split"), atol=1e-6, rtol=0)
