"""The objective names: the one place they are spelled (run configs and checkpoints store them as they are here).

This file imports nothing, so the config and the model builder (layers below the task objects) may name a
head without reaching up. Everything that differs between objectives lives on the task objects beside it.
"""

SEQ2SEQ = "seq2seq"
SEQUENCE_CLASSIFICATION = "sequence_classification"
TOKEN_CLASSIFICATION = "token_classification"
MASKED_LM = "masked_lm"
CAUSAL_LM = "causal_lm"

OBJECTIVES = (SEQ2SEQ, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, MASKED_LM, CAUSAL_LM)
# The encoder-only objectives are also the names of their model heads (`ModelConfig.head`).
ENCODER_OBJECTIVES = (SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, MASKED_LM)
# Heads that end in one logit per label (so `num_labels` comes from the data's labels).
LABELLED = (SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION)
