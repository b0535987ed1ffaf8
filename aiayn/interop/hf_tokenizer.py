"""aiayn tokenizers as Hugging Face `PreTrainedTokenizerFast` files (`AutoTokenizer.from_pretrained` loads them).

The `tokenizers` JSON is written as it is (the same pieces, the same ids, lossless decoding), with a
post-processor that adds the special tokens aiayn's code adds: `[CLS] text [SEP]` for encoders
(`template="encoder"`), `text </s>` for translation sources (`template="marian"`, as Marian), `<s> text` for
prompts of a decoder-only language model (`template="decoder"`, which continues them).
`tokenizer_config.json` names the special tokens, keeps literal `<s>` in user text as text
(`split_special_tokens`) where aiayn does, turns off the clean-up that would change spaces on
decoding, and lists `model_input_names`: exactly the inputs the exported model takes.
"""

from __future__ import annotations

import json
from pathlib import Path

from aiayn.rundir import atomic_write_text
from aiayn.tokenization import Tokenizer

TEMPLATES = ("encoder", "marian", "decoder")


def _post_processor(tokenizer: Tokenizer, template: str):
    from tokenizers import processors

    eos = tokenizer.special["eos"]
    if template == "decoder":
        bos = tokenizer.special["bos"]
        return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B:1",
                                             special_tokens=[(bos, tokenizer.bos_id)])
    if template == "marian":
        return processors.TemplateProcessing(single=f"$A {eos}", pair=f"$A $B {eos}",
                                             special_tokens=[(eos, tokenizer.eos_id)])
    cls = tokenizer.special["bos"]
    return processors.TemplateProcessing(single=f"{cls} $A {eos}", pair=f"{cls} $A {eos} $B:1 {eos}:1",
                                         special_tokens=[(cls, tokenizer.bos_id), (eos, tokenizer.eos_id)])


def save_hf_tokenizer(tokenizer: Tokenizer, directory: str | Path, *, template: str, max_len: int,
                      model_input_names: tuple[str, ...] = ("input_ids", "attention_mask")) -> Path:
    """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` into `directory`.

    Args:
        tokenizer: an aiayn tokenizer (its own or a BERT checkpoint's).
        template: "encoder" (`[CLS] text [SEP]`; a checkpoint's own post-processor is kept),
            "marian" (`text </s>`, a translation source as Marian writes it) or "decoder" (`<s> text`, a prompt).
        max_len: `model_max_length`, the most tokens the model takes.
        model_input_names: what calling the tokenizer returns (`token_type_ids` only for models with segments).
    """
    from tokenizers import Tokenizer as HFTokenizer

    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    directory = Path(directory)
    hf = HFTokenizer.from_str(tokenizer.hf.to_str())
    if template != "encoder" or hf.post_processor is None:  # aiayn adds specials in code; HF needs a template
        hf.post_processor = _post_processor(tokenizer, template)
    atomic_write_text(directory / "tokenizer.json", hf.to_str())
    roles = {"pad": "pad_token", "eos": "eos_token", "unk": "unk_token", "mask": "mask_token"}
    roles.update({"bos": "cls_token"} if template == "encoder" else {"bos": "bos_token"})
    if template == "encoder":
        roles["eos"] = "sep_token"
    special = {name: tokenizer.special[role] for role, name in roles.items() if tokenizer.special[role] is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False, "split_special_tokens": tokenizer.literal_specials,
              "model_input_names": list(model_input_names), **special}
    atomic_write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    atomic_write_text(directory / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")
    return directory
