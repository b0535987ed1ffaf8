"""Which Hugging Face model holds an aiayn translator: Marian for post-LN layers, Pegasus for pre-LN ones.

Both are the paper's encoder-decoder under the same names; they differ in where the LayerNorm sits
(`norm_first`) and in Pegasus's final LayerNorm after each stack. The CTranslate2 export goes through
the same form, so the choice is made here once.
"""

from __future__ import annotations

from pathlib import Path

from aiayn.config import ModelConfig
from aiayn.interop import marian, pegasus
from aiayn.nn.model import EncoderDecoderModel
from aiayn.tokenization import Tokenizer


def hf_family(cfg: ModelConfig) -> str:
    """"pegasus" for a pre-LN translator, "marian" for a post-LN one."""
    return "pegasus" if cfg.norm_first else "marian"


def check_mappable(cfg: ModelConfig) -> None:
    """ValueError naming every option of `cfg` that its Hugging Face family cannot express."""
    (pegasus if cfg.norm_first else marian).check_mappable(cfg)


def to_hf(model: EncoderDecoderModel, *, decoder_start_token_id: int | None = None, eos_token_id: int = 2):
    """`model` as a `MarianMTModel` (post-LN) or `PegasusForConditionalGeneration` (pre-LN), eval mode."""
    to = pegasus.to_pegasus if model.config.norm_first else marian.to_marian
    return to(model, decoder_start_token_id=decoder_start_token_id, eos_token_id=eos_token_id)


def export_hf(model: EncoderDecoderModel, source_tokenizer: Tokenizer, target_tokenizer: Tokenizer,
              directory: str | Path) -> Path:
    """Write a trained translator and its tokenizer(s) as Marian (post-LN) or Pegasus (pre-LN) into `directory`."""
    if model.config.norm_first:
        return pegasus.export_pegasus(model, source_tokenizer, directory)
    return marian.export_marian(model, source_tokenizer, target_tokenizer, directory)
